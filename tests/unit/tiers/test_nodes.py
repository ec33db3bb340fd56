"""Node identity from the launcher's environment; replica placement on other nodes."""

from __future__ import annotations

import pytest

from dist_ckpt.errors import CheckpointManagementError
from dist_ckpt.tiers import NODE_ID_ENV, node_identity, replica_ranks


def test_override_then_local_world_size_then_host() -> None:
    assert node_identity(3, {NODE_ID_ENV: "a", "LOCAL_WORLD_SIZE": "2"}) == "a"
    assert node_identity(3, {"LOCAL_WORLD_SIZE": "2"}) == "node1"
    assert node_identity(0, {}) != ""
    with pytest.raises(CheckpointManagementError, match="LOCAL_WORLD_SIZE"):
        node_identity(0, {"LOCAL_WORLD_SIZE": "two"})


def test_replicas_land_on_other_nodes() -> None:
    nodes = ["n0", "n0", "n1", "n1"]
    assert replica_ranks(nodes, 1) == {0: [2], 1: [3], 2: [0], 3: [1]}
    three = ["a", "b", "c"]
    plan = replica_ranks(three, 2)
    for rank, peers in plan.items():
        assert len(set(peers)) == 2 and all(three[p] != three[rank] for p in peers)


def test_uneven_nodes_and_no_replicas() -> None:
    assert replica_ranks(["a", "a", "b"], 1) == {0: [2], 1: [2], 2: [0]}
    assert replica_ranks(["a", "a"], 0) == {0: [], 1: []}


def test_too_few_nodes() -> None:
    with pytest.raises(CheckpointManagementError, match="at least 2 nodes"):
        replica_ranks(["a", "a"], 1)
