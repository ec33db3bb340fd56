"""Megatron-Core's async callers: what runs one request's background work, and says when it finished
on every rank.

An [`AsyncCaller`][dist_ckpt.asynchronous.callers.AsyncCaller] is the piece below Megatron-Core's
``AsyncCallsQueue``: the queue hands it each request (``schedule_async_call``) and asks it, on every
rank and equally often, whether the current one is done everywhere (``is_current_async_call_done``)
before finalizing. The work runs in dist_ckpt's writer process
(``AsyncWorker``: a fresh ``python -m
dist_ckpt.asynchronous.writer``, never a fork of the training process, so ``async_fn`` must be a
function of an importable module and its arguments picklable):

* `TemporalAsyncCaller` -- a writer process per request, stopped once the request is done
  (Megatron-Core forks one per request);
* `PersistentAsyncCaller` -- one writer process for every request, started with the first and
  kept until `close()`; requests run one after another, in order.

Unlike Megatron-Core's, a request whose work failed does not just "finish": the ranks agree on it in
the same all-reduce, and ``is_current_async_call_done`` raises
[`AsyncSaveError`][dist_ckpt.errors.AsyncSaveError] on every rank, naming the rank that failed. A
request's ``preload_fn`` runs on the caller, at scheduling (the snapshot: training may go on
changing its tensors afterwards); the request's ``outcome`` holds how its work ended.

Example:

```python
caller = PersistentAsyncCaller()
caller.schedule_async_call(request.freeze())          # every rank
while not caller.is_current_async_call_done():        # every rank, equally often
    train_step()
for fn in request.finalize_fns:
    fn()
caller.close()
```
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import deque
from typing import Deque, Optional, Tuple

from dist_ckpt.asynchronous.queue import AsyncRequest
from dist_ckpt.asynchronous.worker import DEFAULT_WRITER_TIMEOUT_S, AsyncOutcome, AsyncWorker
from dist_ckpt.collectives.distributed import all_reduce_max, get_rank, raise_if_any_rank_failed
from dist_ckpt.errors import AsyncSaveError

__all__ = ["AsyncCaller", "PersistentAsyncCaller", "TemporalAsyncCaller"]

logger = logging.getLogger(__name__)

_Call = Tuple[int, AsyncOutcome]


class AsyncCaller(ABC):
    """Runs requests' background work and tells, collectively, when the current one is done.

    Call order, on every rank: `schedule_async_call()` for each request, `is_current_async_call_done()`
    until it returns True (then the request's finalize functions), and `close()` at the end. Every
    rank must make the same calls, equally often: the checks are collectives (unless ``no_dist``).
    """

    @abstractmethod
    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Start ``async_req``'s background work (its ``preload_fn`` first, here). Every rank."""

    @abstractmethod
    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """Whether the current request's work finished on every rank (True when there is none).

        Args:
            blocking: wait until it finished here, then agree with the other ranks.
            no_dist: decide from this rank alone, without a collective.

        Raises:
            AsyncSaveError: the work failed on some rank (raised on every rank, naming it).
        """

    def sync_all_async_calls(self, is_alive: int) -> bool:
        """Collective: True when no rank's current work is still running (``is_alive`` is this rank's)."""
        (alive_anywhere,) = all_reduce_max([1 if is_alive else 0])
        return alive_anywhere == 0

    @abstractmethod
    def close(self, abort: bool = False) -> None:
        """Stop the caller's writer processes: after their work (``abort=False``), or now."""

    @staticmethod
    def _settle(outcome: Optional[AsyncOutcome], no_dist: bool) -> bool:
        """Whether ``outcome`` (None: nothing current) is done everywhere; raises on every rank
        when it failed on any (one all-reduce, plus the exchange of the error when one failed)."""
        alive = outcome is not None and not outcome.done
        error = outcome.error if outcome is not None and outcome.done else None
        if no_dist:
            if error is not None:
                raise error
            return not alive
        alive_anywhere, failed_anywhere = all_reduce_max([1 if alive else 0, 1 if error is not None else 0])
        if alive_anywhere:
            return False
        if failed_anywhere:
            raise_if_any_rank_failed(error, "the background part of an async save")
        return True


class TemporalAsyncCaller(AsyncCaller):
    """A writer process per request, stopped once the request is done everywhere.

    Args:
        writer_timeout_s: how long the writer may take to start, or go without answering or using
            CPU, before it is killed and the request fails (see `AsyncWorker`).
    """

    def __init__(self, writer_timeout_s: float = DEFAULT_WRITER_TIMEOUT_S) -> None:
        self.writer_timeout_s = writer_timeout_s
        self._worker: Optional[AsyncWorker] = None
        self._outcome: Optional[AsyncOutcome] = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Start a writer process and send it the request's work (nothing for ``async_fn=None``).

        Raises:
            AsyncSaveError: the previous request is not done yet (this caller runs one at a time),
                or the work cannot be sent to another process.
        """
        if self._outcome is not None:
            raise AsyncSaveError(
                f"[rank {get_rank()}] TemporalAsyncCaller runs one request at a time: the previous one is not done "
                f"(call is_current_async_call_done until it returns True)"
            )
        if async_req.async_fn is None:
            return
        args = async_req.call_args()
        self._worker = AsyncWorker(get_rank(), self.writer_timeout_s)
        self._outcome = async_req.outcome
        try:
            self._worker.submit(async_req.call_idx, async_req.async_fn, args, async_req.async_fn_kwargs, self._outcome)
        except BaseException:
            self.close(abort=True)
            raise

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """See `AsyncCaller`; the writer process is stopped once the request is done everywhere."""
        if self._worker is not None and self._outcome is not None:
            self._worker.poll()
            if blocking:
                self._worker.wait(self._outcome)
        try:
            done = self._settle(self._outcome, no_dist)
        except BaseException:
            self.close(abort=True)
            raise
        if done:
            self.close()
        return done

    def close(self, abort: bool = False) -> None:
        """Stop the writer process: once its work is done (``abort=False``), or killed now."""
        worker, self._worker, self._outcome = self._worker, None, None
        if worker is not None:
            if abort:
                logger.warning("rank %d: the temporal async writer was aborted", get_rank())
            worker.close(abort=abort)

    def __del__(self) -> None:
        try:
            self.close(abort=self._outcome is not None and not self._outcome.done)
        except Exception:  # noqa: BLE001 -- nothing to report to during garbage collection
            pass


class PersistentAsyncCaller(AsyncCaller):
    """One writer process for every request (started with the first), running them in order.

    Args:
        writer_timeout_s: see `TemporalAsyncCaller`.
    """

    def __init__(self, writer_timeout_s: float = DEFAULT_WRITER_TIMEOUT_S) -> None:
        self.writer_timeout_s = writer_timeout_s
        self._worker: Optional[AsyncWorker] = None
        self._pending: Deque[_Call] = deque()
        self._next_idx = 0

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        """Queue the request's work on the writer process (started now if it is not running).

        Raises:
            AsyncSaveError: the work cannot be sent to another process.
        """
        if async_req.async_fn is None:
            return
        args = async_req.call_args()
        if self._worker is None:
            self._worker = AsyncWorker(get_rank(), self.writer_timeout_s)
        idx = self._next_idx
        self._next_idx += 1
        self._worker.submit(idx, async_req.async_fn, args, async_req.async_fn_kwargs, async_req.outcome)
        self._pending.append((idx, async_req.outcome))

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        """See `AsyncCaller`; the current request is the oldest not yet done everywhere."""
        outcome = self._pending[0][1] if self._pending else None
        if self._worker is not None and outcome is not None:
            self._worker.poll()
            if blocking:
                self._worker.wait(outcome)
        try:
            done = self._settle(outcome, no_dist)
        except BaseException:
            if outcome is not None and outcome.done:
                self._pending.popleft()  # it failed (here or elsewhere): over on every rank
            raise
        if done and outcome is not None:
            self._pending.popleft()
        return done

    def close(self, abort: bool = False) -> None:
        """Stop the writer process: after the queued work (``abort=False``), or killed now (the
        queued requests fail)."""
        worker, self._worker = self._worker, None
        self._pending.clear()
        if worker is not None:
            if abort:
                logger.warning("rank %d: the persistent async writer was aborted", get_rank())
            worker.close(abort=abort)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- nothing to report to during garbage collection
            pass
