"""The asynchronous one-call API across ranks: ``async_save_model_and_optim_state`` on an
``AsyncCallsQueue`` and ``Checkpointer.save(..., async_save=True)``, with FSDP2 models.

* A background write that fails on one rank raises AsyncSaveError on every rank at finalization,
  naming that rank; nothing is committed and the run's latest checkpoint stays the previous one.
* Saving every step with several saves in flight, keeping the last 2: just before each commit
  (every rank's files written), ``find_latest_checkpoint`` returns the previous step and
  rotation has counted and kept only finalized checkpoints, never deleting one in flight.
* Training resumed from an asynchronous checkpoint continues bit-exactly, and the checkpoint
  equals a synchronous one of the same state.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dist_ckpt as dc
from dist_ckpt.asynchronous.queue import AsyncCallsQueue, AsyncRequest
from dist_ckpt.errors import AsyncSaveError, NotACheckpointError
from dist_ckpt.testing.layouts import bitwise_equal
from dist_ckpt.testing.training import (
    exact_loss_scale,
    full_state,
    make_model,
    make_optimizer,
    reference_run,
    shard_with_fsdp2,
    state_differences,
    train,
)
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

from .helpers import assert_on_all_ranks, raises_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)

N, M = 3, 2


@pytest.fixture(scope="module")
def queue() -> Iterator[AsyncCallsQueue]:
    q = AsyncCallsQueue()  # one writer process per rank for the module
    yield q
    q.close()


def _fsdp2_trained(steps: int) -> Any:
    model = shard_with_fsdp2(make_model(seed=0))
    optim = make_optimizer("adamw", model)
    train(model, optim, range(steps), exact_loss_scale(rank(), world()))
    return model, optim


def before_commit(request: AsyncRequest, fn: Callable[[], None]) -> AsyncRequest:
    """``request`` with ``fn`` run first at finalization: every rank's files are written, the
    checkpoint is not committed yet."""
    return dataclasses.replace(request, finalize_fns=[fn, *request.finalize_fns])


def test_failure_on_one_rank_raises_on_every_rank_at_finalization(shared_tmp_path: Path, queue) -> None:
    run = shared_tmp_path / "run"
    victim = world() - 1
    model, optim = _fsdp2_trained(1)
    save_model_and_optim_state(next_checkpoint_path(run, 10), model, optim)
    request = async_save_model_and_optim_state(
        next_checkpoint_path(run, 20), model, optim, save_strategy=FailingWriteStrategy(failing_ranks=(victim,))
    )
    queue.schedule_async_request(request)
    error = raises_on_all_ranks(
        AsyncSaveError, lambda: queue.maybe_finalize_async_calls(blocking=True), f"[rank {victim}]"
    )
    assert_on_all_ranks(INJECTED in str(error), str(error))
    assert_on_all_ranks(queue.get_num_unfinalized_calls() == 0)
    assert_on_all_ranks(not validate_checkpoint(run / "checkpoint-20"), "a failed save was committed")
    assert_on_all_ranks(find_latest_checkpoint(run) == str(run / "checkpoint-10"))
    target = shard_with_fsdp2(make_model(seed=1))
    raises_on_all_ranks(NotACheckpointError, lambda: load_model_and_optim_state(run / "checkpoint-20", target))


def test_rotation_and_latest_see_only_finalized_checkpoints(shared_tmp_path: Path, queue) -> None:
    run, keep, steps = shared_tmp_path / "run", 2, 6
    model, optim = _fsdp2_trained(0)
    scheduled: List[int] = []
    seen: Dict[int, Any] = {}

    def observe(step: int) -> None:  # rank 0, the files of `step` written, not committed
        if rank() == 0:
            seen[step] = (find_latest_checkpoint(run), sorted(p.name for p in run.iterdir()), list(scheduled))

    def rotate() -> None:  # after the commit, as a training loop does
        if rank() == 0:
            maybe_delete_oldest_checkpoint(run, max_checkpoints=keep)

    for step in range(1, steps + 1):
        train(model, optim, [step], exact_loss_scale(rank(), world()))
        request = async_save_model_and_optim_state(next_checkpoint_path(run, step), model, optim)
        request = before_commit(request, functools.partial(observe, step))
        request.add_finalize_fn(rotate)
        queue.schedule_async_request(request)
        scheduled.append(step)
        queue.maybe_finalize_async_calls(blocking=False)  # several saves may be in flight
    queue.maybe_finalize_async_calls(blocking=True)

    problems = []
    if rank() == 0:
        for step, (latest, names, in_flight) in sorted(seen.items()):
            finalized = [s for s in range(max(1, step - keep), step)]  # the last `keep` before `step`
            expected_names = sorted(f"checkpoint-{s}" for s in finalized + [s for s in in_flight if s >= step])
            expected_latest = str(run / f"checkpoint-{step - 1}") if step > 1 else None
            if latest != expected_latest or names != expected_names:
                problems.append(f"before committing {step}: latest {latest}, dirs {names}; expected {expected_names}")
        if sorted(seen) != list(range(1, steps + 1)):
            problems.append(f"observed {sorted(seen)}")
    assert_on_all_ranks(not problems, "; ".join(problems))
    assert_on_all_ranks(sorted(p.name for p in run.iterdir()) == ["checkpoint-5", "checkpoint-6"])
    assert_on_all_ranks(find_latest_checkpoint(run) == str(run / "checkpoint-6"))


def test_resume_from_an_async_checkpoint_is_bit_exact(shared_tmp_path: Path, queue) -> None:
    model, optim = _fsdp2_trained(N)
    request = async_save_model_and_optim_state(shared_tmp_path / "async", model, optim)
    save_model_and_optim_state(shared_tmp_path / "sync", model, optim)
    queue.schedule_async_request(request)
    train(model, optim, range(N, N + 2), exact_loss_scale(rank(), world()))  # goes on during the write
    queue.maybe_finalize_async_calls(blocking=True)
    a, s = dc.unshard(str(shared_tmp_path / "async")), dc.unshard(str(shared_tmp_path / "sync"))
    assert_on_all_ranks(a.keys() == s.keys() and all(bitwise_equal(a[k], s[k]) for k in s), "async != sync")

    resumed = shard_with_fsdp2(make_model(seed=1))
    resumed_optim = make_optimizer("adamw", resumed, lr_scale=7.0)
    load_model_and_optim_state(shared_tmp_path / "async", resumed, resumed_optim)
    train(resumed, resumed_optim, range(N, N + M), exact_loss_scale(rank(), world()))
    diffs = state_differences(reference_run("adamw", N + M), full_state(resumed, resumed_optim))
    assert_on_all_ranks(not diffs, f"differences from the uninterrupted run: {diffs[:8]}")


def test_checkpointer_async_saves_of_dtensors(shared_tmp_path: Path) -> None:
    mesh = init_device_mesh("cpu", (world(),))
    full = torch.arange(7 * 8, dtype=torch.float32).reshape(7, 8)
    x = distribute_tensor(full.clone(), mesh, [Shard(0)])
    ckpt = Checkpointer()
    try:
        for step in (1, 2, 3):
            ckpt.save(shared_tmp_path / f"step_{step}", {"x": x}, async_save=True)
            x.to_local().add_(1.0)  # after the snapshot
        committed = ckpt.maybe_finalize_async_saves(blocking=True)
        assert_on_all_ranks(committed == [str(shared_tmp_path / f"step_{s}") for s in (1, 2, 3)], str(committed))
        for step in (1, 2, 3):
            out = distribute_tensor(torch.zeros(7, 8), mesh, [Shard(1)])
            ckpt.load(shared_tmp_path / f"step_{step}", {"x": out}, validate=True)
            assert_on_all_ranks(bitwise_equal(out.full_tensor(), full + (step - 1)), f"step {step}")
        ckpt.save(shared_tmp_path / "last", {"x": x}, async_save=True)
        committed = ckpt.close()  # waits for and commits the rest
        assert_on_all_ranks(committed == [str(shared_tmp_path / "last")], str(committed))
    finally:
        ckpt.close(abort=True)


def test_checkpointer_async_failure_on_one_rank_raises_on_every_rank(shared_tmp_path: Path) -> None:
    victim = world() - 1
    ckpt = Checkpointer(save_strategy=FailingWriteStrategy(failing_ranks=(victim,)))
    try:
        ckpt.save(shared_tmp_path / "c", {"w": torch.ones(4, 4)}, async_save=True)
        error = raises_on_all_ranks(
            AsyncSaveError, lambda: ckpt.maybe_finalize_async_saves(blocking=True), f"[rank {victim}]"
        )
        assert_on_all_ranks(INJECTED in str(error), str(error))
        assert_on_all_ranks(ckpt.pending_async_saves == [] and not validate_checkpoint(shared_tmp_path / "c"))
    finally:
        ckpt.close(abort=True)
