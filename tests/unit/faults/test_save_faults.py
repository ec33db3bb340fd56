"""A fault at every write call of a save: raised (a failing disk) or a kill (no cleanup at all).

For each backend (safetensors, zarr, torch_dist) and each save mode (sync; async for
safetensors and torch_dist), a first save lists its write calls (tests/unit/faults/inject.py);
then one attempt per call makes exactly that call fail (of a run of writes into one file object,
as ``torch.save`` makes for DCP's files, the first, the last and every 16th; kills of zarr saves:
every second call; kills of the background writer process: its first, middle and last call, as
each costs a new process). Each attempt must leave the previous checkpoint untouched, commit
nothing partial, leave no partial data file under a final name (and, when the save raised,
no file at all), raise a typed error (or the injected OSError itself, unchanged, in a single
process) and leave the location usable by the next save (tests/unit/faults/scenario.py). The
outcomes go to the suite's scoreboard.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterator, List

import pytest

import dist_ckpt as dc
from dist_ckpt.asynchronous.queue import AsyncCallsQueue, AsyncRequest
from dist_ckpt.backends.safetensors.strategy import SafetensorsSaveOptions, SafetensorsSaveShardedStrategy
from dist_ckpt.backends.torch_dist.save import TorchDistSaveShardedStrategy

from . import tally
from .inject import Injector, attack_points, run_with_fault
from .scenario import Run, check_loads, kill_at, raise_at, state, strategy

BACKENDS = ["safetensors", "zarr", "torch_dist"]
ASYNC_BACKENDS = ["safetensors", "torch_dist"]


def _points(save: Any, path: Path) -> List[int]:
    """The write calls of ``save(path)`` to attack (`attack_points()`)."""
    with Injector() as injector:
        save(path)
    return attack_points(injector.calls)


def _worker_points(counted: Path) -> List[int]:
    return attack_points(counted.read_text().splitlines())


@pytest.fixture(scope="module")
def queue() -> Iterator[AsyncCallsQueue]:
    q = AsyncCallsQueue(persistent=True)
    yield q
    q.close()


def _fault_at_every_write_of_a_sync_save(tmp_path: Path, backend: str, fault: str, every: int = 1) -> None:
    """One row of the scoreboard: ``fault`` ("raise" or "kill") at each ``every``-th write call
    of a sync save of ``backend``."""
    run = Run(tmp_path, backend)
    fault_at = {"raise": raise_at, "kill": kill_at}[fault]

    def save(target: Path) -> None:
        dc.save(state(2.0), target, sharded_strategy=strategy(backend))

    row = f"{fault} at each write, sync save, {backend}"
    for at in _points(save, tmp_path / "count")[::every]:
        tally.attempt(row, f"write call {at}", fault_at(run, at, save))
    tally.assert_clean(row)


@pytest.mark.parametrize("backend", BACKENDS)
def test_raised_io_error_at_every_write_of_a_sync_save(tmp_path, backend):
    _fault_at_every_write_of_a_sync_save(tmp_path, backend, "raise")


@pytest.mark.parametrize("backend", BACKENDS)
def test_kill_at_every_write_of_a_sync_save(tmp_path, backend):
    # zarr makes about twice as many write calls, mostly fsyncs one after the other: every second
    _fault_at_every_write_of_a_sync_save(tmp_path, backend, "kill", every=1 if backend == "safetensors" else 2)


class _WorkerFault:
    """Mixed into a save strategy: runs the background part of its async saves under an Injector
    in the worker process (at call ``at``, a kill or a raise; ``count_file``: list the calls)."""

    def __init__(self, at: Any, kill: bool, count_file: Any, **strategy_options: Any) -> None:
        super().__init__(**strategy_options)
        self.fault = (at, kill, count_file)

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> AsyncRequest:
        request = super().async_save(sharded_state_dict, checkpoint_dir)
        assert request.async_fn is not None
        args = (*self.fault, request.async_fn, *request.async_fn_args)
        return dataclasses.replace(request, async_fn=run_with_fault, async_fn_args=args)


class _SafetensorsWorkerFault(_WorkerFault, SafetensorsSaveShardedStrategy):
    pass


class _TorchDistWorkerFault(_WorkerFault, TorchDistSaveShardedStrategy):
    pass


#: each backend's strategy with one writer thread: its calls in a fixed order
_WORKER_FAULT = {
    "safetensors": (_SafetensorsWorkerFault, {"options": SafetensorsSaveOptions(thread_count=1)}),
    "torch_dist": (_TorchDistWorkerFault, {"thread_count": 1}),
}


def _worker_fault(backend: str) -> Callable[[Any, bool, Any], _WorkerFault]:
    """A factory ``(at, kill, count_file) -> strategy`` of the faulty save strategy of ``backend``."""
    cls, options = _WORKER_FAULT[backend]
    return lambda at, kill, count_file: cls(at, kill, count_file, **options)


def _async_save(queue: AsyncCallsQueue, target: Path, strategy_: Any) -> None:
    request = dc.save(state(2.0), target, sharded_strategy=strategy_, async_sharded_save=True)
    assert request is not None
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)


@pytest.mark.parametrize("backend", ASYNC_BACKENDS)
def test_raised_io_error_at_every_write_of_an_async_save(tmp_path, queue, backend):
    """Both sides of an async save: the caller (claim, common state, index, commit) and the
    background process (the tensor files)."""
    run = Run(tmp_path, backend)
    counted = tmp_path / "worker_calls"
    worker_fault = _worker_fault(backend)

    def caller_side(target: Path) -> None:
        _async_save(queue, target, worker_fault(None, False, None))

    caller_calls = _points(caller_side, tmp_path / "count")
    _async_save(queue, tmp_path / "count_worker", worker_fault(None, False, str(counted)))
    worker_calls = _worker_points(counted)
    # where the disk takes O_DIRECT writes the caller writes the tensor data (early_writes) and
    # the background process only fsyncs: two calls at least either way
    assert len(caller_calls) > 5 and len(worker_calls) >= 2
    row = f"raise at each write, async save, {backend}"
    for at in caller_calls:
        tally.attempt(row, f"caller write call {at}", raise_at(run, at, caller_side))
    for at in worker_calls:

        def in_worker(target: Path, at: int = at) -> None:
            _async_save(queue, target, worker_fault(at, False, None))

        tally.attempt(row, f"background write call {at}", raise_at(run, None, in_worker))
    tally.assert_clean(row)


@pytest.mark.parametrize("backend", ASYNC_BACKENDS)
def test_kill_at_every_write_of_an_async_save(tmp_path, queue, backend):
    """The caller killed at each of its write calls -- claim, common state, snapshot, the tensor
    files written by the request's background function (here run by the caller itself:
    ``execute_sync``, as a fork cannot start the spawned writer), index, commit -- and the
    background process killed at its first, middle and last write (each kill costs a new
    process: the caller then gets a typed error)."""
    run = Run(tmp_path, backend)
    row = f"kill at each write, async save, {backend}"
    worker_fault = _worker_fault(backend)

    def in_caller(target: Path) -> None:
        request = dc.save(state(2.0), target, sharded_strategy=strategy(backend), async_sharded_save=True)
        assert request is not None
        request.execute_sync()

    for at in _points(in_caller, tmp_path / "count"):
        tally.attempt(row, f"caller killed at write call {at}", kill_at(run, at, in_caller))
    counted = tmp_path / "worker_calls"
    _async_save(queue, tmp_path / "count_worker", worker_fault(None, False, str(counted)))
    calls = len(counted.read_text().splitlines())
    for at in sorted({0, calls // 2, calls - 1}):

        def killed_worker(target: Path, at: int = at) -> None:
            _async_save(queue, target, worker_fault(at, True, None))

        tally.attempt(row, f"background process killed at write call {at}", raise_at(run, None, killed_worker))
    tally.assert_clean(row)
    check_loads(run.previous, 1.0)
