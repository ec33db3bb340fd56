"""Classes that describe how a rank's local data maps onto global checkpoint entries.

A *sharded state dict* is a nested dict/list whose leaves are ordinary objects (saved once, by
rank 0, as the "common" state) or `ShardedBase` instances:

* [`ShardedTensor`][dist_ckpt.model.sharded.ShardedTensor] -- this rank's part of a global tensor, resharded freely on
  load;
* [`ShardedObject`][dist_ckpt.model.sharded.ShardedObject] -- this rank's part of a global grid of opaque objects;
* [`ShardedTensorFactory`][dist_ckpt.model.factories.ShardedTensorFactory] -- a tensor transformed into a sub-state-dict
  before saving and merged back after loading;
* [`LocalNonPersistentObject`][dist_ckpt.model.sharded_base.LocalNonPersistentObject] -- a value kept out of the
  checkpoint and restored locally.

Every class checks its own arguments on construction and raises
[`InvalidShardedTensorError`][dist_ckpt.errors.InvalidShardedTensorError] naming the key.

Example:

```python
w = ShardedTensor.from_rank_offsets("layer.weight", local_w, (0, tp_rank, tp_size),
                                    replica_id=dp_rank)
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from dist_ckpt.errors import InvalidShardedTensorError
from dist_ckpt.model.sharded_base import (
    CommonStateDict,
    FactoryBuildFn,
    FactoryMergeFn,
    LocalNonPersistentObject,
    LocalNonpersistentObject,
    LocalNonpersitentObject,
    ReplicaId,
    ShardedBase,
    ShardedStateDict,
    StateDict,
    as_int,
    as_int_tuple,
    check_key,
    check_replica_id,
    is_main_replica,
)


@dataclass
class ShardedTensor(ShardedBase):
    """This rank's part of a global tensor.

    Args:
        key: unique identifier of the global tensor.
        data: the local tensor; None only for metadata exchange and validation.
        dtype: tensor dtype.
        local_shape: shape of the local tensor (before flattening).
        global_shape: shape of the global tensor.
        global_offset: offset of the local tensor in the global one, in elements, one entry per
            global axis (prepended axes included).
        axis_fragmentations: into how many chunks each global axis is split, if known.
        replica_id: 0 (or all zeros) marks the main replica, the one that gets saved.
        prepend_axis_num: number of leading global axes the local tensor lacks (like
            unsqueezing the local tensor); e.g. the pipeline-stage axis of stacked layers.
        allow_shape_mismatch: on load, the stored global shape may differ from
            ``global_shape``; the overlap is loaded and the rest zero-filled (pad / crop).
        flattened_range: ``data`` is ``local.flatten()[flattened_range]`` (distributed
            optimizer); ``local_shape`` still describes the unflattened local tensor.
    """

    key: str
    data: Optional[torch.Tensor] = field(repr=False)
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Check that the fields describe a valid shard; raise naming the key if not."""
        key = self.key
        check_key(key)
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidShardedTensorError(f"dtype of {key!r} must be a torch.dtype, got {self.dtype!r}")
        self.local_shape = as_int_tuple(self.local_shape, "local_shape", key)
        self.global_shape = as_int_tuple(self.global_shape, "global_shape", key)
        self.global_offset = as_int_tuple(self.global_offset, "global_offset", key)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = as_int_tuple(self.axis_fragmentations, "axis_fragmentations", key)
        self.replica_id = check_replica_id(self.replica_id, key)
        ndim = len(self.global_shape)
        if not isinstance(self.prepend_axis_num, int) or self.prepend_axis_num < 0:
            raise InvalidShardedTensorError(
                f"prepend_axis_num of {key!r} must be a non-negative int, got {self.prepend_axis_num!r}"
            )
        if len(self.global_offset) != ndim:
            raise InvalidShardedTensorError(
                f"{key!r}: global_offset {self.global_offset} and global_shape {self.global_shape} "
                f"have different lengths"
            )
        if len(self.local_shape) + self.prepend_axis_num != ndim:
            raise InvalidShardedTensorError(
                f"{key!r}: local_shape {self.local_shape} plus prepend_axis_num="
                f"{self.prepend_axis_num} does not match the {ndim} axes of global_shape "
                f"{self.global_shape}"
            )
        if self.axis_fragmentations is not None and len(self.axis_fragmentations) != ndim:
            raise InvalidShardedTensorError(
                f"{key!r}: axis_fragmentations {self.axis_fragmentations} must have one entry per global axis ({ndim})"
            )
        for axis, (off, loc, glob) in enumerate(zip(self.global_offset, self.full_local_shape, self.global_shape)):
            if off + loc > glob:
                raise InvalidShardedTensorError(
                    f"{key!r}: along axis {axis} the shard [{off}, {off + loc}) exceeds the global "
                    f"size {glob} (global_offset={self.global_offset}, local_shape="
                    f"{self.local_shape}, global_shape={self.global_shape})"
                )
            if axis >= self.prepend_axis_num and loc != 0 and off % loc != 0:
                raise InvalidShardedTensorError(
                    f"{key!r}: global offset {off} along axis {axis} must be a multiple of the local "
                    f"size {loc}: shards of a tensor form a regular grid of equal chunks"
                )
        self._validate_flattened_range()
        self.validate_data()

    def _validate_flattened_range(self) -> None:
        rng = self.flattened_range
        if rng is None:
            return
        if not isinstance(rng, slice) or rng.step not in (None, 1):
            raise InvalidShardedTensorError(f"{self.key!r}: flattened_range must be a slice without step, got {rng!r}")
        numel = math.prod(self.local_shape)
        if not (isinstance(rng.start, int) and isinstance(rng.stop, int)) or not (0 <= rng.start <= rng.stop <= numel):
            raise InvalidShardedTensorError(
                f"{self.key!r}: flattened_range {rng} must lie within [0, {numel}] "
                f"(the size of local_shape {self.local_shape})"
            )

    def validate_data(self) -> None:
        """Check that ``data`` (if any) is a tensor of ``dtype`` and of the shape the fields
        describe; raise naming the key if not. A save checks it again: ``data`` may have been
        replaced since the shard was built."""
        data = self.data
        if data is None:
            return
        if not isinstance(data, torch.Tensor):
            raise InvalidShardedTensorError(f"data of {self.key!r} must be a torch.Tensor, got {type(data).__name__}")
        if data.dtype != self.dtype:
            raise InvalidShardedTensorError(f"{self.key!r}: data dtype {data.dtype} does not match dtype {self.dtype}")
        if self.flattened_range is None:
            if tuple(data.shape) != self.local_shape:
                raise InvalidShardedTensorError(
                    f"{self.key!r}: data shape {tuple(data.shape)} does not match local_shape {self.local_shape}"
                )
        else:
            expected = self.flattened_range.stop - self.flattened_range.start
            if data.ndim != 1 or data.numel() != expected:
                raise InvalidShardedTensorError(
                    f"{self.key!r}: with flattened_range {self.flattened_range} data must be 1-D with "
                    f"{expected} elements, got shape {tuple(data.shape)}"
                )

    @property
    def full_local_shape(self) -> Tuple[int, ...]:
        """Local shape including the prepended axes (each of size 1)."""
        return (1,) * self.prepend_axis_num + tuple(self.local_shape)

    def global_slice(self) -> Tuple[Union[int, slice], ...]:
        """Index of the local (unflattened) tensor in the global tensor.

        Prepended axes are indexed by int, the others by slice.
        """
        prepended = tuple(self.global_offset[: self.prepend_axis_num])
        rest = tuple(
            slice(off, off + sh) for off, sh in zip(self.global_offset[self.prepend_axis_num :], self.local_shape)
        )
        return prepended + rest

    def local_coordinates(self) -> Tuple[np.ndarray, ...]:
        """Coordinates (in the local tensor) of the elements held by a flattened shard."""
        if self.flattened_range is None:
            raise InvalidShardedTensorError(
                f"{self.key!r}: local_coordinates() is defined only for shards with flattened_range"
            )
        flat = np.arange(self.flattened_range.start, self.flattened_range.stop)
        return tuple(np.unravel_index(flat, self.local_shape))

    def global_coordinates(self) -> Tuple[np.ndarray, ...]:
        """Coordinates (in the global tensor) of the elements held by a flattened shard."""
        local = self.local_coordinates()
        n = len(local[0]) if local else 0
        prepended = tuple(np.full(n, off) for off in self.global_offset[: self.prepend_axis_num])
        shifted = tuple(c + off for c, off in zip(local, self.global_offset[self.prepend_axis_num :]))
        return prepended + shifted

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        """Index of this shard's chunk in the global grid of chunks."""
        return tuple(off // sh if sh else 0 for off, sh in zip(self.global_offset, self.full_local_shape))

    def max_allowed_chunks(self) -> Tuple[int, ...]:
        """Largest chunk shape compatible with ``axis_fragmentations`` (global // fragments)."""
        if self.axis_fragmentations is None:
            raise InvalidShardedTensorError(f"{self.key!r}: max_allowed_chunks() needs axis_fragmentations")
        chunks = []
        for axis, (size, fragm) in enumerate(zip(self.global_shape, self.axis_fragmentations)):
            if fragm == 0 or (not self.allow_shape_mismatch and size % fragm != 0):
                raise InvalidShardedTensorError(
                    f"{self.key!r}: axis {axis} of size {size} is not divisible into {fragm} fragments"
                )
            chunks.append(size // fragm)
        return tuple(chunks)

    def without_data(self) -> "ShardedTensor":
        return replace(self, data=None)

    def init_data(self, device: Union[str, torch.device], init_fn: Callable[..., torch.Tensor] = torch.empty) -> None:
        """Allocate ``data`` (if missing) with ``init_fn(local_shape, dtype=..., device=...)``."""
        if self.data is not None:
            return
        data = init_fn(self.local_shape, dtype=self.dtype, device=device)
        if self.flattened_range is not None:
            data = data.flatten()[self.flattened_range.start : self.flattened_range.stop]
        self.data = data

    def narrow(self, dim: int, start: int, length: int) -> List["ShardedTensor"]:
        """The analogue of ``torch.narrow`` applied to the local tensor on every rank.

        Each rank keeps ``length`` of its ``local_shape[dim]`` elements along ``dim``; the
        global tensor shrinks in proportion (e.g. splitting a fused QKV weight into its Q part).
        For a flattened shard only ``dim == 0`` is supported, and the result is empty when the
        narrowed part does not intersect this rank's flattened range.
        """
        if not 0 <= dim < len(self.local_shape):
            raise InvalidShardedTensorError(
                f"{self.key!r}: narrow dim {dim} out of range for local_shape {self.local_shape}"
            )
        local_len = self.local_shape[dim]
        if not (0 <= start and length >= 0 and start + length <= local_len):
            raise InvalidShardedTensorError(
                f"{self.key!r}: narrow({dim}, {start}, {length}) exceeds local size {local_len}"
            )
        gdim = dim + self.prepend_axis_num

        def scaled(value: int) -> int:
            if local_len == 0 or (value * length) % local_len:
                raise InvalidShardedTensorError(
                    f"{self.key!r}: cannot narrow axis {gdim}: {value} * {length} is not divisible by {local_len}"
                )
            return value * length // local_len

        global_shape = list(self.global_shape)
        global_offset = list(self.global_offset)
        global_shape[gdim] = scaled(self.global_shape[gdim])
        global_offset[gdim] = scaled(self.global_offset[gdim])
        local_shape = list(self.local_shape)
        local_shape[dim] = length
        if self.flattened_range is None:
            data = None if self.data is None else self.data.narrow(dim, start, length)
            return [
                replace(
                    self,
                    data=data,
                    local_shape=tuple(local_shape),
                    global_shape=tuple(global_shape),
                    global_offset=tuple(global_offset),
                )
            ]
        if dim != 0:
            raise InvalidShardedTensorError(
                f"{self.key!r}: a flattened ShardedTensor can be narrowed along dim 0 only, got {dim}"
            )
        row = math.prod(self.local_shape[1:])
        lo, hi = start * row, (start + length) * row
        fs, fe = self.flattened_range.start, self.flattened_range.stop
        new_start, new_stop = max(fs, lo), min(fe, hi)
        if new_stop <= new_start:
            return []
        data = None if self.data is None else self.data[new_start - fs : new_stop - fs]
        return [
            replace(
                self,
                data=data,
                local_shape=tuple(local_shape),
                global_shape=tuple(global_shape),
                global_offset=tuple(global_offset),
                flattened_range=slice(new_start - lo, new_stop - lo),
            )
        ]

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs: Any,
    ) -> "ShardedTensor":
        """Build a ShardedTensor from the position of this rank's chunk along each split axis.

        Args:
            key: unique key of the global tensor.
            data: the local tensor.
            rank_offsets: ``(axis, axis_rank_offset, axis_fragm)`` tuples: along global axis
                ``axis`` the tensor is split into ``axis_fragm`` equal chunks and ``data`` is
                chunk number ``axis_rank_offset``.
            replica_id: see [`ShardedTensor`][dist_ckpt.model.sharded.ShardedTensor].
            prepend_axis_num: see [`ShardedTensor`][dist_ckpt.model.sharded.ShardedTensor].

        Example:

        ```python
        # column-parallel weight: rows split over 4 tensor-parallel ranks
        ShardedTensor.from_rank_offsets("fc1.weight", w, (0, tp_rank, 4), replica_id=dp_rank)
        ```
        """
        check_key(key)
        if flattened_range is not None:
            raise InvalidShardedTensorError(
                f"{key!r}: from_rank_offsets does not take flattened_range; use from_rank_offsets_flat"
            )
        if not isinstance(data, torch.Tensor):
            raise InvalidShardedTensorError(f"data of {key!r} must be a torch.Tensor, got {type(data).__name__}")
        prepend_axis_num = as_int(prepend_axis_num, "prepend_axis_num", key)
        if prepend_axis_num < 0:
            raise InvalidShardedTensorError(f"prepend_axis_num of {key!r} must be >= 0, got {prepend_axis_num}")
        ndim = data.ndim + prepend_axis_num
        global_shape = [1] * prepend_axis_num + list(data.shape)
        global_offset = [0] * ndim
        fragmentations = [1] * ndim
        seen = set()
        for entry in rank_offsets:
            if not isinstance(entry, (tuple, list)) or len(entry) != 3:
                raise InvalidShardedTensorError(
                    f"{key!r}: each rank offset must be (axis, axis_rank_offset, axis_fragm), got {entry!r}"
                )
            axis, rank_offset, fragm = (as_int(v, "rank offset entry", key) for v in entry)
            if not 0 <= axis < ndim:
                raise InvalidShardedTensorError(f"{key!r}: axis {axis} out of range for {ndim} global axes")
            if axis in seen:
                raise InvalidShardedTensorError(f"{key!r}: axis {axis} given twice in rank offsets")
            if fragm < 1 or not 0 <= rank_offset < fragm:
                raise InvalidShardedTensorError(
                    f"{key!r}: rank offset {rank_offset} must lie in [0, {fragm}) along axis {axis}"
                )
            seen.add(axis)
            local = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = fragm * local
            global_offset[axis] = rank_offset * local
            fragmentations[axis] = fragm
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(fragmentations),
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: Sequence[int],
        *args: Tuple[int, int, int],
        flattened_range: Optional[slice] = None,
        **kwargs: Any,
    ) -> "ShardedTensor":
        """Like [`from_rank_offsets()`][..from_rank_offsets] for a flattened slice of the local tensor.

        ``data`` is 1-D and equals ``local.flatten()[flattened_range]`` for a local tensor of
        shape ``non_flat_local_shape`` (distributed-optimizer state).
        """
        check_key(key)
        if flattened_range is None:
            raise InvalidShardedTensorError(
                f"{key!r}: from_rank_offsets_flat needs flattened_range; use from_rank_offsets otherwise"
            )
        if not isinstance(data, torch.Tensor) or data.ndim != 1:
            raise InvalidShardedTensorError(f"{key!r}: flattened data must be a 1-D tensor")
        meta = torch.empty(
            as_int_tuple(non_flat_local_shape, "non_flat_local_shape", key), dtype=data.dtype, device="meta"
        )
        template = cls.from_rank_offsets(key, meta, *args, **kwargs)
        return replace(template, data=data, flattened_range=flattened_range)

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(key={self.key!r})"


