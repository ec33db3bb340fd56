"""Asynchronous saves across ranks: every rank snapshots, writes in its own background process,
and the ranks agree on when to finalize; a failure of one rank's writer surfaces on every rank.

One queue (one writer process per rank) serves most of the module, so the writers' start-up is
paid once; a test that kills a writer lets the queue start a new one. A writer that hangs, or
never starts, fails the save on every rank within the queue's writer_timeout_s.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from pathlib import Path
from typing import Dict

import pytest
import torch
import torch.distributed as dist

import dist_ckpt as dc
from dist_ckpt.asynchronous.queue import AsyncCallsQueue, AsyncRequest
from dist_ckpt.backends.safetensors.strategy import SafetensorsSaveOptions, SafetensorsSaveShardedStrategy
from dist_ckpt.errors import AsyncSaveError, NotACheckpointError
from dist_ckpt.model.sharded import ShardedObject
from dist_ckpt.testing.layouts import bitwise_equal, full_tensor, tp_shards

from .helpers import assert_on_all_ranks, raises_on_all_ranks, rank, slow_write, world

pytestmark = pytest.mark.mpi(min_size=2)

SHAPES = {"row": ((8 * 4, 16), 0), "col": ((16, 8 * 4), 1)}


def _state(tp: int, empty: bool = False) -> Dict[str, object]:
    sd: Dict[str, object] = {}
    for name, (shape, axis) in SHAPES.items():
        sd.update(tp_shards(name, full_tensor(name, shape), axis, tp, rank(), world(), empty=empty))
    sd["obj"] = ShardedObject("rank_obj", {"rank": rank()}, (world(),), (rank(),))
    sd["step"] = 5
    return sd


@pytest.fixture(scope="module")
def queue():
    q = AsyncCallsQueue()
    yield q
    q.close()


def _finalize_non_blocking(queue: AsyncCallsQueue) -> list:
    """Poll like a training loop: every rank calls equally often until the call is finalized."""
    finished: list = []
    calls = 0
    while not finished:
        finished = queue.maybe_finalize_async_calls(blocking=False)
        calls += 1
    counts = [torch.tensor([calls]) for _ in range(world())]
    dist.all_gather(counts, torch.tensor([calls]))
    assert len({int(c) for c in counts}) == 1  # the ranks agreed at every poll
    return finished


@pytest.mark.parametrize("budget", [None, 1024])
def test_async_save_holds_the_values_of_the_call(shared_tmp_path: Path, queue, budget) -> None:
    strategy = SafetensorsSaveShardedStrategy(SafetensorsSaveOptions(snapshot_budget_bytes=budget))
    sd = _state(tp=world())
    request = dc.save(sd, shared_tmp_path / "c", sharded_strategy=strategy, async_sharded_save=True)
    idx = queue.schedule_async_request(request)
    for v in sd.values():  # training goes on
        if isinstance(v, dc.ShardedTensor):
            v.data.mul_(-1).add_(1)
    assert _finalize_non_blocking(queue) == [idx]
    # load in another layout (TP halved, DP=2) and compare with the values at the call
    loaded = dc.load(_state(tp=world() // 2, empty=True), shared_tmp_path / "c")
    ok = True
    for key, t in loaded.items():
        if "@" in key:
            name = key.split("@")[0]
            shape, axis = SHAPES[name]
            part = int(key.split("@tp")[1].split("dp")[0])
            size = shape[axis] // (world() // 2)
            ok = ok and bitwise_equal(t, full_tensor(name, shape).narrow(axis, part * size, size))
    assert_on_all_ranks(ok, "loaded values differ from those at the time of the async save")
    report = dc.verify_checkpoint(shared_tmp_path / "c")
    assert_on_all_ranks(report.ok, str(report.problems))


def test_ranks_finalize_only_when_every_writer_finished(shared_tmp_path: Path, queue) -> None:
    """Rank 1's writer is slow: rank 0's polls see its own write done, but nobody finalizes
    (nor commits) until rank 1's is done too."""
    request = dc.save(_state(tp=world()), shared_tmp_path / "c", async_sharded_save=True)
    delay = 1.5 if rank() == 1 else 0.0
    queue.schedule_async_request(
        dataclasses.replace(
            request, async_fn=slow_write, async_fn_args=(delay, request.async_fn, *request.async_fn_args)
        )
    )
    early_polls = 0
    finished: list = []
    while not finished:
        finished = queue.maybe_finalize_async_calls(blocking=False)
        if not finished and request.outcome.done:
            early_polls += 1
            assert not (shared_tmp_path / "c" / "metadata.json").exists()
    assert_on_all_ranks(rank() != 0 or early_polls > 0, "rank 0 never saw its write done before rank 1's")
    assert_on_all_ranks(dc.verify_checkpoint(shared_tmp_path / "c").ok)


