"""The asynchronous one-call API in one process: ``async_save_model_and_optim_state`` and
``Checkpointer.save(..., async_save=True)``.

A save returns after a snapshot, holds the state of the call, and is committed only when it is
finalized: before that, written or not, ``find_latest_checkpoint`` skips it, rotation neither
counts nor deletes it, and a load refuses it. A failed background write raises at finalization
and commits nothing. A checkpoint saved asynchronously equals one saved synchronously, and
training resumed from it continues bit-exactly. (Across ranks: tests/distributed/test_async_model_optim.py.)
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.asynchronous.queue import AsyncCallsQueue, AsyncRequest
from dist_ckpt.errors import AsyncSaveError, CheckpointExistsError, IncompatibleStrategyError, NotACheckpointError
from dist_ckpt.testing.layouts import bitwise_equal
from dist_ckpt.testing.training import full_state, make_model, make_optimizer, reference_run, state_differences, train
from dist_ckpt.training.checkpointer import Checkpointer
from dist_ckpt.training.checkpoints import (
    find_latest_checkpoint,
    maybe_delete_oldest_checkpoint,
    next_checkpoint_path,
    validate_checkpoint,
)
from dist_ckpt.training.model_optim import (
    async_save_model_and_optim_state,
    load_model_and_optim_state,
    save_model_and_optim_state,
)
from tests.failing_writes import INJECTED, FailingWriteStrategy

N, M = 3, 2


def before_commit(request: AsyncRequest, fn: Callable[[], None]) -> AsyncRequest:
    """``request`` with ``fn`` run at finalization first: after the background write, before the
    commit -- the state of a checkpoint that is written but not finalized."""
    return dataclasses.replace(request, finalize_fns=[fn, *request.finalize_fns])


@pytest.fixture(scope="module")
def queue() -> Iterator[AsyncCallsQueue]:
    q = AsyncCallsQueue()  # one writer process for the module
    yield q
    q.close()


def _trained(steps: int = N) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model(seed=0)
    optim = make_optimizer("adamw", model)
    train(model, optim, range(steps))
    return model, optim


def _names(run: Path) -> List[str]:
    return sorted(p.name for p in run.iterdir())


def test_async_save_holds_the_call_state_and_training_resumes_bit_exactly(tmp_path: Path, queue) -> None:
    model, optim = _trained()
    request = async_save_model_and_optim_state(tmp_path / "async", model, optim)
    expected = full_state(model, optim)
    save_model_and_optim_state(tmp_path / "sync", model, optim)
    queue.schedule_async_request(request)
    train(model, optim, range(N, N + 2))  # training goes on while the writer writes
    queue.maybe_finalize_async_calls(blocking=True)
    assert dc.verify_checkpoint(tmp_path / "async").ok
    # the same checkpoint as a synchronous save of the same state
    async_tensors, sync_tensors = dc.unshard(str(tmp_path / "async")), dc.unshard(str(tmp_path / "sync"))
    assert async_tensors.keys() == sync_tensors.keys()
    assert all(bitwise_equal(async_tensors[k], sync_tensors[k]) for k in sync_tensors)
    # resumed into a fresh, misconfigured optimizer: the state of the call, then the same training
    resumed = make_model(seed=1)
    resumed_optim = make_optimizer("adamw", resumed, lr_scale=7.0)
    load_model_and_optim_state(tmp_path / "async", resumed, resumed_optim)
    assert state_differences(expected, full_state(resumed, resumed_optim)) == []
    train(resumed, resumed_optim, range(N, N + M))
    assert state_differences(reference_run("adamw", N + M), full_state(resumed, resumed_optim)) == []


def test_unfinalized_checkpoint_is_never_latest_nor_counted_by_rotation(tmp_path: Path, queue) -> None:
    run = tmp_path / "run"
    model, optim = _trained(1)
    for step in (10, 20):
        save_model_and_optim_state(next_checkpoint_path(run, step), model, optim)
    request = async_save_model_and_optim_state(next_checkpoint_path(run, 30), model, optim)
    # snapshotted, not written yet
    assert find_latest_checkpoint(run) == str(run / "checkpoint-20")
    seen: Dict[str, Any] = {}

    def written_not_committed() -> None:  # every file of checkpoint-30 is written by now
        seen["complete"] = validate_checkpoint(run / "checkpoint-30")
        seen["latest"] = find_latest_checkpoint(run)
        maybe_delete_oldest_checkpoint(run, max_checkpoints=2)  # 10 and 20 are the 2 complete ones
        seen["names"] = _names(run)
        with pytest.raises(NotACheckpointError):
            load_model_and_optim_state(run / "checkpoint-30", make_model(seed=1))
        seen["load refused"] = True

    queue.schedule_async_request(before_commit(request, written_not_committed))
    queue.maybe_finalize_async_calls(blocking=True)
    assert seen == {
        "complete": False,
        "latest": str(run / "checkpoint-20"),
        "names": ["checkpoint-10", "checkpoint-20", "checkpoint-30"],
        "load refused": True,
    }
    # finalized: committed, the latest, and counted by rotation
    assert find_latest_checkpoint(run) == str(run / "checkpoint-30")
    maybe_delete_oldest_checkpoint(run, max_checkpoints=2)
    assert _names(run) == ["checkpoint-20", "checkpoint-30"]


def test_finalize_functions_run_after_the_commit(tmp_path: Path, queue) -> None:
    model, optim = _trained(1)
    request = async_save_model_and_optim_state(tmp_path / "c", model, optim)
    committed: List[bool] = []
    request.add_finalize_fn(lambda: committed.append(validate_checkpoint(tmp_path / "c")))
    queue.schedule_async_request(request)
    assert committed == []  # nothing runs before finalization
    queue.maybe_finalize_async_calls(blocking=True)
    assert committed == [True]


def test_failed_background_write_raises_at_finalization_and_commits_nothing(tmp_path: Path, queue) -> None:
    model, optim = _trained(1)
    request = async_save_model_and_optim_state(
        tmp_path / "c", model, optim, save_strategy=FailingWriteStrategy(failing_ranks=(0,))
    )
    queue.schedule_async_request(request)
    with pytest.raises(AsyncSaveError, match=r"\[rank 0\](.|\n)*" + re.escape(INJECTED)):
        queue.maybe_finalize_async_calls(blocking=True)
    assert not validate_checkpoint(tmp_path / "c")
    assert find_latest_checkpoint(tmp_path) is None
    assert queue.get_num_unfinalized_calls() == 0


def test_a_strategy_that_cannot_save_asynchronously_is_refused_before_writing(tmp_path: Path) -> None:
    model, optim = _trained(1)
    with pytest.raises(IncompatibleStrategyError, match="AsyncSaveShardedStrategy"):
        async_save_model_and_optim_state(tmp_path / "c", model, optim, save_strategy=("zarr", 1))
    assert not (tmp_path / "c" / "zarr").exists()


def test_checkpointer_async_saves_commit_at_finalization_in_order(tmp_path: Path) -> None:
    ckpt = Checkpointer()
    w = torch.arange(12.0).reshape(3, 4)
    try:
        meta = ckpt.save(tmp_path / "a", {"w": w}, async_save=True)
        assert meta.tensors["w"].shape == (3, 4)
        w.add_(100.0)  # after the snapshot: checkpoint a keeps the values of the call
        assert ckpt.pending_async_saves == [str(tmp_path / "a")]
        assert not validate_checkpoint(tmp_path / "a")
        with pytest.raises(CheckpointExistsError, match="not finalized yet"):
            ckpt.save(tmp_path / "a", {"w": w}, async_save=True)
        ckpt.save(tmp_path / "b", {"w": w}, async_save=True)
        assert ckpt.maybe_finalize_async_saves(blocking=True) == [str(tmp_path / "a"), str(tmp_path / "b")]
        assert ckpt.pending_async_saves == [] and ckpt.maybe_finalize_async_saves() == []
        for name, expected in (("a", torch.arange(12.0).reshape(3, 4)), ("b", w)):
            out = torch.zeros(3, 4)
            ckpt.load(tmp_path / name, {"w": out})
            assert bitwise_equal(out, expected), name
        ckpt.save(tmp_path / "c", {"w": w}, async_save=True)
        assert ckpt.close() == [str(tmp_path / "c")]  # waits for and commits the rest
        assert validate_checkpoint(tmp_path / "c")
    finally:
        ckpt.close(abort=True)


def test_checkpointer_async_failure_raises_and_leaves_no_pending_save(tmp_path: Path) -> None:
    ckpt = Checkpointer(save_strategy=FailingWriteStrategy(failing_ranks=(0,)))
    try:
        ckpt.save(tmp_path / "a", {"w": torch.ones(2, 2)}, async_save=True)
        with pytest.raises(AsyncSaveError, match=re.escape(INJECTED)):
            ckpt.maybe_finalize_async_saves(blocking=True)
        assert ckpt.pending_async_saves == []
        assert not validate_checkpoint(tmp_path / "a")
    finally:
        ckpt.close(abort=True)
