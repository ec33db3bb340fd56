"""The validation step of a save, with real ranks: a repeated save of an unchanged structure costs
one all-reduce in all; a changed common state still warns, a changed sharding is still checked
in full, and a failure on one rank -- before or after the all-reduce -- raises on every rank.

Collectives are counted by wrapping torch.distributed's functions, on every rank, while the
step "validating the sharding" is active (its trailing error exchange included). Keys carry the
test's name, so no test reuses another's cached verdict.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

import dist_ckpt as dc
from dist_ckpt.collectives.distributed import active_steps
from dist_ckpt.engine.checks import common_state, save_checks
from dist_ckpt.engine.steps import Step

from .helpers import assert_on_all_ranks, raises_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)

#: every torch.distributed function a collective of dist_ckpt could go through
_COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "gather",
    "gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce",
    "scatter",
    "all_to_all",
    "reduce_scatter",
]

_WARNING = "There is difference in the common state dict in different ranks"


@pytest.fixture
def collectives(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """The names of the collectives this rank ran inside the validation step, in order."""
    calls: List[str] = []

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counting(*args: Any, **kwargs: Any) -> Any:
            if Step.VALIDATE_SHARDING.value in active_steps():
                calls.append(name)
            return original(*args, **kwargs)

        return counting

    for name in _COLLECTIVES:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, wrap(name, getattr(dist, name)))
    return calls


def state(tag: str, rows: int = 2) -> Dict[str, Any]:
    """A row-split weight, a replicated bias and a common step counter (valid)."""
    return {
        "w": dc.ShardedTensor.from_rank_offsets(f"{tag}.w", torch.full((rows, 4), float(rank())), (0, rank(), world())),
        "b": dc.ShardedTensor.from_rank_offsets(f"{tag}.b", torch.ones(4), replica_id=rank()),
        "step": 10,
    }


def common_warnings(caplog: pytest.LogCaptureFixture) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(_WARNING)]


def test_a_repeated_save_validates_in_one_all_reduce(shared_tmp_path: Path, collectives: List[str]) -> None:
    dc.save(state("one"), shared_tmp_path / "first")
    first = list(collectives)
    assert_on_all_ranks(len(first) > 1, f"the first save checked in full with {first}")
    for step in range(2):
        collectives.clear()
        dc.save(state("one"), shared_tmp_path / f"again_{step}")
        assert_on_all_ranks(collectives == ["all_reduce"], f"save {step + 2}: {collectives}")


def test_with_a_progress_callback_the_step_still_exchanges_its_errors(
    shared_tmp_path: Path, collectives: List[str]
) -> None:
    """A progress callback may fail on one rank: the step keeps its trailing exchange."""
    dc.save(state("progress"), shared_tmp_path / "first")
    collectives.clear()
    dc.save(state("progress"), shared_tmp_path / "again", progress=lambda event: None)
    assert_on_all_ranks(collectives == ["all_reduce", "all_reduce"], f"{collectives}")


def test_a_changed_common_state_after_a_cached_verdict_still_warns(
    shared_tmp_path: Path, caplog: pytest.LogCaptureFixture, gathers: List[int]
) -> None:
    dc.save(state("common"), shared_tmp_path / "first")
    dc.save(state("common"), shared_tmp_path / "second")
    assert_on_all_ranks(gathers[0] == 1, f"{gathers[0]} full sharding checks")
    changed = state("common")
    if rank() == 1:
        changed["step"] = 11
    with caplog.at_level(logging.WARNING, logger="dist_ckpt"):
        dc.save(changed, shared_tmp_path / "third")
    expected = f"{_WARNING}. The differences are { ({1: ([], [], [(('step',), int, int)])}) }"
    messages = common_warnings(caplog)
    ok = any(m.startswith(expected) for m in messages) if rank() == 0 else not messages  # rank 0 logs it
    assert_on_all_ranks(ok, f"{messages}")
    assert_on_all_ranks(gathers[0] == 1, f"{gathers[0]} full sharding checks: the sharding did not change")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dist_ckpt"):
        dc.save(
            changed,
            shared_tmp_path / "fourth",
            preprocess_common_before_consistancy_check=lambda c: {k: v for k, v in c.items() if k != "step"},
        )
    assert_on_all_ranks(not common_warnings(caplog), caplog.text)


def test_a_changed_sharding_on_one_rank_after_a_cached_verdict_fails_the_same_on_every_rank(
    shared_tmp_path: Path, gathers: List[int]
) -> None:
    dc.save(state("broken"), shared_tmp_path / "first")
    dc.save(state("broken"), shared_tmp_path / "second")
    broken = state("broken", rows=3 if rank() == 1 else 2)  # rank 1: another global shape
    err = raises_on_all_ranks(dc.ShardingIntegrityError, lambda: dc.save(broken, shared_tmp_path / "third"))
    messages: List[Optional[str]] = [None] * world()
    dist.all_gather_object(messages, str(err))
    assert_on_all_ranks(len(set(messages)) == 1, f"the ranks' messages differ: {messages}")
    assert_on_all_ranks(gathers[0] == 2, f"{gathers[0]} full sharding checks")
    dc.save(state("broken"), shared_tmp_path / "fourth")  # the last passing structure is still known
    assert_on_all_ranks(gathers[0] == 2, f"{gathers[0]} full sharding checks after going back")


def _fail_on_rank_1(what: str) -> Callable[[Dict[str, Any]], Dict[str, Any]]:
    def preprocess(common: Dict[str, Any]) -> Dict[str, Any]:
        if rank() == 1:
            raise ValueError(what)
        return common

    return preprocess


def test_a_failing_preprocess_hook_on_one_rank_raises_on_every_rank(shared_tmp_path: Path) -> None:
    dc.save(state("hook"), shared_tmp_path / "first")  # cached: the failure meets a would-be hit
    err = raises_on_all_ranks(
        dc.RankFailedError,
        lambda: dc.save(
            state("hook"),
            shared_tmp_path / "second",
            preprocess_common_before_consistancy_check=_fail_on_rank_1("no hook today"),
        ),
        match="[rank 1] no hook today",
    )
    ok = f"ValueError while {Step.VALIDATE_SHARDING.value}" in str(err)
    assert_on_all_ranks(ok, str(err))
    dc.save(state("hook"), shared_tmp_path / "third")  # the ranks are still in step


def test_shards_that_cannot_be_described_on_one_rank_raise_on_every_rank(
    shared_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dc.save(state("describe"), shared_tmp_path / "first")
    original = save_checks.shard_fields

    def failing(metadata: Any) -> Any:
        if rank() == 1:
            raise TypeError("cannot describe this shard")
        return original(metadata)

    monkeypatch.setattr(save_checks, "shard_fields", failing)
    err = raises_on_all_ranks(
        dc.RankFailedError, lambda: dc.save(state("describe"), shared_tmp_path / "second"), "cannot describe"
    )
    assert_on_all_ranks("[rank 1]" in str(err) and "describing the shards" in str(err), str(err))
    monkeypatch.setattr(save_checks, "shard_fields", original)
    dc.save(state("describe"), shared_tmp_path / "third")


def test_a_failure_in_the_full_comparison_on_one_rank_raises_on_every_rank(
    shared_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the all-reduce, the fallback's own failures are exchanged too (the monitor adds none)."""
    dc.save(state("fallback"), shared_tmp_path / "first")
    original = common_state.find_common_state_differences

    def failing(fingerprints: Any) -> Any:
        raise RuntimeError("comparison broke on rank 0")  # runs on rank 0 only: it holds the gathered states

    monkeypatch.setattr(common_state, "find_common_state_differences", failing)
    changed = state("fallback")
    changed["step"] = rank()
    raises_on_all_ranks(
        dc.RankFailedError, lambda: dc.save(changed, shared_tmp_path / "second"), "[rank 0] comparison broke"
    )
    monkeypatch.setattr(common_state, "find_common_state_differences", original)
    dc.save(state("fallback"), shared_tmp_path / "third")
