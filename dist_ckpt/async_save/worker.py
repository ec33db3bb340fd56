"""The background process that runs the writing half of asynchronous saves.

:class:`AsyncWorker` is the training process's handle on one persistent worker process. Calls
(a function, its arguments) are run one after another, in the order submitted; their outcomes
come back on a result queue, which :meth:`AsyncWorker.poll` drains without blocking.

Why a separate process, and why *spawned*:

* writing, checksumming and fsyncing in a thread of the training process would compete with
  training for the GIL; a process does not;
* ``fork`` would copy a process that holds a CUDA context, NCCL/gloo communicators and threads
  (zarr's event loop, OpenMP pools, the read threads): a forked child cannot use CUDA and may
  deadlock on a lock some other thread held at the fork. A spawned process starts clean: it
  imports what it needs and receives only the call, so it works the same under every launcher.

Tensors in the arguments travel through ``torch.multiprocessing``'s pickler: a tensor in shared
memory is passed as a file descriptor, the worker maps the same memory, and no copy of the data
is made (see :mod:`.snapshot`). Each call is pickled *before* it is queued, in the caller, so an
argument that cannot be sent raises there instead of being lost in the queue's feeder thread.

The worker calls no collective and never touches the process group: finalization (collective)
stays in the training processes. It exits when told to, or when its parent process is gone.

Example::

    worker = AsyncWorker()
    outcome = AsyncOutcome()
    worker.submit(0, write_files, (root, parts), {}, outcome)
    ...                                   # training continues
    worker.poll()                         # non-blocking; sets outcome.done / result / error
    worker.wait(outcome)                  # blocking
    worker.close()
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import os
import pickle
import queue as queue_module
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, Optional, Tuple

import torch.multiprocessing as torch_mp  # registers the tensor reductions with ForkingPickler

from dist_ckpt.errors import AsyncSaveError

__all__ = ["AsyncOutcome", "AsyncWorker"]

logger = logging.getLogger(__name__)

#: how often an idle worker checks that its parent is still alive (seconds)
_PARENT_CHECK_S = 1.0


@dataclass
class AsyncOutcome:
    """How the background part of one request ended; filled in by the process that ran it.

    Attributes:
        done: the call finished (successfully or not) or can no longer finish (its process died).
        result: the call's return value, on success.
        error: an :class:`~dist_ckpt.errors.AsyncSaveError` describing the failure, naming the rank.
    """

    done: bool = False
    result: Any = None
    error: Optional[BaseException] = field(default=None, repr=False)

    def succeed(self, result: Any) -> None:
        self.done, self.result, self.error = True, result, None

    def fail(self, error: BaseException) -> None:
        self.done, self.result, self.error = True, None, error


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _worker_main(tasks: Any, results: Any) -> None:
    """The worker's loop: run each call, report ``(idx, ok, result or error description)``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    parent = multiprocessing.parent_process()
    while True:
        try:
            item = tasks.get(timeout=_PARENT_CHECK_S)
        except queue_module.Empty:
            if parent is not None and not parent.is_alive():
                return
            continue
        if item is None:
            return
        idx, payload = item
        try:
            fn, args, kwargs = pickle.loads(payload)
            del payload
            outcome: Tuple[int, bool, Any] = (idx, True, fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 -- every failure goes back to the training process
            outcome = (idx, False, {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()})
        finally:
            fn = args = kwargs = None  # unmap shared memory before waiting for the next call
        try:
            results.put(outcome)
        except Exception:  # noqa: BLE001 -- an unpicklable result: report that instead
            results.put(
                (idx, False, {"type": "TypeError", "message": "the call's result cannot be sent back", "traceback": ""})
            )


class AsyncWorker:
    """Handle on one spawned worker process, started on the first :meth:`submit`.

    Args:
        rank: this process's rank, named in error messages.

    Example::

        worker = AsyncWorker(rank=0)
        worker.submit(0, write_snapshot_parts, args, {}, outcome)
        worker.wait(outcome)
        worker.close()
    """

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self._ctx = torch_mp.get_context("spawn")
        self._process: Optional[Any] = None
        self._tasks: Any = None
        self._results: Any = None
        self._pending: Dict[int, AsyncOutcome] = {}

    @property
    def pid(self) -> Optional[int]:
        """The worker's process id (None before it starts)."""
        return None if self._process is None else self._process.pid

    def _start(self) -> None:
        self._close_queues()  # those of a worker that died
        self._tasks = self._ctx.Queue()
        self._results = self._ctx.Queue()
        self._process = self._ctx.Process(
            target=_worker_main, args=(self._tasks, self._results), name="dist_ckpt_async_writer", daemon=True
        )
        self._process.start()
        logger.debug("started async checkpoint writer process %d", self._process.pid)

    def submit(
        self, idx: int, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any], outcome: AsyncOutcome
    ) -> None:
        """Queue ``fn(*args, **kwargs)``; its result or error will land in ``outcome``.

        Raises:
            AsyncSaveError: the call cannot be sent to another process (e.g. a lambda).
        """
        try:
            payload = _dumps((fn, args, kwargs))
        except Exception as e:  # noqa: BLE001 -- pickling fails in many ways
            raise AsyncSaveError(
                f"[rank {self.rank}] the background part of the save cannot be sent to the writer process: "
                f"{type(e).__name__}: {e} (async_fn and its arguments must be picklable: module-level functions, "
                f"tensors, plain data)"
            ) from e
        if self._process is None or not self._process.is_alive():
            self._start()
        self._pending[idx] = outcome
        self._tasks.put((idx, payload))

    def poll(self) -> None:
        """Collect finished calls (non-blocking); fail the pending ones if the process died."""
        while self._results is not None:
            try:
                idx, ok, value = self._results.get_nowait()
            except queue_module.Empty:
                break
            self._settle(idx, ok, value)
        if self._pending and self._process is not None and not self._process.is_alive():
            self._drain_after_exit()

    def _settle(self, idx: int, ok: bool, value: Any) -> None:
        outcome = self._pending.pop(idx, None)
        if outcome is None:
            return
        if ok:
            outcome.succeed(value)
        else:
            outcome.fail(
                AsyncSaveError(
                    f"[rank {self.rank}] the background save failed: {value['type']}: {value['message']}"
                    + (f"\n{value['traceback'].rstrip()}" if value.get("traceback") else "")
                )
            )

    def _drain_after_exit(self) -> None:
        # results put just before the exit may still be in the pipe
        deadline = time.monotonic() + 1.0
        while self._pending and time.monotonic() < deadline:
            try:
                idx, ok, value = self._results.get(timeout=0.1)
            except queue_module.Empty:
                continue
            self._settle(idx, ok, value)
        assert self._process is not None
        code = self._process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        for idx in sorted(self._pending):
            self._pending.pop(idx).fail(
                AsyncSaveError(
                    f"[rank {self.rank}] the background save process {how} before the save finished "
                    f"(out of memory, or killed); the checkpoint was not committed"
                )
            )
        self._process = None

    def wait(self, outcome: AsyncOutcome, timeout_s: Optional[float] = None) -> bool:
        """Block until ``outcome`` is done (or ``timeout_s`` passed); return whether it is done."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not outcome.done:
            if self._results is None:
                return outcome.done
            try:
                idx, ok, value = self._results.get(timeout=0.05)
                self._settle(idx, ok, value)
            except queue_module.Empty:
                self.poll()
            if deadline is not None and time.monotonic() > deadline:
                break
        return outcome.done

    def close(self, abort: bool = False, timeout_s: float = 60.0) -> None:
        """Stop the worker: after its queued calls (``abort=False``), or now (killed)."""
        process = self._process
        if process is None:
            return
        if not abort and process.is_alive():
            self._tasks.put(None)
            process.join(timeout_s)
        if process.is_alive():
            process.kill()
            process.join()
        self.poll()
        self._process = None
        self._close_queues()

    def _close_queues(self) -> None:
        for q in (self._tasks, self._results):
            if q is not None:
                q.cancel_join_thread()  # nothing left to deliver matters once the worker is gone
                q.close()
        self._tasks = self._results = None
