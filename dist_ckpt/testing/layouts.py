"""Build sharded state dicts for tensor-, pipeline- and data-parallel layouts, for tests.

A layout has ``V`` *participants* (e.g. ``tp * dp``) that need not equal the number of real
ranks: participant ``v`` lives on rank ``v % world_size``, so a rank may hold several shards of
one tensor (stored under distinct state-dict keys). This lets a 2-rank job save "at TP=4" and a
4-rank job load "at TP=2" with real processes, and is itself a valid sharding.

Values are deterministic functions of the key (`full_tensor()`), so any rank can compute
the expected contents of any slice.
"""

from __future__ import annotations

import hashlib
import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from dist_ckpt.model.sharded import ShardedTensor


def full_tensor(key: str, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A deterministic global tensor for ``key`` (distinct values, no NaN)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % (2**63)
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(tuple(shape), generator=gen) > 0.5
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.randint(-1000, 1000, tuple(shape), generator=gen).to(dtype)
    return (torch.randn(tuple(shape), generator=gen) * 3).to(dtype)


def participants_of(rank: int, world_size: int, count: int) -> List[int]:
    """The participants of a ``count``-participant layout that live on ``rank``."""
    return [v for v in range(count) if v % world_size == rank]


def tp_shards(
    key: str,
    full: torch.Tensor,
    axis: int,
    tp: int,
    rank: int,
    world_size: int,
    dp: Optional[int] = None,
    prepend: Tuple[int, int] = (0, 1),
    empty: bool = False,
) -> Dict[str, ShardedTensor]:
    """This rank's shards of ``full`` split into ``tp`` chunks along ``axis``.

    Participants are ``tp * dp`` (``dp`` defaults to fill the world: ``max(1, world // tp)``);
    participant ``v`` holds chunk ``v % tp`` with ``replica_id = v // tp`` (only DP replica 0
    is saved). ``prepend=(index, count)`` puts the tensor at position ``index`` of a leading
    axis of size ``count`` (a pipeline-stacked layer, ``prepend_axis_num=1``) when count > 1.
    With ``empty=True`` the data is zeros (a load target).
    """
    dp = dp if dp is not None else max(1, world_size // tp)
    size = full.shape[axis] // tp
    out: Dict[str, ShardedTensor] = {}
    for v in participants_of(rank, world_size, tp * dp):
        t, replica = v % tp, v // tp
        local = full.narrow(axis, t * size, size).clone()
        if empty:
            local = torch.zeros_like(local)
        offsets = [(axis + (1 if prepend[1] > 1 else 0), t, tp)]
        if prepend[1] > 1:
            offsets.insert(0, (0, prepend[0], prepend[1]))
        out[f"{key}@tp{t}dp{replica}"] = ShardedTensor.from_rank_offsets(
            key, local, *offsets, replica_id=replica, prepend_axis_num=1 if prepend[1] > 1 else 0
        )
    return out


def uneven_cuts(numel: int, parts: int) -> List[Tuple[int, int]]:
    """Split ``[0, numel)`` into ``parts`` contiguous ranges of growing, unequal sizes."""
    total = parts * (parts + 1) // 2
    cuts = [0] + [numel * (k * (k + 1) // 2) // total for k in range(1, parts)] + [numel]
    return [(cuts[i], cuts[i + 1]) for i in range(parts)]


def flat_shards(
    key: str,
    full: torch.Tensor,
    axis: int,
    tp: int,
    dp: int,
    rank: int,
    world_size: int,
    empty: bool = False,
    reverse: bool = False,
) -> Dict[str, ShardedTensor]:
    """Distributed-optimizer style: each TP chunk's flattening split unevenly over ``dp`` ranks.

    ``reverse`` mirrors the cut sizes, so a load can use boundaries that differ from the save.
    """
    size = full.shape[axis] // tp
    out: Dict[str, ShardedTensor] = {}
    for v in participants_of(rank, world_size, tp * dp):
        t, d = v % tp, v // tp
        chunk = full.narrow(axis, t * size, size).contiguous()
        cuts = uneven_cuts(chunk.numel(), dp)
        if reverse:
            cuts = [(chunk.numel() - b, chunk.numel() - a) for a, b in reversed(cuts)]
        start, stop = cuts[d]
        data = chunk.flatten()[start:stop].clone()
        if empty:
            data = torch.zeros_like(data)
        out[f"{key}@tp{t}dp{d}"] = ShardedTensor.from_rank_offsets_flat(
            key, data, tuple(chunk.shape), (axis, t, tp), flattened_range=slice(start, stop)
        )
    return out


def expected_data(sh: ShardedTensor, full: torch.Tensor) -> torch.Tensor:
    """What ``sh.data`` must hold after loading from a checkpoint of ``full``."""
    region = full
    for axis, (off, size) in enumerate(zip(sh.global_offset, sh.full_local_shape)):
        region = region.narrow(axis, off, size)
    region = region.reshape(sh.local_shape)
    if sh.flattened_range is not None:
        region = region.flatten()[sh.flattened_range]
    return region


def random_bits_tensor(dtype: torch.dtype, shape: Sequence[int], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` with random bit patterns (NaN payloads and all), for bit-exact tests."""
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool().reshape(tuple(shape))
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(tuple(shape))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (for bit-exact comparison of any dtype)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if ``a`` and ``b`` have the same dtype, shape and bits."""
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(bits(a), bits(b))


def numel_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()
