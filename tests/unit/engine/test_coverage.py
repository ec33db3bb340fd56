"""Property tests: the vectorized sharding check agrees with the per-shard reference.

Thousands of random layouts (tensor-parallel grids with data-parallel replicas, prepended axes,
flattened ranges, ShardedObjects) with random defects -- overlaps, gaps, shape, dtype and
prepend disagreements, mixed flattened/whole shards, tensors that are objects elsewhere,
local sizes that do not divide -- must give exactly the reference's problem list, message for
message and in the same order.
"""

from __future__ import annotations

import itertools
import random
from typing import List, Tuple

import numpy as np
import pytest
import torch

from dist_ckpt.collectives.shard_metadata import decode_tables
from dist_ckpt.engine.checks.coverage import find_table_problems
from dist_ckpt.engine.checks.sharding import find_sharding_problems
from dist_ckpt.model.shard_table import ShardTable, encode_table
from dist_ckpt.model.sharded import ShardedBase, ShardedObject, ShardedTensor

from .sharding_reference import reference_sharding_problems

DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _replica(rng: random.Random, copy: int) -> object:
    """Replica id of copy ``copy`` (0 = main), as an int or a tuple."""
    if rng.random() < 0.5:
        return copy
    return (0, copy, 0) if rng.random() < 0.5 else (copy,)


def _cuts(rng: random.Random, numel: int) -> List[Tuple[int, int]]:
    """Ranges that tile [0, numel), sometimes with a defect (overlap, gap, empty range)."""
    points = sorted({0, numel, *(rng.randint(0, numel) for _ in range(rng.randint(0, 3)))})
    ranges = list(zip(points[:-1], points[1:])) or [(0, numel)]
    defect = rng.random()
    if defect < 0.15 and ranges:
        a, b = rng.choice(ranges)
        ranges.append((max(0, a - rng.randint(0, 2)), min(numel, b + rng.randint(0, 2))))
    elif defect < 0.3 and len(ranges) > 1:
        ranges.pop(rng.randrange(len(ranges)))
    elif defect < 0.35:
        x = rng.randint(0, numel)
        ranges.append((x, x))
    return ranges


def _tensor_shards(rng: random.Random, key: str, world: int) -> List[Tuple[int, ShardedBase]]:
    ndim = rng.choice([0, 1, 1, 2, 2, 3])
    prepend = rng.choice([0, 0, 1]) if ndim else 0
    fragm = [rng.choice([1, 2, 3]) for _ in range(ndim)]
    local = [1] * prepend + [
        rng.choice([1, 2, 3, 0] if rng.random() < 0.05 else [1, 2, 3]) for _ in range(ndim - prepend)
    ]
    glob = [f * c for f, c in zip(fragm, local)]
    if ndim > prepend and rng.random() < 0.05:  # a local size that does not divide the global size
        axis = rng.randrange(prepend, ndim)
        glob[axis] += 1
    dtype = rng.choice(DTYPES)
    flat = rng.random() < 0.3 and all(local)
    copies = rng.choice([1, 1, 2, 3])
    out: List[Tuple[int, ShardedBase]] = []
    for idx in itertools.product(*(range(f) for f in fragm)):
        offset = tuple(i * c for i, c in zip(idx, local))
        numel = int(np.prod(local[prepend:], dtype=np.int64)) if ndim else 1
        for copy in range(copies):
            main_copy = copy == 0
            if rng.random() < 0.04:  # a chunk without its main replica: a gap
                main_copy = False
            replica = _replica(rng, 0 if main_copy else max(copy, 1))
            if rng.random() < 0.03:  # a second main replica: an overlap
                replica = 0
            pieces = _cuts(rng, numel) if flat and main_copy else [None]
            if flat and not main_copy:
                pieces = [(0, numel)]
            for piece in pieces:
                t_dtype, t_glob, t_local, t_prepend = dtype, tuple(glob), tuple(local[prepend:]), prepend
                roll = rng.random()
                if roll < 0.01:
                    t_dtype = rng.choice(DTYPES)
                elif roll < 0.02 and ndim:
                    t_glob = tuple(g + (1 if a == ndim - 1 else 0) for a, g in enumerate(glob))
                elif roll < 0.025 and ndim and prepend == 1:
                    t_prepend, t_local = 0, (1, *t_local)
                rng_slice = None
                if piece is not None:
                    rng_slice = slice(*piece)
                    if rng.random() < 0.01:
                        rng_slice = None  # whole among flattened: mixed forms
                elif flat and rng.random() < 0.01:
                    rng_slice = slice(0, numel)
                sh = ShardedTensor(
                    key,
                    None,
                    t_dtype,
                    t_local,
                    t_glob,
                    offset,
                    tuple(fragm) if rng.random() < 0.5 else None,
                    replica,
                    t_prepend,
                    rng.random() < 0.1,
                    rng_slice,
                )
                out.append((rng.randrange(world), sh))
    if rng.random() < 0.1 and out:  # drop a shard: a gap
        out.pop(rng.randrange(len(out)))
    return out


