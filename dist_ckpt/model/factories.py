"""Factories: tensors transformed into sharded sub-state-dicts on save, merged back on load.

Re-exported by [`dist_ckpt.model.sharded`][dist_ckpt.model.sharded], where Megatron-Core code looks for them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Tuple

import torch

from dist_ckpt.errors import InvalidShardedTensorError, StateDictStructureError
from dist_ckpt.model.dict_utils import dict_list_map_inplace
from dist_ckpt.model.sharded_base import (
    FactoryBuildFn,
    FactoryMergeFn,
    ReplicaId,
    ShardedBase,
    ShardedStateDict,
    check_key,
    check_replica_id,
)


def _takes_flattened_range(fn: Callable[..., Any]) -> bool:
    """Whether a factory build_fn takes Megatron-Core 0.10's fourth ``flattened_range`` argument.

    The reference API documents ``build_fn(key, data, replica_id)``; Megatron-Core 0.10+ passes
    ``flattened_range`` as a fourth argument. Both forms are accepted so that factories written
    for either run unchanged.
    """
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 4 or any(p.kind == p.VAR_POSITIONAL for p in params)


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor transformed into a sharded sub-state-dict on save and merged back on load.

    Useful for transformations that apply equally to a parameter and its optimizer state (for
    example splitting a fused weight into separately resharded parts).

    Args:
        key: unique identifier of the factory.
        data: the original tensor.
        build_fn: ``build_fn(key, data, replica_id)`` returns the sharded sub-state-dict that
            replaces the factory before saving (a fourth ``flattened_range`` argument is passed
            to functions that take one).
        merge_fn: ``merge_fn(loaded_sub_state_dict)`` turns the loaded sub-state-dict back into
            one tensor (the inverse of ``build_fn``).
        replica_id: see [`ShardedTensor`][dist_ckpt.model.sharded.ShardedTensor].
        flattened_range: passed on to a four-argument ``build_fn``.
    """

    key: str
    data: torch.Tensor
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        check_key(self.key)
        if not callable(self.build_fn) or not callable(self.merge_fn):
            raise InvalidShardedTensorError(f"{self.key!r}: build_fn and merge_fn must be callable")
        self.replica_id = check_replica_id(self.replica_id, self.key)

    def build(self) -> ShardedStateDict:
        """Apply ``build_fn`` and return the sharded sub-state-dict."""
        if _takes_flattened_range(self.build_fn):
            return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)
        if self.flattened_range is not None:
            raise InvalidShardedTensorError(
                f"{self.key!r}: the factory has a flattened_range but its build_fn takes only "
                f"(key, data, replica_id); add a fourth flattened_range parameter"
            )
        return self.build_fn(self.key, self.data, self.replica_id)

    def without_data(self) -> "ShardedTensorFactory":
        return replace(self, data=None)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(key={self.key!r})"


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every [`ShardedTensorFactory`][dist_ckpt.model.factories.ShardedTensorFactory] by the sub-state-dict it
    builds (in place)."""

    def apply(x: Any) -> Any:
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    dict_list_map_inplace(apply, sharded_state_dict)


def apply_factory_merges(x1: Any, x2: Any, key: Tuple[Any, ...] = ()) -> Any:
    """Merge loaded sub-state-dicts back into tensors, as the factories in ``x2`` define.

    Args:
        x1: the loaded state dict (modified in place and returned).
        x2: a subset of ``x1``'s structure whose leaves are the factories that built it.
        key: path of the current recursion, for error messages.
    """
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    where = "/".join(map(str, key)) or "<root>"
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                raise StateDictStructureError(
                    f"factory merge at {where!r}: key {k!r} of the factories is missing from the loaded state dict"
                )
            x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise StateDictStructureError(
                f"factory merge at {where!r}: lists differ in length ({len(x1)} vs {len(x2)})"
            )
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key + (i,))
    elif isinstance(x1, list) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if not isinstance(k, int) or not 0 <= k < len(x1):
                raise StateDictStructureError(
                    f"factory merge at {where!r}: index {k!r} does not fit a list of {len(x1)}"
                )
            x1[k] = apply_factory_merges(x1[k], v2, key + (k,))
    else:
        raise StateDictStructureError(
            f"factory merge at {where!r}: cannot merge {type(x2).__name__} into {type(x1).__name__}"
        )
    return x1
