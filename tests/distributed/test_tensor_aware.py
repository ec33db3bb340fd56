"""``MCoreTensorAwareStateDict`` with ``algo="fully_parallel"`` at 2 and 4 ranks: a replicated shard is kept by one
rank of the group, and ``to_state_dict`` gives every rank what it asks for again (exchanged)."""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

from dist_ckpt.mapping import ShardedObject, ShardedTensor
from dist_ckpt.tensor_aware_state_dict import MCoreTensorAwareStateDict

from .helpers import assert_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)


def _state(fill: bool) -> Dict[str, Any]:
    embedding = torch.arange(8.0 * world()).reshape(world(), 8) if fill else torch.zeros(world(), 8)
    own = torch.full((2, 2), float(rank())) if fill else torch.zeros(2, 2)
    return {
        "emb": ShardedTensor.from_rank_offsets("emb", embedding, replica_id=rank()),  # the same on every rank
        "w": ShardedTensor.from_rank_offsets("w", own, (0, rank(), world())),
        "rng": ShardedObject("rng", {"rank": rank()} if fill else None, (world(),), (rank(),)),
    }


@pytest.mark.parametrize("exchange_algo", ["broadcast", "gather_rounds"])
def test_fully_parallel_split_keeps_each_replica_once_and_rebuilds_every_ranks_request(exchange_algo: str) -> None:
    tasd, distribution = MCoreTensorAwareStateDict.from_state_dict(_state(True), algo="fully_parallel")
    kept_emb = torch.tensor([int(tasd.sharded_state_dict["emb"].data is not None)])
    dist.all_reduce(kept_emb)
    ok = distribution is not None and int(kept_emb.item()) == 1 and tasd.sharded_state_dict["w"].data is not None

    loaded = tasd.to_state_dict(_state(False), algo="fully_parallel", exchange_algo=exchange_algo)
    ok = ok and torch.equal(loaded["emb"], torch.arange(8.0 * world()).reshape(world(), 8))
    ok = ok and torch.equal(loaded["w"], torch.full((2, 2), float(rank()))) and loaded["rng"] == {"rank": rank()}
    assert_on_all_ranks(ok, f"kept {int(kept_emb.item())} copies of emb; loaded {loaded}")

    again, cached = MCoreTensorAwareStateDict.from_state_dict(_state(True), cached_metadata=distribution)
    same_keeper = (again.sharded_state_dict["emb"].data is None) == (tasd.sharded_state_dict["emb"].data is None)
    assert_on_all_ranks(cached is distribution and same_keeper, "the cached distribution was not reused")