def test_fully_parallel_async_save_spreads_the_writing(shared_tmp_path: Path, queue) -> None:
    from dist_ckpt.parallel.fully_parallel import FullyParallelSaveStrategyWrapper

    tp = world() // 2  # DP=2: every shard has a replica; the wrapper spreads who writes it
    strategy = FullyParallelSaveStrategyWrapper(SafetensorsSaveShardedStrategy())
    sd = _state(tp=tp)
    queue.schedule_async_request(dc.save(sd, shared_tmp_path / "c", sharded_strategy=strategy, async_sharded_save=True))
    for v in sd.values():
        if isinstance(v, dc.ShardedTensor):
            v.data.zero_()
    queue.maybe_finalize_async_calls(blocking=True)
    files = list((shared_tmp_path / "c" / "safetensors").glob("*.safetensors"))
    writers = {f.name.split("_")[0] for f in files}
    assert_on_all_ranks(len(writers) == world(), f"only {sorted(writers)} wrote files")  # every rank wrote
    loaded = dc.load(_state(tp=world(), empty=True), shared_tmp_path / "c")
    ok = True
    for key, t in loaded.items():
        if "@" in key:
            name = key.split("@")[0]
            shape, axis = SHAPES[name]
            part = int(key.split("@tp")[1].split("dp")[0])
            size = shape[axis] // world()
            ok = ok and bitwise_equal(t, full_tensor(name, shape).narrow(axis, part * size, size))
    assert_on_all_ranks(ok, "loaded values differ")
    zarr_wrapper = FullyParallelSaveStrategyWrapper(dc.get_default_strategy(dc.StrategyAction.SAVE_SHARDED, "zarr", 1))
    raises_on_all_ranks(
        dc.IncompatibleStrategyError,
        lambda: dc.save(_state(tp=tp), shared_tmp_path / "z", sharded_strategy=zarr_wrapper, async_sharded_save=True),
        "cannot save asynchronously",
    )


def _break_first_file(checkpoint: Path, victim: int) -> None:
    """A dangling link in place of rank ``victim``'s first file under its temporary name: the
    background writer can neither create it (where it writes everything) nor open it to fsync it
    (where the training process wrote the data: early_writes)."""
    partial = checkpoint / "safetensors" / f".partial-rank{victim:05d}_0.safetensors"
    partial.unlink(missing_ok=True)
    partial.symlink_to(partial.parent / "nowhere")


def test_writer_failure_on_one_rank_surfaces_on_every_rank(shared_tmp_path: Path, queue) -> None:
    victim = world() - 1
    request = dc.save(_state(tp=world()), shared_tmp_path / "c", async_sharded_save=True)
    if rank() == victim:
        _break_first_file(shared_tmp_path / "c", victim)
    queue.schedule_async_request(request)
    err = raises_on_all_ranks(
        AsyncSaveError, lambda: queue.maybe_finalize_async_calls(blocking=True), f"[rank {victim}]"
    )
    assert_on_all_ranks("FileExistsError" in str(err) or "FileNotFoundError" in str(err), str(err))
    assert_on_all_ranks(not (shared_tmp_path / "c" / "metadata.json").exists(), "a failed save was committed")
    raises_on_all_ranks(NotACheckpointError, lambda: dc.load(_state(tp=world(), empty=True), shared_tmp_path / "c"))
    assert_on_all_ranks(queue.get_num_unfinalized_calls() == 0)


def test_killed_writer_on_one_rank_surfaces_on_every_rank(shared_tmp_path: Path, queue) -> None:
    request = dc.save(_state(tp=world()), shared_tmp_path / "c", async_sharded_save=True)
    queue.schedule_async_request(request)
    if rank() == 0:
        os.kill(queue._worker.pid, signal.SIGKILL)
    raises_on_all_ranks(AsyncSaveError, lambda: queue.maybe_finalize_async_calls(blocking=True), "[rank 0]")
    assert_on_all_ranks(not (shared_tmp_path / "c" / "metadata.json").exists(), "a failed save was committed")
    # the next save gets a new writer on rank 0 and succeeds
    queue.schedule_async_request(dc.save(_state(tp=world()), shared_tmp_path / "d", async_sharded_save=True))
    queue.maybe_finalize_async_calls(blocking=True)
    assert_on_all_ranks(dc.verify_checkpoint(shared_tmp_path / "d").ok)


def test_execute_sync_raises_everywhere_when_one_rank_fails(shared_tmp_path: Path) -> None:
    request = dc.save(_state(tp=world()), shared_tmp_path / "c", async_sharded_save=True)
    if rank() == 1:
        _break_first_file(shared_tmp_path / "c", 1)
    raises_on_all_ranks(dc.CheckpointingException, request.execute_sync, "[rank 1]")
    assert_on_all_ranks(not (shared_tmp_path / "c" / "metadata.json").exists())


def _sleep_request(seconds: float) -> AsyncRequest:
    return AsyncRequest(time.sleep, (seconds,))


