"""Instrumentation of the numbered steps of ``save`` and ``load``: timings, progress, watchdog.

``dist_ckpt.save`` and ``dist_ckpt.load`` are sequences of named collective steps
(`run_collectively()`). A [`StepMonitor`][dist_ckpt.engine.monitor.StepMonitor] runs each of them
instead, adding three things around it, without any change to the backends:

* the seconds of the step, into a [`CheckpointReport`][dist_ckpt.engine.report.CheckpointReport];
* ``progress`` callbacks when the step starts and ends (inside the step, so a callback that
  raises fails the step on every rank instead of leaving the others waiting);
* the step's name for the [`Watchdog`][dist_ckpt.engine.watchdog.Watchdog], whose thread runs while the
  monitor is entered.

[`StepMonitor.finish()`][dist_ckpt.engine.monitor.StepMonitor.finish] then completes the report (collective: one small
gather of every rank's bytes and time; rank 0 lists the checkpoint's files) and logs it.

Example:

```python
monitor = StepMonitor(Operation.SAVE, "ckpt/iter_10", [Step.SAVE_SHARDED, Step.COMMIT], progress=None)
with monitor:
    monitor.run(Step.SAVE_SHARDED, write_files)
    monitor.run(Step.COMMIT, commit)
report = monitor.finish(count_files=True)
```
"""

from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import nullcontext
from types import TracebackType
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple, Type, TypeVar

from dist_ckpt.collectives.distributed import all_gather_json, get_rank, get_world_size, run_collectively
from dist_ckpt.engine.report import (
    CheckpointReport,
    Operation,
    PhaseTiming,
    ProgressCallback,
    ProgressEvent,
    format_rate,
)
from dist_ckpt.engine.steps import Step
from dist_ckpt.engine.watchdog import Watchdog
from dist_ckpt.model.dict_utils import nested_values
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor, is_main_replica
from dist_ckpt.storage.errors import storage_error_in
from dist_ckpt.storage.location import LocationLike, resolve_location
from dist_ckpt.storage.meter import ByteMeter, metering

__all__ = ["StepMonitor", "count_files", "main_replica_bytes", "requested_bytes"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def main_replica_bytes(sharded_state_dict: ShardedStateDict) -> int:
    """Tensor bytes a rank saves: the data of its main-replica ShardedTensors.

    Example:

    ```python
    main_replica_bytes({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))})   # 16
    ```
    """
    return sum(
        sh.data.numel() * sh.data.element_size()
        for sh in nested_values(sharded_state_dict)
        if isinstance(sh, ShardedTensor) and sh.data is not None and is_main_replica(sh.replica_id)
    )


def requested_bytes(sharded_state_dict: ShardedStateDict) -> int:
    """Tensor bytes a rank loads: every ShardedTensor it requests, replicas included (a flattened
    one counts its range).

    Example:

    ```python
    requested_bytes({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))})   # 16
    ```
    """
    total = 0
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensor):
            rng = sh.flattened_range
            numel = rng.stop - rng.start if rng is not None else math.prod(sh.local_shape)
            total += numel * sh.dtype.itemsize
    return total


def count_files(checkpoint_dir: LocationLike) -> Tuple[Optional[int], Optional[int]]:
    """``(files, bytes)`` of the checkpoint at ``checkpoint_dir`` as its storage lists them, or
    ``(None, None)`` if it cannot be listed (a report is no reason to fail a save).

    Example:

    ```python
    files, nbytes = count_files("ckpt/iter_10")
    ```
    """
    try:
        objects = resolve_location(checkpoint_dir).list()
    except Exception as e:  # noqa: BLE001 -- any listing failure only leaves the count unknown
        logger.debug("cannot list %s for the report: %s", checkpoint_dir, e)
        return None, None
    return len(objects), sum(o.size for o in objects)


