"""Megatron-Core module path ``dist_ckpt.utils``: re-exports
[`dist_ckpt.model.state_dict_utils`][dist_ckpt.model.state_dict_utils].

Code written for ``megatron.core.dist_checkpointing.utils`` imports from here unchanged.
"""

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
    "extract_nonpersistent",
    "extract_sharded_base",
    "extract_sharded_tensors",
    "extract_sharded_tensors_and_factories",
    "extract_sharded_tensors_or_nonpersistent",
    "replace_prefix_for_sharding",
]
