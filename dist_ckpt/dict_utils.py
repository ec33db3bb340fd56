"""Megatron-Core module path ``dist_ckpt.dict_utils``: re-exports
[`dist_ckpt.model.dict_utils`][dist_ckpt.model.dict_utils].

Code written for ``megatron.core.dist_checkpointing.dict_utils`` imports from here unchanged.
"""

from dist_ckpt.model.dict_utils import (
    Nested,
    dict_list_map_inplace,
    dict_list_map_outplace,
    dict_map,
    dict_map_with_key,
    diff,
    extract_matching_values,
    inspect_types,
    map_reduce,
    merge,
    nested_items_iter,
    nested_values,
)

__all__ = [
    "Nested",
    "dict_list_map_inplace",
    "dict_list_map_outplace",
    "dict_map",
    "dict_map_with_key",
    "diff",
    "extract_matching_values",
    "inspect_types",
    "map_reduce",
    "merge",
    "nested_items_iter",
    "nested_values",
]
