"""Compact, pickle-free encoding of shard metadata exchanged between ranks.

A ShardedTensor without data travels as a short JSON list of numbers and names, so a gather of
every rank's metadata costs a few dozen bytes per shard and never unpickles anything.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from dist_ckpt.engine.distributed import ProcessGroup, all_gather_json, gather_json
from dist_ckpt.errors import CorruptCheckpointError
from dist_ckpt.model.sharded import ShardedBase, ShardedObject, ShardedTensor


def dtype_token(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` for any torch dtype (storable or not)."""
    return str(dtype).rsplit(".", 1)[-1]


def dtype_from_token(token: str) -> torch.dtype:
    dtype = getattr(torch, token, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {token!r} in exchanged shard metadata")
    return dtype


def _replica(replica_id: Any) -> Any:
    return list(replica_id) if isinstance(replica_id, tuple) else replica_id


def encode_shard(shard: ShardedBase) -> List[Any]:
    """JSON-able description of a ShardedTensor or ShardedObject (data excluded)."""
    if isinstance(shard, ShardedTensor):
        rng = shard.flattened_range
        return [
            "T",
            shard.key,
            dtype_token(shard.dtype),
            list(shard.local_shape),
            list(shard.global_shape),
            list(shard.global_offset),
            None if shard.axis_fragmentations is None else list(shard.axis_fragmentations),
            _replica(shard.replica_id),
            shard.prepend_axis_num,
            int(shard.allow_shape_mismatch),
            None if rng is None else [rng.start, rng.stop],
        ]
    if isinstance(shard, ShardedObject):
        return ["O", shard.key, list(shard.global_shape), list(shard.global_offset), _replica(shard.replica_id)]
    raise TypeError(f"cannot encode {type(shard).__name__} as shard metadata")


def _replica_from_json(replica_id: Any) -> Any:
    return tuple(replica_id) if isinstance(replica_id, list) else replica_id


def decode_shard(item: Sequence[Any]) -> ShardedBase:
    """Inverse of :func:`encode_shard` (returns objects with ``data=None``)."""
    if item[0] == "T":
        _, key, dtype, local, glob, offset, fragm, replica_id, prepend, allow, rng = item
        return ShardedTensor(
            key,
            None,
            dtype_from_token(dtype),
            tuple(local),
            tuple(glob),
            tuple(offset),
            None if fragm is None else tuple(fragm),
            _replica_from_json(replica_id),
            prepend,
            bool(allow),
            None if rng is None else slice(rng[0], rng[1]),
        )
    if item[0] == "O":
        _, key, glob, offset, replica_id = item
        return ShardedObject(key, None, tuple(glob), tuple(offset), _replica_from_json(replica_id))
    raise CorruptCheckpointError(f"unknown shard metadata record {item!r}")


def all_gather_metadata(
    local_metadata: Sequence[ShardedBase], group: Optional[ProcessGroup] = None
) -> List[List[ShardedBase]]:
    """Every rank's shard metadata on every rank (use sparingly: O(world * shards) per rank)."""
    gathered = all_gather_json([encode_shard(s) for s in local_metadata], group)
    return [[decode_shard(item) for item in rank_items] for rank_items in gathered]


def gather_metadata(
    local_metadata: Sequence[ShardedBase], dst: int = 0, group: Optional[ProcessGroup] = None
) -> Optional[List[List[ShardedBase]]]:
    """Every rank's shard metadata on rank ``dst`` only (None on the others)."""
    gathered = gather_json([encode_shard(s) for s in local_metadata], dst, group)
    if gathered is None:
        return None
    return [[decode_shard(item) for item in rank_items] for rank_items in gathered]
