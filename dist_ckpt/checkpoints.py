"""Megatron-Core module path ``dist_ckpt.checkpoints``: re-exports
[`dist_ckpt.training.checkpoints`][dist_ckpt.training.checkpoints].

Code written for ``megatron.core.dist_checkpointing.checkpoints`` imports from here unchanged.
"""

from dist_ckpt.training.checkpoints import (
    CHECKPOINT_NAME_PATTERNS,
    METRICS_FILENAME,
    CheckpointFormat,
    CheckpointMeta,
    RunCheckpoint,
    create_pretrained_symlinks,
    find_latest_checkpoint,
    get_checkpoint_metadata,
    list_checkpoints,
    load_checkpoint_metrics,
    maybe_delete_oldest_checkpoint,
    next_checkpoint_path,
    parse_checkpoint_step,
    save_checkpoint_metrics,
    validate_checkpoint,
)

__all__ = [
    "CHECKPOINT_NAME_PATTERNS",
    "CheckpointFormat",
    "CheckpointMeta",
    "RunCheckpoint",
    "METRICS_FILENAME",
    "create_pretrained_symlinks",
    "find_latest_checkpoint",
    "get_checkpoint_metadata",
    "list_checkpoints",
    "load_checkpoint_metrics",
    "maybe_delete_oldest_checkpoint",
    "next_checkpoint_path",
    "parse_checkpoint_step",
    "save_checkpoint_metrics",
    "validate_checkpoint",
]