def _object_shards(rng: random.Random, key: str, world: int) -> List[Tuple[int, ShardedBase]]:
    shape = tuple(rng.choice([1, 2, 3]) for _ in range(rng.choice([0, 1, 2])))
    out: List[Tuple[int, ShardedBase]] = []
    for idx in itertools.product(*(range(s) for s in shape)):
        for copy in range(rng.choice([1, 2])):
            replica = 0 if copy == 0 and rng.random() > 0.05 else rng.randint(1, 3)
            if rng.random() < 0.05:
                replica = 0
            glob = shape
            if rng.random() < 0.03 and shape:
                glob = tuple(s + 1 for s in shape)
            out.append((rng.randrange(world), ShardedObject(key, None, glob, idx, replica)))
    if rng.random() < 0.1 and out:
        out.pop(rng.randrange(len(out)))
    return out


def random_layout(seed: int) -> List[List[ShardedBase]]:
    """Every rank's shards of a random layout with random defects."""
    rng = random.Random(seed)
    world = rng.randint(1, 6)
    per_rank: List[List[ShardedBase]] = [[] for _ in range(world)]
    keys = [f"layer{i}.w" if rng.random() < 0.8 else f"k{i}" for i in range(rng.randint(1, 5))]
    for key in keys:
        maker = _object_shards if rng.random() < 0.15 else _tensor_shards
        for rank, sh in maker(rng, key, world):
            per_rank[rank].append(sh)
        if rng.random() < 0.03:  # the same key as the other kind on some rank
            other = _tensor_shards if maker is _object_shards else _object_shards
            placed = other(rng, key, world)
            if placed:
                rank, sh = placed[0]
                per_rank[rank].append(sh)
    for shards in per_rank:
        rng.shuffle(shards)
    return per_rank


@pytest.mark.parametrize("block", range(8))
def test_agrees_with_reference_on_random_layouts(block: int) -> None:
    problems_seen = 0
    for seed in range(block * 400, (block + 1) * 400):
        meta = random_layout(seed)
        expected = reference_sharding_problems(meta)
        assert find_sharding_problems(meta) == expected, f"seed {seed}"
        problems_seen += bool(expected)
    assert 50 < problems_seen < 390  # the generator makes both valid and invalid layouts


def test_agrees_through_the_byte_exchange() -> None:
    """What rank 0 checks is what the ranks sent: encode each rank's table, decode them all."""
    for seed in range(300):
        meta = random_layout(10_000 + seed)
        blobs = [encode_table(ShardTable.from_shards(shards, rank)) for rank, shards in enumerate(meta)]
        assert find_table_problems(decode_tables(blobs)) == reference_sharding_problems(meta), f"seed {seed}"


def test_defect_kinds_are_all_generated() -> None:
    """The generator reaches every kind of message the check can produce."""
    seen = set()
    markers = {
        "overlap)": "overlap",
        "gap in coverage": "gap",
        "differs between ranks": "disagreement",
        "hold flattened shards": "mixed forms",
        "is a ShardedTensor on ranks": "tensor and object",
        "is not a multiple": "tiling",
        "flattened ranges overlap": "flat overlap",
        "no rank holds flat elements": "flat gap",
        "object shard": "object",
    }
    for seed in range(2000):
        for problem in reference_sharding_problems(random_layout(seed)):
            seen |= {name for marker, name in markers.items() if marker in problem}
    assert seen == set(markers.values())


def _flat_chunk(key: str, ranges: List[Tuple[int, int]], ranks: List[int]) -> List[List[ShardedBase]]:
    meta: List[List[ShardedBase]] = [[] for _ in range(max(ranks) + 1)]
    for (a, b), r in zip(ranges, ranks):
        meta[r].append(ShardedTensor(key, None, torch.float32, (2, 3), (2, 3), (0, 0), None, 0, 0, False, slice(a, b)))
    return meta


def test_flattened_ranges_sweep() -> None:
    meta = _flat_chunk("f", [(0, 2), (1, 4), (5, 6)], [0, 1, 2])
    assert (
        find_sharding_problems(meta)
        == [
            "'f': flattened ranges overlap in the chunk at global offset (0, 0): rank 1 holds [1, 4) but elements up "
            "to 2 are already held",
            "'f': Flattened ranges dont cover the whole shard: no rank holds flat elements [4, 5) of the chunk at "
            "global offset (0, 0)",
        ]
        == reference_sharding_problems(meta)
    )


def test_huge_grid_is_ranked_by_held_chunks() -> None:
    """A grid of more than 2**62 chunks (metadata that cannot be valid) still gets the reference's
    messages: overlaps, and the first missing chunk in row-major order."""
    big = 2**40
    shards = [
        ShardedTensor("h", None, torch.float32, (1, 1), (big, big), (0, 0), None),
        ShardedTensor("h", None, torch.float32, (1, 1), (big, big), (0, 0), None),
        ShardedTensor("h", None, torch.float32, (1, 1), (big, big), (0, 1), None),
        ShardedTensor("h", None, torch.float32, (1, 1), (big, big), (5, 7), None),
    ]
    meta: List[List[ShardedBase]] = [shards[:2], shards[2:]]
    problems = find_sharding_problems(meta)
    assert problems[0] == "'h': the shard at global offset (0, 0) is a main replica on ranks [0, 0] (overlap); " + (
        "give all but one a non-zero replica_id"
    )
    assert problems[1].startswith("'h': no main replica holds the shard at global offset (0, 2) (shape (1, 1)); ")
    assert f"{big * big - 3} of {big * big} shards" in problems[1]


def test_empty_and_single() -> None:
    assert find_sharding_problems([]) == find_sharding_problems([[], []]) == []
    one = [[ShardedTensor("s", None, torch.float32, (), (), (), None)]]
    assert find_sharding_problems(one) == reference_sharding_problems(one) == []
