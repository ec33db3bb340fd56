"""The common base of sharded checkpoint entries, and the checks every one of them shares.

Split from [`dist_ckpt.model.sharded`][dist_ckpt.model.sharded] (which re-exports everything here) so that
`dist_ckpt.model.factories` can build on it without an import cycle.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, Iterable, Tuple, Union

import numpy as np
import torch

from dist_ckpt.errors import InvalidShardedTensorError

ReplicaId = Union[int, Tuple[int, ...]]
ShardedStateDict = Dict[str, Any]
StateDict = Dict[str, Any]
CommonStateDict = Dict[str, Any]
FactoryBuildFn = Callable[..., ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


class ShardedBase(ABC):
    """Common interface of everything that is sharded across ranks."""

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raise [`InvalidShardedTensorError`][dist_ckpt.errors.InvalidShardedTensorError] if the fields are
        inconsistent."""

    @abstractmethod
    def without_data(self) -> "ShardedBase":
        """A copy with ``data=None``: the metadata exchanged between ranks."""


def as_int(value: Any, what: str, key: str) -> int:
    """``value`` as an int; bools, floats and strings are rejected, not truncated."""
    if isinstance(value, bool):
        raise InvalidShardedTensorError(f"{what} of {key!r} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidShardedTensorError(f"{what} of {key!r} must be an int, got {value!r}") from None


def as_int_tuple(value: Any, what: str, key: str) -> Tuple[int, ...]:
    """``value`` (a shape, an offset) as a tuple of non-negative ints; raise naming ``what`` and
    ``key`` if it is not one."""
    # the common case first -- already a tuple of non-negative ints (every shard of every save
    # and load passes here several times, and every decoded peer shard too): no conversion
    if type(value) is tuple and all(type(v) is int and v >= 0 for v in value):
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise InvalidShardedTensorError(f"{what} of {key!r} must be a sequence of ints, got {value!r}")
    try:
        out = tuple(as_int(v, what, key) for v in value)
    except InvalidShardedTensorError:
        raise InvalidShardedTensorError(f"{what} of {key!r} must be a sequence of ints, got {value!r}") from None
    if any(v < 0 for v in out):
        raise InvalidShardedTensorError(f"{what} of {key!r} must be non-negative, got {out}")
    return out


def check_replica_id(replica_id: Any, key: str) -> ReplicaId:
    """``replica_id`` as a plain int or tuple of ints, each non-negative; raise naming ``key`` if it
    is anything else (every sharded entry's check, whatever builds it)."""
    if isinstance(replica_id, (int, np.integer)) and not isinstance(replica_id, bool):
        if replica_id < 0:
            raise InvalidShardedTensorError(f"replica_id of {key!r} must be >= 0, got {replica_id}")
        return int(replica_id)
    if isinstance(replica_id, (tuple, list)) and all(
        isinstance(r, (int, np.integer)) and not isinstance(r, bool) and r >= 0 for r in replica_id
    ):
        return tuple(int(r) for r in replica_id)
    raise InvalidShardedTensorError(
        f"replica_id of {key!r} must be a non-negative int or a tuple of them, got {replica_id!r}"
    )


def check_key(key: Any) -> None:
    """Raise unless ``key`` is a non-empty str: the type check every sharded entry makes when
    built (what a key may contain is the storage's rule, ``dist_ckpt.storage.validate_key()``, checked at save)."""
    if not isinstance(key, str) or not key:
        raise InvalidShardedTensorError(f"a sharded key must be a non-empty str, got {key!r}")


class LocalNonPersistentObject:
    """A value that is never saved; on load the local value is put back in its place.

    Example: optimizer ``param_groups[i]['params']`` (ids that are only meaningful locally).
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        """The wrapped local value."""
        return self.obj

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.obj!r})"


#: Megatron-Core spellings of :class:`LocalNonPersistentObject`.
LocalNonpersistentObject = LocalNonPersistentObject
LocalNonpersitentObject = LocalNonPersistentObject


def is_main_replica(replica_id: ReplicaId) -> bool:
    """True for the replica that is saved: ``0`` or a tuple of zeros."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)
