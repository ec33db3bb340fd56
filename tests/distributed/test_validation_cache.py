"""The cached sharding verdict, with real ranks: an unchanged structure skips the gather, and any
change -- on any one rank -- of keys, shapes, offsets, dtypes, replica ids, flattened ranges or
the world is checked in full; a failing check is never remembered as a pass.

A check that runs in full gathers the ranks' tables to rank 0 (``gather_bytes``); each test
counts those gathers on every rank. Keys carry the test's name, so no test reuses another's
structure.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.collectives.distributed import ProcessGroup, new_group
from dist_ckpt.engine.checks import sharding
from dist_ckpt.model.sharded import ShardedBase, ShardedObject, ShardedTensor

from .helpers import assert_on_all_ranks, raises_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)

State = Dict[str, ShardedBase]


@pytest.fixture
def gathers(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """Counts the full checks (gathers of every rank's table) on this rank."""
    count = [0]
    original = sharding.gather_bytes

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(sharding, "gather_bytes", counting)
    return count


def state(tag: str, r: Optional[int] = None, n: Optional[int] = None) -> State:
    """Rank ``r`` of ``n``'s shards: a row-split weight, a replicated bias, a flattened optimizer
    state and an object per rank (valid)."""
    r, n = rank() if r is None else r, world() if n is None else n
    per = 16 // n
    lo, hi = r * per, 16 if r == n - 1 else (r + 1) * per
    return {
        "w": ShardedTensor.from_rank_offsets(f"{tag}.w", torch.zeros(2, 4), (0, r, n)),
        "b": ShardedTensor.from_rank_offsets(f"{tag}.b", torch.zeros(4), replica_id=r),
        "f": ShardedTensor.from_rank_offsets_flat(
            f"{tag}.f", torch.zeros(hi - lo), (4, 4), flattened_range=slice(lo, hi)
        ),
        "o": ShardedObject(f"{tag}.o", None, (n,), (r,)),
    }


def check(sd: State, group: Optional[ProcessGroup] = None) -> None:
    sharding.gather_and_validate_sharding([sh.without_data() for sh in sd.values()], group)


def _key(sd: State) -> State:  # a new tensor, on the last rank only
    if rank() == world() - 1:
        sd["x"] = ShardedTensor.from_rank_offsets(sd["w"].key + "x", torch.zeros(3))
    return sd


def _shape(sd: State) -> State:  # every rank's row chunk grows
    sd["w"] = ShardedTensor.from_rank_offsets(sd["w"].key, torch.zeros(3, 4), (0, rank(), world()))
    return sd


def _offset(sd: State) -> State:  # the ranks hold the row chunks in reverse order
    sd["w"] = ShardedTensor.from_rank_offsets(sd["w"].key, torch.zeros(2, 4), (0, world() - 1 - rank(), world()))
    return sd


def _dtype(sd: State) -> State:
    sd["w"] = ShardedTensor.from_rank_offsets(
        sd["w"].key, torch.zeros(2, 4, dtype=torch.bfloat16), (0, rank(), world())
    )
    return sd


def _replica(sd: State) -> State:  # another rank holds the main replica of the bias
    sd["b"] = ShardedTensor.from_rank_offsets(sd["b"].key, torch.zeros(4), replica_id=(rank() + 1) % world())
    return sd


def _flat(sd: State) -> State:  # other cut points of the flattened state: rank 0 holds one element more
    n, per = world(), 16 // world()
    cuts = [0] + [min(16, r * per + 1) for r in range(1, n)] + [16]
    lo, hi = cuts[rank()], cuts[rank() + 1]
    sd["f"] = ShardedTensor.from_rank_offsets_flat(
        sd["f"].key, torch.zeros(hi - lo), (4, 4), flattened_range=slice(lo, hi)
    )
    return sd


CHANGES: Dict[str, Callable[[State], State]] = {
    "key": _key,
    "shape": _shape,
    "offset": _offset,
    "dtype": _dtype,
    "replica_id": _replica,
    "flattened_range": _flat,
}


@pytest.mark.parametrize("kind", sorted(CHANGES))
def test_a_change_is_checked_in_full(kind: str, gathers: List[int]) -> None:
    tag = f"change_{kind}"
    check(state(tag))
    check(state(tag))  # unchanged: the verdict is reused
    assert_on_all_ranks(gathers[0] == 1, f"{gathers[0]} full checks of an unchanged structure")
    changed = CHANGES[kind](state(tag))
    check(changed)
    check(CHANGES[kind](state(tag)))
    assert_on_all_ranks(gathers[0] == 2, f"{kind}: {gathers[0]} full checks, expected 2")
    check(state(tag))  # back to the first structure: one verdict is kept per group, so in full again
    assert_on_all_ranks(gathers[0] == 3, f"{kind}: {gathers[0]} full checks, expected 3")


BREAKS: Dict[str, Callable[[State], None]] = {  # applied on rank 1 only; each makes the sharding invalid
    "key": lambda sd: sd.update(
        w=ShardedTensor.from_rank_offsets(sd["w"].key + "!", torch.zeros(2, 4), (0, 1, world()))
    ),
    "shape": lambda sd: sd.update(w=ShardedTensor.from_rank_offsets(sd["w"].key, torch.zeros(2, 5), (0, 1, world()))),
    "offset": lambda sd: sd.update(w=ShardedTensor.from_rank_offsets(sd["w"].key, torch.zeros(2, 4), (0, 0, world()))),
    "dtype": lambda sd: sd.update(
        w=ShardedTensor.from_rank_offsets(sd["w"].key, torch.zeros(2, 4, dtype=torch.float64), (0, 1, world()))
    ),
    "replica_id": lambda sd: sd.update(b=ShardedTensor.from_rank_offsets(sd["b"].key, torch.zeros(4), replica_id=0)),
    "flattened_range": lambda sd: setattr(sd["f"], "flattened_range", slice(0, 16 // world())),
}


@pytest.mark.parametrize("kind", sorted(BREAKS))
def test_a_change_on_one_rank_fails_on_every_rank_and_is_not_remembered(kind: str, gathers: List[int]) -> None:
    tag = f"break_{kind}"
    check(state(tag))
    broken = state(tag)
    if rank() == 1:
        BREAKS[kind](broken)
    for attempt in (1, 2):  # a failing check is never recorded as a pass: it fails again, in full
        raises_on_all_ranks(dc.ShardingIntegrityError, lambda: check(broken))
        assert_on_all_ranks(gathers[0] == 1 + attempt, f"attempt {attempt}: {gathers[0]} full checks")
    check(state(tag))  # the last structure that passed is still known
    assert_on_all_ranks(gathers[0] == 3, f"{gathers[0]} full checks after going back")


def test_another_world_is_checked_in_full(gathers: List[int]) -> None:
    """The same local shards over a smaller group: its global metadata differs (shards are missing)."""
    tag = "world"
    check(state(tag))
    check(state(tag))
    assert_on_all_ranks(gathers[0] == 1, f"{gathers[0]} full checks")
    members = list(range(world() - 1))
    sub = new_group(members)  # collective over every rank
    if rank() in members:
        with pytest.raises(dc.ShardingIntegrityError, match="gap in coverage"):
            check(state(tag), sub)  # the last rank's shards are not in this group: checked, and invalid
        check(state(tag + ".sub", rank(), len(members)), sub)  # a valid layout of the smaller group
        check(state(tag + ".sub", rank(), len(members)), sub)
    check(state(tag))  # the world's verdict was kept beside the group's
    expected = 3 if rank() in members else 1
    assert_on_all_ranks(gathers[0] == expected, f"{gathers[0]} full checks, expected {expected}")


def test_repeated_saves_skip_the_gather(shared_tmp_path, gathers: List[int]) -> None:
    for step in range(3):
        sd = {k: v for k, v in state("saves").items() if k != "o"}  # tensors only: the default backend's objects
        sd["o"] = ShardedObject("saves.o", {"rank": rank()}, (world(),), (rank(),))
        dc.save(sd, shared_tmp_path / f"iter_{step}")
    assert_on_all_ranks(gathers[0] == 1, f"{gathers[0]} full checks in 3 saves of one structure")
    request = state("saves")
    request.pop("o")
    loaded = dc.load(request, shared_tmp_path / "iter_2")
    assert_on_all_ranks(torch.equal(loaded["w"], torch.zeros(2, 4)), "loaded values differ")
