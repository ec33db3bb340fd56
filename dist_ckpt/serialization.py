"""Megatron-Core module path ``dist_ckpt.serialization``:
re-exports [`dist_ckpt.engine.save`][dist_ckpt.engine.save], [`dist_ckpt.engine.load`][dist_ckpt.engine.load],
[`dist_ckpt.engine.load_parts`][dist_ckpt.engine.load_parts]
and ``load_content_metadata`` of [`dist_ckpt.engine.preprocess`][dist_ckpt.engine.preprocess].

Code written for ``megatron.core.dist_checkpointing.serialization`` imports from here unchanged.
"""

from dist_ckpt.engine.checks.sharding import validate_sharding_integrity
from dist_ckpt.engine.load import LoadResult, get_default_load_sharded_strategy, load, load_with_report
from dist_ckpt.engine.load_parts import (
    load_common_state_dict,
    load_plain_tensors,
    load_sharded_metadata,
    load_sharded_objects,
    load_tensors_metadata,
    remove_sharded_tensors,
)
from dist_ckpt.engine.preprocess import load_content_metadata
from dist_ckpt.engine.save import (
    SaveResult,
    get_default_save_common_strategy,
    get_default_save_sharded_strategy,
    save,
    save_with_report,
)

__all__ = [
    "LoadResult",
    "SaveResult",
    "get_default_load_sharded_strategy",
    "get_default_save_common_strategy",
    "get_default_save_sharded_strategy",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_sharded_objects",
    "load_tensors_metadata",
    "load_with_report",
    "remove_sharded_tensors",
    "save",
    "save_with_report",
    "validate_sharding_integrity",
]
