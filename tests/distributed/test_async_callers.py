"""Megatron-Core's async callers at 2 and 4 ranks: a request is done only when it is done on every rank,
and a failure on one rank raises on every rank (both in the one all-reduce each check makes)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from dist_ckpt.errors import AsyncSaveError
from dist_ckpt.strategies.async_utils import AsyncRequest, PersistentAsyncCaller, TemporalAsyncCaller
from tests.deadlines import scaled

from .helpers import assert_on_all_ranks, raises_on_all_ranks, rank

pytestmark = pytest.mark.mpi(min_size=2)


def wait_for(path: str, limit_s: float) -> str:
    """Background work that lasts until ``path`` exists (or ``limit_s`` passed)."""
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return "released" if os.path.exists(path) else "timed out"


def fail_on(bad_rank: int, this_rank: int) -> None:
    if this_rank == bad_rank:
        raise ValueError(f"rank {this_rank} cannot write")


@pytest.mark.parametrize("caller_class", [PersistentAsyncCaller, TemporalAsyncCaller])
def test_done_only_when_done_on_every_rank(caller_class: type, shared_tmp_path: Path) -> None:
    gate = str(shared_tmp_path / "gate")
    caller = caller_class()
    try:
        slow = rank() == 1
        request = AsyncRequest(wait_for, (gate if slow else str(shared_tmp_path), scaled(60))).freeze()
        caller.schedule_async_call(request)
        if not slow:
            assert caller._worker is not None
            caller._worker.wait(request.outcome)  # this rank's work is over; rank 1's is not
        dist.barrier()
        early = caller.is_current_async_call_done(blocking=False)
        if slow:
            Path(gate).touch()
        done = caller.is_current_async_call_done(blocking=True)
        assert_on_all_ranks(
            not early and done and request.outcome.result == "released", f"{early} {done} {request.outcome}"
        )
    finally:
        caller.close()


def test_a_failure_on_one_rank_raises_on_every_rank() -> None:
    caller = PersistentAsyncCaller()
    try:
        caller.schedule_async_call(AsyncRequest(fail_on, (1, rank())).freeze())
        raises_on_all_ranks(
            AsyncSaveError, lambda: caller.is_current_async_call_done(blocking=True), "rank 1 cannot write"
        )
        assert_on_all_ranks(caller.is_current_async_call_done(), "the failed request is still current")
    finally:
        caller.close()