@dataclass
class ShardedObject(ShardedBase):
    """This rank's part of a global grid of opaque objects (saved as-is, never resharded).

    Args:
        key: unique identifier of the global object.
        data: the local object; None only for metadata exchange and validation.
        global_shape: shape of the grid of objects.
        global_offset: position of this rank's object in the grid (in shards, not elements).
        replica_id: 0 (or all zeros) marks the main replica, the one that gets saved.
    """

    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        check_key(self.key)
        self.global_shape = as_int_tuple(self.global_shape, "global_shape", self.key)
        self.global_offset = as_int_tuple(self.global_offset, "global_offset", self.key)
        self.replica_id = check_replica_id(self.replica_id, self.key)
        if len(self.global_shape) != len(self.global_offset):
            raise InvalidShardedTensorError(
                f"{self.key!r}: global_offset {self.global_offset} and global_shape "
                f"{self.global_shape} have different lengths"
            )
        for off, size in zip(self.global_offset, self.global_shape):
            if off >= size:
                raise InvalidShardedTensorError(
                    f"{self.key!r}: global_offset {self.global_offset} lies outside global_shape {self.global_shape}"
                )

    def without_data(self) -> "ShardedObject":
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        """Key of this particular shard: ``{key}/shard_{offset}_{shape}``."""
        offset = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offset}_{shape}"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> "ShardedObject":
        """Inverse of [`unique_key`][..unique_key], with ``data=None``."""
        key, sep, shard = unique_key.rpartition("/shard_")
        parts = shard.split("_")
        if not sep or len(parts) != 2:
            raise InvalidShardedTensorError(f"{unique_key!r} is not a ShardedObject unique key")

        def ints(text: str) -> Tuple[int, ...]:
            try:
                return tuple(int(v) for v in text.split(".")) if text else ()
            except ValueError:
                raise InvalidShardedTensorError(f"{unique_key!r} is not a ShardedObject unique key") from None

        return cls(key, None, ints(parts[1]), ints(parts[0]), replica_id)

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(key={self.key!r})"


# Re-exports: Megatron-Core code imports these from ``mapping``.
from dist_ckpt.model.factories import ShardedTensorFactory, apply_factories, apply_factory_merges  # noqa: E402

__all__ = [
    "CommonStateDict",
    "FactoryBuildFn",
    "FactoryMergeFn",
    "LocalNonPersistentObject",
    "LocalNonpersistentObject",
    "LocalNonpersitentObject",
    "ReplicaId",
    "ShardedBase",
    "ShardedObject",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StateDict",
    "apply_factories",
    "apply_factory_merges",
    "is_main_replica",
]
