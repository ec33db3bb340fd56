"""The per-shard sharding check dist_ckpt used before the vectorized one (issue 14), kept as the
reference the vectorized :func:`~dist_ckpt.engine.checks.sharding.find_sharding_problems` must agree
with, verdict for verdict and message for message (tests only; never imported by the library).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from dist_ckpt.model.sharded import ShardedBase, ShardedObject, ShardedTensor, is_main_replica

#: Megatron-Core's words for a gap between flattened ranges, as the per-shard check wrote them
FLATTENED_GAP = "Flattened ranges dont cover the whole shard"


def _first_difference(key: str, shards: List[Tuple[int, ShardedTensor]]) -> Optional[str]:
    ref_rank, ref = shards[0]
    for attr in ("global_shape", "dtype", "full_local_shape", "prepend_axis_num"):
        for rank, sh in shards:
            if getattr(sh, attr) != getattr(ref, attr):
                return (
                    f"{key!r}: {attr} differs between ranks: rank {ref_rank} has {getattr(ref, attr)}, "
                    f"rank {rank} has {getattr(sh, attr)}"
                )
    if len({sh.flattened_range is None for _, sh in shards}) > 1:
        flat = [r for r, sh in shards if sh.flattened_range is not None]
        return f"{key!r}: ranks {flat} hold flattened shards and other ranks hold whole shards; use one form per tensor"
    return None


def _missing_chunk(grid: Tuple[int, ...], covered: Set[Tuple[int, ...]]) -> Tuple[int, ...]:
    for idx in np.ndindex(*grid):
        if tuple(idx) not in covered:
            return tuple(int(i) for i in idx)
    raise AssertionError("no missing chunk")  # callers check the count first


def _tensor_problems(key: str, shards: List[Tuple[int, ShardedTensor]]) -> List[str]:
    difference = _first_difference(key, shards)
    if difference:
        return [difference]
    ref = shards[0][1]
    chunk, glob = ref.full_local_shape, ref.global_shape
    if math.prod(glob) == 0:
        return []
    for axis, (g, c) in enumerate(zip(glob, chunk)):
        if c == 0 or g % c:
            return [
                f"{key!r}: global size {g} along axis {axis} is not a multiple of the local size {c}; "
                f"equal shards cannot tile global shape {glob}"
            ]
    grid = tuple(g // c for g, c in zip(glob, chunk))
    mains = [(rank, sh) for rank, sh in shards if is_main_replica(sh.replica_id)]
    problems: List[str] = []
    owners: Dict[Tuple[int, ...], List[Tuple[int, int, int]]] = defaultdict(list)
    for rank, sh in mains:
        rng = sh.flattened_range
        start, stop = (0, math.prod(chunk)) if rng is None else (rng.start, rng.stop)
        owners[sh.local_chunk_offset_in_global()].append((start, stop, rank))
    chunk_numel = math.prod(chunk)
    for idx in sorted(owners):
        offset = tuple(i * c for i, c in zip(idx, chunk))
        pieces = sorted(owners[idx])
        if ref.flattened_range is None:
            if len(pieces) > 1:
                problems.append(
                    f"{key!r}: the shard at global offset {offset} is a main replica on ranks "
                    f"{[r for _, _, r in pieces]} (overlap); give all but one a non-zero replica_id"
                )
            continue
        pos = 0
        for start, stop, rank in pieces:
            if start < pos:
                problems.append(
                    f"{key!r}: flattened ranges overlap in the chunk at global offset {offset}: rank {rank} "
                    f"holds [{start}, {stop}) but elements up to {pos} are already held"
                )
            elif start > pos:
                problems.append(
                    f"{key!r}: {FLATTENED_GAP}: no rank holds flat elements [{pos}, {start}) of the chunk at "
                    f"global offset {offset}"
                )
            pos = max(pos, stop)
        if pos < chunk_numel:
            problems.append(
                f"{key!r}: {FLATTENED_GAP}: no rank holds flat elements [{pos}, {chunk_numel}) of the chunk at "
                f"global offset {offset}"
            )
    total = math.prod(grid)
    if len(owners) < total:
        idx = _missing_chunk(grid, set(owners))
        offset = tuple(i * c for i, c in zip(idx, chunk))
        problems.append(
            f"{key!r}: no main replica holds the shard at global offset {offset} (shape {chunk}); "
            f"{total - len(owners)} of {total} shards are missing (gap in coverage)"
        )
    return problems


def _object_problems(key: str, shards: List[Tuple[int, ShardedObject]]) -> List[str]:
    ref_rank, ref = shards[0]
    for rank, sh in shards:
        if sh.global_shape != ref.global_shape:
            return [
                f"{key!r}: global_shape differs between ranks: rank {ref_rank} has {ref.global_shape}, "
                f"rank {rank} has {sh.global_shape}"
            ]
    owners: Dict[Tuple[int, ...], List[int]] = defaultdict(list)
    for rank, sh in shards:
        if is_main_replica(sh.replica_id):
            owners[sh.global_offset].append(rank)
    problems = [
        f"{key!r}: object shard {offset} is a main replica on ranks {ranks} (overlap)"
        for offset, ranks in sorted(owners.items())
        if len(ranks) > 1
    ]
    total = math.prod(ref.global_shape)
    if len(owners) < total:
        idx = _missing_chunk(ref.global_shape, set(owners))
        problems.append(
            f"{key!r}: no main replica holds object shard {idx}; {total - len(owners)} of {total} are missing"
        )
    return problems


def reference_sharding_problems(global_metadata: Sequence[Sequence[ShardedBase]]) -> List[str]:
    """Every way in which the ranks' shards fail to form a valid sharding (pure).

    Main replicas of each tensor must cover it exactly once (no overlap, no gap), and every
    rank must agree on global shape, dtype and local shape; likewise for ShardedObjects.
    """
    by_key: Dict[str, List[Tuple[int, ShardedBase]]] = defaultdict(list)
    for rank, shards in enumerate(global_metadata):
        for sh in shards:
            by_key[sh.key].append((rank, sh))
    problems: List[str] = []
    for key in sorted(by_key):
        tensors = [(r, s) for r, s in by_key[key] if isinstance(s, ShardedTensor)]
        objects = [(r, s) for r, s in by_key[key] if isinstance(s, ShardedObject)]
        if tensors and objects:
            problems.append(
                f"{key!r} is a ShardedTensor on ranks {sorted({r for r, _ in tensors})} and a "
                f"ShardedObject on ranks {sorted({r for r, _ in objects})}"
            )
        elif tensors:
            problems += _tensor_problems(key, tensors)
        elif objects:
            problems += _object_problems(key, objects)
    return problems
