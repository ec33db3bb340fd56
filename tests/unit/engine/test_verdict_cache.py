"""Unit tests of dist_ckpt.engine.checks.verdict_cache, in one process (multi-rank: tests/distributed)."""

from __future__ import annotations

from typing import List

import pytest
import torch

from dist_ckpt.engine.checks import sharding, verdict_cache
from dist_ckpt.engine.checks.verdict_cache import Agreement, VerdictCache
from dist_ckpt.errors import ShardingIntegrityError
from dist_ckpt.model.shard_table import shard_fields
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor


def shards(key: str = "w", rows: int = 2, replica: int = 0) -> List[ShardedTensor]:
    return [ShardedTensor.from_rank_offsets(key, torch.zeros(rows, 3), replica_id=replica).without_data()]


def test_hit_only_for_the_recorded_structure():
    cache = VerdictCache()
    a, b = shard_fields(shards()), shard_fields(shards(rows=3))
    assert a != b
    assert cache.agree(a) is Agreement.MISS
    cache.record(a)
    assert cache.agree(shard_fields(shards())) is Agreement.HIT  # other objects, equal fields
    assert cache.agree(b) is Agreement.MISS
    cache.record(b)
    assert cache.agree(a) is Agreement.MISS  # one record per group: the last one
    assert cache.agree(None) is Agreement.FAILED
    cache.clear()
    assert cache.agree(b) is Agreement.MISS and len(cache) == 0


@pytest.mark.parametrize(
    "other",
    [
        shards(key="v"),
        shards(rows=4),
        shards(replica=1),
        [ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3, dtype=torch.float16))],
        [ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 1, 2))],
        [ShardedTensor.from_rank_offsets_flat("w", torch.zeros(4), (2, 3), flattened_range=slice(2, 6))],
        [ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), replica_id=(0, 0))],
        [ShardedTensor.from_rank_offsets("w", torch.zeros(1, 2, 3), prepend_axis_num=0)],
        [ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), allow_shape_mismatch=True)],
        [ShardedObject("w", None, (1,), (0,))],
        shards() + shards(key="x"),
        [],
    ],
    ids=[
        "key",
        "shape",
        "replica_id",
        "dtype",
        "offset",
        "flattened_range",
        "replica_form",
        "ndim",
        "shape_mismatch_flag",
        "object",
        "more_shards",
        "no_shards",
    ],
)
def test_every_change_is_a_miss(other):
    cache = VerdictCache()
    cache.agree(shard_fields(shards()))
    cache.record(shard_fields(shards()))
    assert cache.agree(shard_fields(other)) is Agreement.MISS
    cache.record(shard_fields(other))
    assert cache.agree(shard_fields(list(other))) is Agreement.HIT


def test_another_rank_in_the_same_group_is_a_miss(monkeypatch):
    """Ranks that swap places keep their own shards, but the global order changes."""
    cache = VerdictCache()
    cache.agree(shard_fields(shards()))
    cache.record(shard_fields(shards()))
    monkeypatch.setattr(verdict_cache, "get_rank", lambda group=None: 1)
    assert cache.agree(shard_fields(shards())) is Agreement.MISS


def test_groups_are_bounded_least_recently_used_first(monkeypatch):
    cache = VerdictCache(max_groups=2)
    group = [(1, 0)]
    monkeypatch.setattr(verdict_cache, "group_identity", lambda g=None: group[0])
    x = shard_fields(shards())
    for g in [(3, 0), (3, 1), (3, 2)]:
        group[0] = g
        cache.agree(x)
        cache.record(x)
    assert len(cache) == 2
    group[0] = (3, 0)
    assert cache.agree(x) is Agreement.MISS  # dropped
    group[0] = (3, 2)
    assert cache.agree(x) is Agreement.HIT


def test_generations_must_agree(monkeypatch):
    """A rank whose entry comes from another check than the others' forces a full check."""
    cache = VerdictCache()
    x = shard_fields(shards())
    cache.agree(x)
    cache.record(x)
    reduced = []

    def fake_all_reduce_max(values, group=None):
        reduced.append(list(values))
        failed, miss, gen, minus_gen = values
        return [failed, miss, gen + 1, minus_gen]  # another rank holds a newer generation

    monkeypatch.setattr(verdict_cache, "all_reduce_max", fake_all_reduce_max)
    assert cache.agree(x) is Agreement.MISS
    assert reduced == [[0, 0, 1, -1]]
    cache.record(x)  # after the full check: the newest generation + 1, the same on every rank
    assert cache._records[(1, 0)].generation == 3


def test_one_rank_save_path_skips_a_repeated_check_and_never_remembers_a_failure(monkeypatch):
    count = [0]
    original = sharding.gather_bytes

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(sharding, "gather_bytes", counting)
    good = shards(key="unit.good")
    sharding.gather_and_validate_sharding(good)
    sharding.gather_and_validate_sharding(shards(key="unit.good"))
    assert count[0] == 1
    bad = shards(key="unit.good", replica=1)  # no main replica: a gap
    for attempt in (1, 2):
        with pytest.raises(ShardingIntegrityError, match="gap in coverage"):
            sharding.gather_and_validate_sharding(bad)
        assert count[0] == 1 + attempt
    sharding.gather_and_validate_sharding(good)
    assert count[0] == 3


def test_a_shard_that_cannot_be_described_raises_before_any_gather(monkeypatch):
    monkeypatch.setattr(sharding, "gather_bytes", lambda *a, **k: pytest.fail("gathered"))
    with pytest.raises(TypeError, match="cannot describe"):
        sharding.gather_and_validate_sharding([object()])  # type: ignore[list-item]
