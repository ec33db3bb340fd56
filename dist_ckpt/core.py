"""Megatron-Core module path ``dist_ckpt.core``: re-exports [`dist_ckpt.record.commit`][dist_ckpt.record.commit].

Code written for ``megatron.core.dist_checkpointing.core`` imports from here unchanged.
"""

from dist_ckpt.record.commit import (
    HF_CONFIG,
    METADATA_FILENAME,
    CheckpointingConfig,
    CheckpointingException,
    check_is_distributed_checkpoint,
    detect_config,
    maybe_load_config,
    new_save_id,
    read_config,
    save_config,
)

__all__ = [
    "CheckpointingConfig",
    "CheckpointingException",
    "HF_CONFIG",
    "METADATA_FILENAME",
    "check_is_distributed_checkpoint",
    "detect_config",
    "maybe_load_config",
    "new_save_id",
    "read_config",
    "save_config",
]
