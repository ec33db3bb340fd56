"""Megatron-Core's exchange API at world size 1 and its pure parts (multi-rank behaviour:
tests/distributed/test_exchange_utils.py)."""

from __future__ import annotations

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.errors import ArgumentTypeError, CheckpointingException, UnknownStrategyError
from dist_ckpt.parallel.exchange import distribute_shards_to_ranks
from dist_ckpt.parallel.shard_distribution import (
    ShardDistribution,
    determine_main_replica_uniform_distribution,
    distribute_main_replicas_with_precomputed_distribution,
    empty_tensor_for_exchange,
    exchange_by_distribution,
    exchange_loaded_objects_gather_object,
    exchange_loaded_tensors_gather_object,
    sharded_tensor_shard_id,
)


def test_shard_id_is_megatrons_tuple() -> None:
    st = dc.ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 1, 2))
    assert sharded_tensor_shard_id(st) == ("w", (2, 0), None)
    flat = dc.ShardedTensor.from_rank_offsets_flat("f", torch.zeros(3), (2, 3), flattened_range=slice(1, 4))
    assert sharded_tensor_shard_id(flat) == ("f", (0, 0), (1, 4))


def test_cross_group_loads_go_last_then_fewest_candidates_then_largest() -> None:
    a, b, c = ("a", (0,), None), ("b", (0,), None), ("c", (0,), None)
    ranks = {a: [0, 1], b: [0, 1], c: [0, 1]}
    sizes = {a: 10, b: 5, c: 100}
    assert distribute_shards_to_ranks(ranks, sizes, 2) == {c: 0, a: 1, b: 1}
    # c's main replica is in another group: assigned after a and b, to the least loaded rank
    assert distribute_shards_to_ranks(ranks, sizes, 2, {c}) == {a: 0, b: 1, c: 1}


def test_world_of_one_needs_no_distribution() -> None:
    st = dc.ShardedTensor.from_rank_offsets("w", torch.zeros(2), replica_id=3)
    assert determine_main_replica_uniform_distribution({"w": st}, None) is None
    distribute_main_replicas_with_precomputed_distribution({"w": st}, None, None)
    assert st.replica_id == 3  # nothing to spread in a group of one


def test_exchange_by_distribution_names_the_algorithms_and_needs_a_distribution() -> None:
    empty = ShardDistribution({}, set(), {}, {})
    with pytest.raises(UnknownStrategyError, match="'p2p'.*broadcast, gather_rounds, gather_object"):
        exchange_by_distribution({}, {}, empty, None, "p2p")
    with pytest.raises(ArgumentTypeError, match="needs a ShardDistribution"):
        exchange_by_distribution({}, {}, None)


def test_gather_object_in_a_world_of_one_returns_what_was_loaded() -> None:
    t = torch.arange(4, dtype=torch.bfloat16)
    sid = ("w", (0,), None)
    assert exchange_loaded_tensors_gather_object({sid: t}, {}, None)[sid] is t
    assert exchange_loaded_objects_gather_object({("o", (0,), None): {"step": 3}}) == {("o", (0,), None): {"step": 3}}


def test_broadcast_refuses_a_missing_shard_it_must_send() -> None:
    sid = ("w", (0,), None)
    st = dc.ShardedTensor.from_rank_offsets("w", torch.zeros(2))
    distribution = ShardDistribution({sid: 0}, {sid}, {sid: st.without_data()}, {sid: [0, 1]})
    with pytest.raises(CheckpointingException, match="not in loaded_tensors"):
        exchange_by_distribution({}, {}, distribution, None, "broadcast")


def test_empty_tensor_for_exchange_receives_a_needed_shard_in_place_and_a_scratch_one_otherwise() -> None:
    needed = dc.ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))
    unneeded = dc.ShardedTensor.from_rank_offsets_flat("f", torch.zeros(4), (2, 3), flattened_range=slice(1, 5))
    loaded: dict = {}
    tensor, device = empty_tensor_for_exchange(("w", (0, 0), None), {("w", (0, 0), None): needed}, {}, loaded)
    assert tensor is needed.data and device == torch.device("cpu") and loaded == {("w", (0, 0), None): tensor}
    scratch, none = empty_tensor_for_exchange(
        ("f", (0, 0), (1, 5)), {}, {("f", (0, 0), (1, 5)): unneeded.without_data()}, loaded
    )
    assert scratch.shape == (4,) and none is None and len(loaded) == 1
