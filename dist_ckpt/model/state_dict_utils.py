"""Helpers for splitting sharded state dicts and renaming their sharded keys."""

from __future__ import annotations

from typing import Any, Dict, Tuple

from dist_ckpt.errors import InvalidShardedTensorError
from dist_ckpt.model.dict_utils import dict_list_map_inplace, extract_matching_values
from dist_ckpt.model.sharded import (
    LocalNonPersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)


def _split(sharded_state_dict: ShardedStateDict, types: Tuple[type, ...]) -> Tuple[ShardedStateDict, StateDict]:
    matching, rest = extract_matching_values(sharded_state_dict, lambda v: isinstance(v, types))
    return matching, rest  # type: ignore[return-value]


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (ShardedTensor leaves, every other leaf), both keeping the nesting."""
    return _split(sharded_state_dict, (ShardedTensor,))


def extract_sharded_tensors_and_factories(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (ShardedTensor and ShardedTensorFactory leaves, every other leaf)."""
    return _split(sharded_state_dict, (ShardedTensor, ShardedTensorFactory))


def extract_sharded_tensors_or_nonpersistent(
    sharded_state_dict: ShardedStateDict,
) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (ShardedTensor, ShardedTensorFactory and LocalNonPersistentObject leaves, rest)."""
    return _split(sharded_state_dict, (ShardedTensor, ShardedTensorFactory, LocalNonPersistentObject))


def extract_sharded_base(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """Split into (every ShardedBase leaf, every other leaf)."""
    return _split(sharded_state_dict, (ShardedBase,))


def extract_nonpersistent(sharded_state_dict: ShardedStateDict) -> Tuple[StateDict, ShardedStateDict]:
    """Split into (LocalNonPersistentObject leaves, every other leaf)."""
    return _split(sharded_state_dict, (LocalNonPersistentObject,))


def filter_out_empty_flatten_tensor(sharded_state_dict: ShardedStateDict) -> ShardedStateDict:
    """A copy of the structure without the ShardedTensors whose ``flattened_range`` is empty.

    A rank of a distributed optimizer (or a custom FSDP) may hold an empty slice of a tensor: it
    contributes no element, and torch.distributed.checkpoint refuses a zero-length local shard,
    so the save and load preprocessing of Megatron-Core drop it. Every other leaf is kept; the
    input is not modified.

    Example:

    ```python
    st = ShardedTensor.from_rank_offsets_flat("w", torch.zeros(0), (4,), flattened_range=slice(2, 2))
    filter_out_empty_flatten_tensor({"w": st, "step": 1})      # {'step': 1}
    ```
    """

    def non_empty(v: Any) -> bool:
        rng = v.flattened_range if isinstance(v, ShardedTensor) else None
        return rng is None or rng.start != rng.stop

    kept, _ = extract_matching_values(sharded_state_dict, non_empty)
    return kept  # type: ignore[return-value]


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend ``prefix`` to the key of every ShardedBase leaf, in place."""

    def add_prefix(x: Any) -> Any:
        if isinstance(x, ShardedBase):
            x.key = f"{prefix}{x.key}"
        return x

    dict_list_map_inplace(add_prefix, sharded_state_dict)


def replace_prefix_for_sharding(sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str) -> None:
    """Replace ``old_prefix`` by ``new_prefix`` in every sharded key, in place.

    Raises:
        InvalidShardedTensorError: if a sharded key does not start with ``old_prefix``.
    """

    def replace_prefix(x: Any) -> Any:
        if isinstance(x, (ShardedTensor, ShardedTensorFactory, ShardedObject)):
            if not x.key.startswith(old_prefix):
                raise InvalidShardedTensorError(
                    f"expected every sharded key to start with {old_prefix!r}, got {x.key!r}"
                )
            x.key = f"{new_prefix}{x.key[len(old_prefix) :]}"
        return x

    dict_list_map_inplace(replace_prefix, sharded_state_dict)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: Dict[str, str]) -> None:
    """Rename sharded keys by the first matching prefix of ``prefix_map`` (old -> new), in place.

    Keys that match no prefix are left unchanged.
    """

    def replace_prefix(x: Any) -> Any:
        if isinstance(x, (ShardedTensor, ShardedTensorFactory, ShardedObject)):
            for old_prefix, new_prefix in prefix_map.items():
                if x.key.startswith(old_prefix):
                    x.key = f"{new_prefix}{x.key[len(old_prefix) :]}"
                    break
        return x

    dict_list_map_inplace(replace_prefix, sharded_state_dict)
