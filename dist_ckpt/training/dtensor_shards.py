"""Describe a torch tensor -- plain or DTensor -- as this rank's
[`ShardedTensor`][dist_ckpt.model.sharded.ShardedTensor].

This module is the one place that looks inside ``torch.distributed.tensor.DTensor``. It reads
DTensor *metadata* only -- the global shape, the placements (``Shard(d)`` / ``Replicate()``),
the device mesh's shape and this rank's coordinate in it -- and the local shard
(``to_local()``). It never calls a collective (``full_tensor``, ``redistribute``): the data
movement of a resharded load is done by the checkpoint backends, so the rule that only
`dist_ckpt.collectives.distributed` communicates still holds.

How a DTensor maps onto a ShardedTensor:

* Each ``Shard(d)`` mesh dimension splits tensor dim ``d`` with ``torch.chunk`` semantics:
  chunks of ``ceil(size / n)``, the last ones shorter or empty (FSDP2's dim-0 sharding).
  Several mesh dimensions sharding the same tensor dim split it again, in mesh-dim order,
  as DTensor does.
* Dim 0 may end up any row range ``[a, b)``: it is expressed as a flattened range of one chunk
  that spans all rows (``from_rank_offsets_flat`` with ``flattened_range = [a*row, b*row)``),
  which every backend reshards freely, whatever the boundaries at save and load time.
* Other dims must be split evenly (size divisible by the number of chunks): they become the
  regular chunk grid of ``from_rank_offsets``. An uneven split of a dim other than 0, a
  ``Partial`` placement (a pending reduction), a ``_StridedShard`` (FSDP2 + TP on the same dim)
  and a rank outside the mesh raise [`InvalidShardedTensorError`][dist_ckpt.errors.InvalidShardedTensorError]
  naming the key.
* ``Replicate()`` mesh dimensions make replicas: the replica id is this rank's coordinate
  along them, so exactly one rank (coordinate 0 everywhere) holds the main replica.

A plain tensor is taken to be replicated on every rank (a single process, or DDP): its whole
value is one chunk with ``replica_id = rank``, so rank 0 alone writes it. Models split across
ranks *without* DTensor (for example pipeline stages holding different plain modules) are not
described correctly by this rule; wrap such state in ShardedTensors yourself.

Example:

```python
sh = to_sharded_tensor("model.fc.weight", fsdp_param)   # DTensor with (Shard(0),)
sh.flattened_range, sh.global_shape                     # rows [a, b) of (out, in)
```
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, cast

import torch

from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import InvalidShardedTensorError
from dist_ckpt.model.sharded import ReplicaId, ShardedTensor

logger = logging.getLogger(__name__)

__all__ = [
    "LocalBox",
    "chunk_range",
    "is_dtensor",
    "local_box",
    "local_tensor",
    "sharded_tensor_from_box",
    "to_sharded_tensor",
]


def is_dtensor(tensor: object) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (a sharded or replicated tensor).

    ``torch.distributed.tensor`` is not imported here (it takes half a second and is absent
    from torch builds without distributed support): a DTensor can only exist once its module
    has been imported by whoever created it.
    """
    module = sys.modules.get("torch.distributed.tensor")
    dtensor_type = getattr(module, "DTensor", None)
    return dtensor_type is not None and isinstance(tensor, dtensor_type)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor (sharing its memory, so
    in-place writes reach the DTensor), the tensor itself otherwise; detached either way."""
    if is_dtensor(tensor):
        local: torch.Tensor = cast(Any, tensor).to_local()
        return local.detach()
    return tensor.detach()


def chunk_range(size: int, chunks: int, index: int) -> Tuple[int, int]:
    """Rows ``[start, stop)`` of chunk ``index`` when ``size`` rows are split like ``torch.chunk``.

    Chunks hold ``ceil(size / chunks)`` rows; the last ones are shorter, possibly empty
    (then ``start == stop == size``).

    Example:

    ```python
    [chunk_range(7, 4, i) for i in range(4)]   # [(0, 2), (2, 4), (4, 6), (6, 7)]
    ```
    """
    if chunks < 1 or not 0 <= index < chunks:
        raise InvalidShardedTensorError(f"chunk index {index} out of range for {chunks} chunks")
    full = -(-size // chunks)
    start = min(size, full * index)
    return start, min(size, start + full)


@dataclass(frozen=True)
class LocalBox:
    """The part of a global tensor one rank holds: ``[start, stop)`` per dim, and its replica id.

    Attributes:
        global_shape: shape of the whole tensor.
        start: first index held, per dim.
        stop: one past the last index held, per dim.
        chunks: per dim, into how many pieces it was split (1 = not split).
        replica_id: coordinates along the replicating mesh dims (0 = main replica).
    """

    global_shape: Tuple[int, ...]
    start: Tuple[int, ...]
    stop: Tuple[int, ...]
    chunks: Tuple[int, ...]
    replica_id: ReplicaId

    @property
    def local_shape(self) -> Tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))


def local_box(
    key: str,
    global_shape: Sequence[int],
    placements: Sequence[object],
    mesh_shape: Sequence[int],
    coordinate: Optional[Sequence[int]],
) -> LocalBox:
    """The box of ``global_shape`` held at mesh ``coordinate`` under ``placements`` (pure).

    Follows DTensor: mesh dims are applied in order; each ``Shard(d)`` splits the current range
    of dim ``d`` like ``torch.chunk``; ``Replicate()`` adds a replica coordinate.

    Raises:
        InvalidShardedTensorError: for a placement other than Shard/Replicate, or a rank that is
            not part of the mesh; the message names ``key``.
    """
    from torch.distributed.tensor import Replicate, Shard

    shape = tuple(int(s) for s in global_shape)
    if coordinate is None:
        raise InvalidShardedTensorError(
            f"[rank {get_rank()}] {key!r}: this rank is not part of the DTensor's device mesh; "
            f"only ranks of the mesh can save or load it"
        )
    if len(placements) != len(mesh_shape) or len(coordinate) != len(mesh_shape):
        raise InvalidShardedTensorError(
            f"{key!r}: {len(placements)} placements for a mesh of shape {tuple(mesh_shape)} "
            f"at coordinate {tuple(coordinate)}"
        )
    start, stop, chunks = [0] * len(shape), list(shape), [1] * len(shape)
    replicas: List[int] = []
    for placement, n, c in zip(placements, mesh_shape, coordinate):
        if isinstance(placement, Shard):
            d = placement.dim if placement.dim >= 0 else placement.dim + len(shape)
            if not 0 <= d < len(shape):
                raise InvalidShardedTensorError(f"{key!r}: {placement} of a {len(shape)}-d tensor")
            a, b = chunk_range(stop[d] - start[d], int(n), int(c))
            start[d], stop[d] = start[d] + a, start[d] + b
            chunks[d] *= int(n)
        elif isinstance(placement, Replicate):
            replicas.append(int(c))
        else:
            raise InvalidShardedTensorError(
                f"[rank {get_rank()}] {key!r}: placement {placement} cannot be checkpointed; only "
                f"Shard(dim) and Replicate() are supported (redistribute a Partial tensor first; "
                f"_StridedShard, from FSDP2 combined with tensor parallelism on the same dim, is not "
                f"supported)"
            )
    replica_id: ReplicaId = 0 if not replicas else replicas[0] if len(replicas) == 1 else tuple(replicas)
    return LocalBox(shape, tuple(start), tuple(stop), tuple(chunks), replica_id)


def _grid_offsets(key: str, box: LocalBox) -> List[Tuple[int, int, int]]:
    """``(axis, chunk index, chunks)`` for every dim > 0 that is split; it must split evenly."""
    offsets = []
    for axis in range(1, len(box.global_shape)):
        size, n = box.global_shape[axis], box.chunks[axis]
        if n == 1:
            continue
        local = box.stop[axis] - box.start[axis]
        if size % n != 0 or local * n != size:
            raise InvalidShardedTensorError(
                f"[rank {get_rank()}] {key!r}: dim {axis} of size {size} is split into {n} uneven "
                f"chunks (this rank holds [{box.start[axis]}, {box.stop[axis]})); only dim 0 may be "
                f"split unevenly. Shard that dim evenly or shard dim 0 instead"
            )
        offsets.append((axis, box.start[axis] // local, n))
    return offsets


def sharded_tensor_from_box(key: str, data: torch.Tensor, box: LocalBox) -> ShardedTensor:
    """The ShardedTensor for ``data``, this rank's ``box`` of the global tensor.

    Dims > 0 become chunk-grid offsets; a partial dim 0 becomes a flattened range over all rows
    of this rank's grid chunk, so uneven and empty row ranges are expressed exactly. ``data``
    must have the box's shape; for a flattened range it is reshaped to 1-D (a view when
    ``data`` is contiguous).
    """
    if tuple(data.shape) != box.local_shape:
        raise InvalidShardedTensorError(
            f"[rank {get_rank()}] {key!r}: local tensor has shape {tuple(data.shape)}, but its "
            f"placements give {box.local_shape} of global shape {box.global_shape}"
        )
    offsets = _grid_offsets(key, box)
    if not box.global_shape or (box.start[0] == 0 and box.stop[0] == box.global_shape[0]):
        return ShardedTensor.from_rank_offsets(key, data, *offsets, replica_id=box.replica_id)
    row = math.prod(box.local_shape[1:])
    chunk_shape = (box.global_shape[0],) + box.local_shape[1:]
    return ShardedTensor.from_rank_offsets_flat(
        key,
        data.reshape(-1),
        chunk_shape,
        *offsets,
        flattened_range=slice(box.start[0] * row, box.stop[0] * row),
        replica_id=box.replica_id,
    )


def tensor_box(key: str, tensor: torch.Tensor) -> LocalBox:
    """The box this rank holds of ``tensor``: from the placements of a DTensor; the whole
    tensor with ``replica_id = rank`` for a plain tensor (a replica on every rank)."""
    if is_dtensor(tensor):
        mesh = cast(Any, tensor).device_mesh
        return local_box(
            key, tuple(tensor.shape), cast(Any, tensor).placements, tuple(mesh.shape), mesh.get_coordinate()
        )
    shape = tuple(tensor.shape)
    return LocalBox(shape, (0,) * len(shape), shape, (1,) * len(shape), get_rank())


def to_sharded_tensor(key: str, tensor: torch.Tensor, data: Optional[torch.Tensor] = None) -> ShardedTensor:
    """This rank's ShardedTensor for ``tensor`` (plain or DTensor), keyed ``key``.

    Args:
        key: checkpoint key.
        tensor: the live tensor; its placements (if a DTensor) give the sharding.
        data: what the ShardedTensor holds instead of ``tensor``'s local shard (for example a
            load buffer of another dtype); it must have the local shard's shape.

    Example:

    ```python
    sh = to_sharded_tensor("model.fc.weight", model.fc.weight)
    dc.save({"w": sh}, "ckpt")
    ```
    """
    local = local_tensor(tensor) if data is None else data
    return sharded_tensor_from_box(key, local, tensor_box(key, tensor))
