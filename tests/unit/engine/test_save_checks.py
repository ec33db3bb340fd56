"""Unit tests of dist_ckpt.engine.checks.save_checks in one process (multi-rank:
tests/distributed/test_save_validation.py)."""

from __future__ import annotations

from typing import Any, List, Sequence

import pytest
import torch

from dist_ckpt.engine.checks import save_checks
from dist_ckpt.engine.checks.verdict_cache import VOTES
from dist_ckpt.errors import ShardingIntegrityError
from dist_ckpt.model.sharded import ShardedTensor


def shards(key: str, replica: int = 0) -> List[ShardedTensor]:
    return [ShardedTensor.from_rank_offsets(key, torch.zeros(2, 3), replica_id=replica).without_data()]


@pytest.fixture
def reduced(monkeypatch: pytest.MonkeyPatch) -> List[List[int]]:
    """Every all-reduce ``validate_save`` makes, as this rank's values."""
    calls: List[List[int]] = []
    original = save_checks.all_reduce_max

    def recording(values: Sequence[int], group: Any = None) -> List[int]:
        calls.append(list(values))
        return original(values, group)

    monkeypatch.setattr(save_checks, "all_reduce_max", recording)
    return calls


def test_a_repeated_validation_is_one_all_reduce_and_no_gather(gathers: List[int], reduced: List[List[int]]) -> None:
    save_checks.validate_save(shards("unit.save_checks.repeat"), {"step": 1})
    assert gathers[0] == 1
    save_checks.validate_save(shards("unit.save_checks.repeat"), {"step": 2})  # one rank: always the same state
    assert gathers[0] == 1
    assert len(reduced) == 2 and all(len(values) == VOTES + 2 for values in reduced)
    failed, miss = reduced[1][:2]
    assert (failed, miss) == (0, 0)


def test_an_invalid_sharding_raises_and_is_not_remembered(gathers: List[int]) -> None:
    bad = shards("unit.save_checks.bad", replica=1)  # no main replica: a gap
    for attempt in (1, 2):
        with pytest.raises(ShardingIntegrityError, match="gap in coverage"):
            save_checks.validate_save(bad, {})
        assert gathers[0] == attempt


def test_a_failing_preprocess_hook_raises_its_error_before_any_gather(gathers: List[int]) -> None:
    def hook(common: Any) -> Any:
        raise ValueError("hook failed")

    with pytest.raises(ValueError, match="hook failed"):
        save_checks.validate_save(shards("unit.save_checks.hook"), {}, hook)
    assert gathers[0] == 0


def test_the_hook_is_given_the_common_state() -> None:
    seen: List[Any] = []

    def hook(common: Any) -> Any:
        seen.append(common)
        return {k: v for k, v in common.items() if k != "rank"}

    save_checks.validate_save(shards("unit.save_checks.seen"), {"rank": 0, "step": 1}, hook)
    assert seen == [{"rank": 0, "step": 1}]
