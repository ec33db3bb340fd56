"""Multi-rank tests of Megatron-Core's exchange API (dist_ckpt.exchange_utils): the precomputed
distribution, its application to a save, and the three exchange algorithms, at any world size."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.collectives.distributed import all_gather_json
from dist_ckpt.errors import CheckpointingException, UnsafeObjectError
from dist_ckpt.exchange_utils import (
    _sharded_tensor_shard_id,
    determine_main_replica_uniform_distribution,
    exchange_by_distribution,
    exchange_loaded_objects_gather_object,
)
from dist_ckpt.strategies.fully_parallel import distribute_main_replicas_with_precomputed_distribution

from .helpers import assert_on_all_ranks, raises_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)

ALGORITHMS = ["broadcast", "gather_rounds", "gather_object"]


def _value(key: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    base = sum(map(ord, key))
    return (torch.arange(int(torch.Size(shape).numel()), dtype=torch.float32) + base).reshape(shape).to(dtype)


def _replicated(with_data: bool) -> Dict[str, Any]:
    """Data-parallel replicas: every rank holds every tensor (uneven sizes, a bf16 one, a
    flattened range), plus one shard that only this rank has."""
    r, w = rank(), world()
    sd: Dict[str, Any] = {}
    for i in range(2 * w + 1):
        key, shape = f"rep{i}", (3 + i, 2)
        data = _value(key, shape, torch.float32) if with_data else torch.zeros(shape)
        sd[key] = dc.ShardedTensor.from_rank_offsets(key, data, replica_id=r)
    bf = _value("bf", (5,), torch.bfloat16)
    sd["bf"] = dc.ShardedTensor.from_rank_offsets(
        "bf", bf if with_data else torch.zeros(5, dtype=torch.bfloat16), replica_id=r
    )
    flat = _value("flat", (4, 3), torch.float32).flatten()[2:9]
    sd["flat"] = dc.ShardedTensor.from_rank_offsets_flat(
        "flat", flat if with_data else torch.zeros(7), (4, 3), flattened_range=slice(2, 9), replica_id=r
    )
    own = _value(f"own{r}", (2,), torch.float32)
    sd["own"] = dc.ShardedTensor.from_rank_offsets("own", own if with_data else torch.zeros(2), (0, r, w))
    return sd


def _expected(sh: dc.ShardedTensor) -> torch.Tensor:
    if sh.key == "own":
        return _value(f"own{sh.global_offset[0] // 2}", (2,), torch.float32)
    if sh.flattened_range is not None:
        return _value(sh.key, sh.local_shape, sh.dtype).flatten()[sh.flattened_range]
    return _value(sh.key, sh.local_shape, sh.dtype)


def test_save_distribution_gives_each_shard_one_writer_balanced_over_the_group() -> None:
    sd = _replicated(with_data=True)
    distribution = determine_main_replica_uniform_distribution(sd, None)
    assert distribution is not None
    agreed = all_gather_json(sorted(map(str, distribution.main_rank_for_shard.items())))
    assert_on_all_ranks(all(a == agreed[0] for a in agreed), "every rank computes the same distribution")
    distribute_main_replicas_with_precomputed_distribution(sd, None, distribution)
    written: List[str] = sum(all_gather_json([sh.key for sh in sd.values() if sh.replica_id == 0]), [])
    replicated = [k for k in sd if k != "own"]
    assert_on_all_ranks(sorted(written) == sorted(replicated + ["own"] * world()), f"writers: {sorted(written)}")
    nbytes = all_gather_json(sum(sh.data.numel() * sh.data.element_size() for sh in sd.values() if sh.replica_id == 0))
    largest = max(sh.data.numel() * sh.data.element_size() for sh in sd.values())
    assert_on_all_ranks(max(nbytes) - min(nbytes) <= largest, f"bytes per rank {nbytes}")


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_exchange_delivers_every_requested_shard_bit_exactly(algo: str) -> None:
    request = _replicated(with_data=False)
    distribution = determine_main_replica_uniform_distribution(request, None, ignore_groups=True)
    assert distribution is not None
    me = rank()
    by_id = {_sharded_tensor_shard_id(sh): sh for sh in request.values()}
    loaded = {sid: _expected(sh) for sid, sh in by_id.items() if distribution.main_rank_for_shard[sid] == me}
    unloaded = {sid: sh for sid, sh in by_id.items() if sid not in loaded}
    out = exchange_by_distribution(loaded, unloaded, distribution, None, algo)
    wrong = [sh.key for sid, sh in by_id.items() if sid not in out or not torch.equal(out[sid], _expected(sh))]
    assert_on_all_ranks(wrong == [], f"rank {me}: wrong or missing {wrong}")
    if algo != "gather_object":  # received into the request's own memory, as a load is
        in_place = [sh.key for sid, sh in unloaded.items() if out[sid] is not sh.data]
        assert_on_all_ranks(in_place == [], f"rank {me}: not in place {in_place}")
    else:  # every rank's loaded tensors, as Megatron-Core's gather_object returns
        assert_on_all_ranks(len(out) >= len(by_id))


@pytest.mark.parametrize("algo", ["broadcast", "gather_rounds"])
def test_exchange_raises_on_every_rank_when_one_rank_lacks_a_shard_it_must_send(algo: str) -> None:
    request = _replicated(with_data=False)
    distribution = determine_main_replica_uniform_distribution(request, None, ignore_groups=True)
    assert distribution is not None
    me = rank()
    by_id = {_sharded_tensor_shard_id(sh): sh for sh in request.values()}
    loaded = {sid: _expected(sh) for sid, sh in by_id.items() if distribution.main_rank_for_shard[sid] == me}
    if me == 1:
        loaded.pop(sorted((s for s in loaded if s[0] != "own"), key=str)[0])
    unloaded = {sid: sh for sid, sh in by_id.items() if sid not in loaded}
    raises_on_all_ranks(
        CheckpointingException,
        lambda: exchange_by_distribution(loaded, unloaded, distribution, None, algo),
        "not in loaded_tensors",
    )


def test_gather_object_refuses_a_shard_loaded_by_two_ranks_on_every_rank() -> None:
    request = _replicated(with_data=False)
    distribution = determine_main_replica_uniform_distribution(request, None, ignore_groups=True)
    shared = ("rep0", (0, 0), None)
    loaded = {shared: _value("rep0", (3, 2), torch.float32)} if rank() in (0, 1) else {}
    raises_on_all_ranks(
        CheckpointingException,
        lambda: exchange_by_distribution(loaded, {}, distribution, None, "gather_object"),
        "duplicate shard ids",
    )


def test_objects_gather_to_every_rank_and_unsafe_ones_are_refused_everywhere() -> None:
    me = rank()
    out = exchange_loaded_objects_gather_object({("rng", (me,), None): {"rank": me, "state": torch.arange(3) + me}})
    expected = {("rng", (r,), None): r for r in range(world())}
    ok = {k: v["rank"] for k, v in out.items()} == expected and all(
        torch.equal(v["state"], torch.arange(3) + v["rank"]) for v in out.values()
    )
    assert_on_all_ranks(ok, f"rank {me}: {sorted(out)}")
    raises_on_all_ranks(
        UnsafeObjectError,
        lambda: exchange_loaded_objects_gather_object({("obj", (me,), None): _Custom()}),
        "cannot be exchanged safely",
    )


def test_an_object_one_rank_cannot_serialize_fails_every_rank_instead_of_hanging() -> None:
    me = rank()
    objects = {("obj", (me,), None): (lambda: None) if me == world() - 1 else {"ok": me}}
    raises_on_all_ranks(CheckpointingException, lambda: exchange_loaded_objects_gather_object(objects))


class _Custom:
    """An object that needs pickle's code execution to be rebuilt."""