def test_hung_writer_on_one_rank_fails_the_save_on_every_rank(shared_tmp_path: Path) -> None:
    """The last rank's writer stops making progress (it sleeps: no CPU, like a hung file system):
    within the timeout every rank raises AsyncSaveError naming that rank and what it was doing."""
    victim = world() - 1
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(_sleep_request(0))  # every writer is up
        queue.maybe_finalize_async_calls(blocking=True)
        queue.writer_timeout_s = 3.0
        queue.schedule_async_request(_sleep_request(3600 if rank() == victim else 0))
        err = raises_on_all_ranks(
            AsyncSaveError, lambda: queue.maybe_finalize_async_calls(blocking=True), f"[rank {victim}]"
        )
        stalled = "made no progress" in str(err) or "stopped answering" in str(err)  # the latter on a loaded host
        assert_on_all_ranks(stalled and "running async call 1" in str(err), str(err))
        # the next save gets a new writer on the victim and commits
        queue.writer_timeout_s = 600.0
        queue.schedule_async_request(dc.save(_state(tp=world()), shared_tmp_path / "d", async_sharded_save=True))
        queue.maybe_finalize_async_calls(blocking=True)
        assert_on_all_ranks(dc.verify_checkpoint(shared_tmp_path / "d").ok)
    finally:
        queue.close(abort=True)


def test_writer_that_does_not_start_on_one_rank_fails_the_save_on_every_rank(
    shared_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dist_ckpt.asynchronous.worker as worker_module

    victim = world() - 1
    if rank() == victim:  # an interpreter that never says it is ready
        never_ready = [sys.executable, "-c", "import time; time.sleep(600)"]
        monkeypatch.setattr(worker_module, "writer_command", lambda fd: never_ready)
    queue = AsyncCallsQueue(writer_timeout_s=60.0 if rank() != victim else 3.0)
    try:
        request = dc.save(_state(tp=world()), shared_tmp_path / "c", async_sharded_save=True)
        queue.schedule_async_request(request)
        err = raises_on_all_ranks(
            AsyncSaveError, lambda: queue.maybe_finalize_async_calls(blocking=True), f"[rank {victim}]"
        )
        assert_on_all_ranks("did not start within 3 s" in str(err), str(err))
        assert_on_all_ranks(not (shared_tmp_path / "c" / "metadata.json").exists(), "a failed save was committed")
    finally:
        queue.close(abort=True)


def _count_collectives(monkeypatch: pytest.MonkeyPatch) -> Dict[str, int]:
    """Count the torch.distributed collectives called from now on, by name."""
    counts: Dict[str, int] = {}
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "gather", "barrier"):
        real = getattr(dist, name)

        def counting(*args: object, _real=real, _name=name, **kwargs: object) -> object:
            counts[_name] = counts.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, counting)
    return counts


def test_a_finished_call_is_finalized_after_one_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks agree in one all-reduce that the call at the head of the queue is the same one
    everywhere, that it finished everywhere and whether it failed anywhere: a poll of a training
    loop costs one small collective, whatever the number of ranks, and so does a finalization
    before its finalize functions."""
    queue = AsyncCallsQueue()
    finalized: list = []
    try:
        queue.schedule_async_request(AsyncRequest(None, (), [lambda: finalized.append(True)]))
        counts = _count_collectives(monkeypatch)
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        monkeypatch.undo()
        assert_on_all_ranks(finalized == [True] and counts == {"all_reduce": 1}, str(counts))
    finally:
        monkeypatch.undo()
        queue.close(abort=True)


def test_ranks_finalizing_different_calls_raise_on_every_rank() -> None:
    """A rank that scheduled one request more than the others (finalized locally): the heads of
    the queues are different calls, which every rank reports instead of finalizing, then drops."""
    queue = AsyncCallsQueue()
    try:
        if rank() == 0:
            queue.schedule_async_request(AsyncRequest(None, ()))
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        finalized: list = []
        queue.schedule_async_request(AsyncRequest(None, (), [lambda: finalized.append(True)]))
        raises_on_all_ranks(
            AsyncSaveError, lambda: queue.maybe_finalize_async_calls(blocking=True), "different async calls"
        )
        assert_on_all_ranks(not finalized, "a call was finalized while the ranks disagreed on which")
        # the calls are dropped: the queue goes on (here: it closes, finalizing nothing more)
        assert_on_all_ranks(queue.get_num_unfinalized_calls() == 0)
        queue.close()
    finally:
        queue.close(abort=True)


def test_async_save_function_commits_on_every_rank_and_reshards(shared_tmp_path: Path, queue) -> None:
    """dist_ckpt's async_save(): the future's result() is collective and commits the values of the call."""
    sd = _state(tp=world())
    future = dc.async_save(sd, shared_tmp_path / "c", queue=queue)
    for v in sd.values():  # training goes on
        if isinstance(v, dc.ShardedTensor):
            v.data.zero_()
    assert future.result() == str(shared_tmp_path / "c")
    loaded = dc.load(_state(tp=world() // 2, empty=True), shared_tmp_path / "c")
    expected = _state(tp=world() // 2)
    ok = all(bitwise_equal(loaded[k], v.data) for k, v in expected.items() if isinstance(v, dc.ShardedTensor))
    assert_on_all_ranks(ok, "async_save() committed other values than those of the call")
