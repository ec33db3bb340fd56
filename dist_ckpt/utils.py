"""Megatron-Core module path ``dist_ckpt.utils``: re-exports
[`dist_ckpt.model.state_dict_utils`][dist_ckpt.model.state_dict_utils],
[`dist_ckpt.model.debug_log`][dist_ckpt.model.debug_log], [`dist_ckpt.model.fp8`][dist_ckpt.model.fp8]
and ``zip_strict`` of [`dist_ckpt.model.dict_utils`][dist_ckpt.model.dict_utils].

Code written for ``megatron.core.dist_checkpointing.utils`` imports from here unchanged.
"""

from dist_ckpt.model.debug_log import debug_msg, debug_time, logger_stack
from dist_ckpt.model.dict_utils import zip_strict
from dist_ckpt.model.fp8 import force_all_tensors_to_non_fp8
from dist_ckpt.model.state_dict_utils import (
    add_prefix_for_sharding,
    apply_prefix_mapping,
    extract_nonpersistent,
    extract_sharded_base,
    extract_sharded_tensors,
    extract_sharded_tensors_and_factories,
    extract_sharded_tensors_or_nonpersistent,
    replace_prefix_for_sharding,
)

__all__ = [
    "add_prefix_for_sharding",
    "apply_prefix_mapping",
    "debug_msg",
    "debug_time",
    "extract_nonpersistent",
    "extract_sharded_base",
    "extract_sharded_tensors",
    "extract_sharded_tensors_and_factories",
    "extract_sharded_tensors_or_nonpersistent",
    "force_all_tensors_to_non_fp8",
    "logger_stack",
    "replace_prefix_for_sharding",
    "zip_strict",
]