class StepMonitor:
    """Runs the steps of one save or load on this rank, timing and reporting them.

    Args:
        operation: what the steps do.
        checkpoint_dir: the checkpoint: a path, a URL or a storage.
        phases: the names of the steps that will run, in order (for the progress events'
            ``index`` / ``total``; a step not listed is numbered after them).
        progress: called with a [`ProgressEvent`][dist_ckpt.engine.report.ProgressEvent] when a step starts and
            when it ends.
        watchdog_timeout_s: log a WARNING when a step lasts longer (None: no watchdog).
    """

    def __init__(
        self,
        operation: Operation,
        checkpoint_dir: LocationLike,
        phases: Sequence[Step],
        progress: Optional[ProgressCallback] = None,
        watchdog_timeout_s: Optional[float] = None,
    ) -> None:
        if watchdog_timeout_s is not None:
            Watchdog(watchdog_timeout_s)  # validates the timeout before anything runs
        self.location = resolve_location(checkpoint_dir)
        self.report = CheckpointReport(operation, self.location.url, get_rank(), get_world_size())
        self.phases: List[Step] = list(phases)
        self.progress = progress
        self.watchdog_timeout_s = watchdog_timeout_s
        self._started = time.perf_counter()
        self._watchdog: Optional[Watchdog] = None
        self._counting: Optional[Tuple[threading.Thread, List[Tuple[Optional[int], Optional[int]]]]] = None

    # ----------------------------------------------------------------------- watchdog

    def __enter__(self) -> "StepMonitor":
        if self.watchdog_timeout_s is not None:
            what = f"the {self.report.operation.value} of {self.report.checkpoint_dir}"
            self._watchdog = Watchdog(self.watchdog_timeout_s, what).__enter__()
        return self

    def __exit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        if self._watchdog is not None:
            self._watchdog.__exit__(exc_type, exc, tb)
            self._watchdog = None

    # ----------------------------------------------------------------------- steps

    def elapsed(self) -> float:
        """Seconds since the operation started."""
        return time.perf_counter() - self._started

    def notify(
        self, phase: Step, done: bool, item: Optional[str] = None, bytes_done: int = 0, bytes_total: int = 0
    ) -> None:
        """Send a progress event for ``phase`` (nothing without a callback)."""
        if self.progress is None:
            return
        index = self.phases.index(phase) + 1 if phase in self.phases else len(self.phases) + 1
        total = max(len(self.phases), index)
        self.progress(
            ProgressEvent(
                self.report.operation,
                self.report.checkpoint_dir,
                phase.value,
                index,
                total,
                done,
                self.elapsed(),
                item,
                bytes_done,
                bytes_total,
            )
        )

    def heartbeat(self) -> None:
        """The current step made progress: restart its watchdog clock (see
        [`Watchdog.touch()`][dist_ckpt.engine.watchdog.Watchdog.touch])."""
        if self._watchdog is not None:
            self._watchdog.touch()

    def run(self, phase: Step, fn: Callable[[], T], *, exchanges_errors: bool = False, bytes_total: int = 0) -> T:
        """Run ``fn`` as the collective step ``phase`` (see
        `run_collectively()`), timed and reported.

        In a save, a write that fails (a full disk) raises a
        [`StorageError`][dist_ckpt.storage.errors.StorageError] that names this rank, the file and the
        bytes wanted, whatever the code that wrote (a backend, DCP, ``torch.save``) turned the
        ``OSError`` into (`storage_error_in()`).

        Args:
            phase: the step.
            fn: what it does.
            exchanges_errors: ``fn`` raises only errors it raised on every rank (it exchanges
                them itself, e.g. ``dist_ckpt.engine.checks.save_checks.validate_save``), so the
                step adds no exchange after it succeeds. Honoured only without a
                ``progress`` callback: a callback may fail on one rank, and the step's own
                exchange is what carries that error to the others.
            bytes_total: the step writes or reads this many bytes of tensor data on this rank:
                with a ``progress`` callback, its events carry the bytes done so far, from 0 at
                the start to ``bytes_total`` at the end, and more events come in between as the
                bytes move (counted by `dist_ckpt.storage.meter`, throttled; they may come from
                the step's I/O threads, one at a time).
        """
        metered = bytes_total > 0 and self.progress is not None

        def report_bytes(done: int) -> None:
            self.notify(phase, done=False, bytes_done=done, bytes_total=bytes_total)

        def body() -> T:
            self.notify(phase, done=False, bytes_total=bytes_total if metered else 0)
            try:
                with metering(ByteMeter(bytes_total, report_bytes)) if metered else nullcontext():
                    result = fn()
            except Exception as e:  # noqa: BLE001 -- a failed write becomes a StorageError, others pass
                if self.report.operation is not Operation.SAVE:
                    raise
                failed = storage_error_in(e)
                if failed is None:
                    raise
                located = failed.at_rank(self.report.rank)
                if located is e:
                    raise
                raise located from e
            self.notify(
                phase, done=True, bytes_done=bytes_total if metered else 0, bytes_total=bytes_total if metered else 0
            )
            return result

        start = time.perf_counter()
        guard: ContextManager[Any] = self._watchdog.step(phase.value) if self._watchdog is not None else nullcontext()
        try:
            with guard:
                own = exchanges_errors and self.progress is None
                return run_collectively(phase.value, body, exchanges_own_errors=own)
        finally:
            self.report.phases.append(PhaseTiming(phase.value, time.perf_counter() - start))

    def add_phase(self, phase: Step, seconds: float) -> None:
        """Record a phase that ran outside [`run()`][..run] (e.g. an async save's background write)."""
        self.report.phases.append(PhaseTiming(phase.value, seconds))

    def count_files_meanwhile(self) -> None:
        """On rank 0, start listing the checkpoint's files for the report now, in a thread, rather
        than in `finish()` after the steps: for a load, whose checkpoint does not change while it
        is read. A zarr checkpoint of 585 tensors at 4 ranks has about 2,400 files; listing them
        took 75 ms of a 1.3 s load on the test VM, while the other ranks waited."""
        if self.report.rank != 0 or self._counting is not None:
            return
        counted: List[Tuple[Optional[int], Optional[int]]] = []
        thread = threading.Thread(
            target=lambda: counted.append(count_files(self.location)), name="dist_ckpt_count_files", daemon=True
        )
        thread.start()
        self._counting = (thread, counted)

    # ----------------------------------------------------------------------- the end

    def _count_files(self) -> Tuple[Optional[int], Optional[int]]:
        """The checkpoint's files: as listed since `count_files_meanwhile()`, or now."""
        if self._counting is None:
            return count_files(self.location)
        thread, counted = self._counting
        thread.join()
        return counted[0] if counted else (None, None)

    def finish(self, nbytes: int, count_checkpoint_files: bool = True) -> CheckpointReport:
        """Complete the report and log it (collective: every rank calls it once its steps ended).

        Args:
            nbytes: tensor bytes this rank wrote or read.
            count_checkpoint_files: have rank 0 list the checkpoint's files.
        """
        report = self.report
        report.nbytes = int(nbytes)
        report.seconds = self.elapsed()
        files: Tuple[Optional[int], Optional[int]] = (None, None)
        if count_checkpoint_files and report.rank == 0:
            files = self._count_files()
        gathered = all_gather_json([report.nbytes, report.seconds, files[0], files[1]])
        report.total_nbytes = sum(int(g[0]) for g in gathered)
        report.max_seconds = max(float(g[1]) for g in gathered)
        report.files, report.file_bytes = gathered[0][2], gathered[0][3]
        report.complete = True
        if report.rank == 0:
            logger.info("%s", report.summary())
        logger.debug(
            "rank %d: %d bytes in %.3f s (%s)",
            report.rank,
            report.nbytes,
            report.seconds,
            format_rate(report.nbytes, report.seconds),
        )
        return report
