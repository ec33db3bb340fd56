"""Asynchronous saves: the request, and the queue that runs requests in the background.

An asynchronous save has three phases:

1. **snapshot**, on the caller, inside ``AsyncSaveShardedStrategy.async_save``: the tensors'
   bytes are copied (device-to-host, or memory to shared memory), so training may change its
   tensors as soon as the call returns;
2. **write**, in a background process, with no collectives: ``async_fn(*async_fn_args,
   **async_fn_kwargs)`` of the returned [`AsyncRequest`][dist_ckpt.asynchronous.queue.AsyncRequest];
3. **finalize**, collective, once the write finished on *every* rank: the ranks first exchange
   how their writes ended -- a failure on any rank raises
   [`AsyncSaveError`][dist_ckpt.errors.AsyncSaveError] on every rank, naming the rank and the cause, and
   nothing is committed -- then run ``finalize_fns`` in order (e.g. gather the index, commit
   ``metadata.json``).

[`AsyncCallsQueue`][dist_ckpt.asynchronous.queue.AsyncCallsQueue] follows Megatron-Core's
``dist_checkpointing.strategies.async_utils``:

```python
queue = AsyncCallsQueue()
for step in range(steps):
    train_step()
    if step % 1000 == 0:
        request = dc.save(sd, f"ckpt/iter_{step}", async_sharded_save=True)
        queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=False)   # every rank, every step
queue.close()                                          # waits for, and finalizes, the rest
```

Every rank must schedule the same requests and call ``maybe_finalize_async_calls`` the same
number of times: at each call the ranks agree, in one all-reduce of four integers, whether the
oldest request finished everywhere, whether it failed anywhere and that it is the same request
everywhere, before any finalization runs.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from dist_ckpt.asynchronous.snapshot import PROCESS_SNAPSHOTS
from dist_ckpt.asynchronous.worker import DEFAULT_WRITER_TIMEOUT_S, AsyncOutcome, AsyncWorker
from dist_ckpt.backends.registry import (
    DEFAULT_COMMON_BACKEND,
    DEFAULT_SHARDED_BACKEND,
    StrategyAction,
    get_default_strategy,
)
from dist_ckpt.collectives.distributed import all_reduce_max, get_rank, raise_if_any_rank_failed
from dist_ckpt.errors import AsyncSaveError, CheckpointingException

__all__ = ["AsyncCallsQueue", "AsyncOutcome", "AsyncRequest"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AsyncRequest:
    """A save split into background work and collective finalization.

    Args:
        async_fn: the background work (None if there is nothing to write). It runs in another
            process (``python -m dist_ckpt.asynchronous.writer``): it must be a function of an
            importable module (not of the script run as ``__main__``), its arguments picklable
            (tensors in shared memory are passed without copying), and it must not call
            collectives.
        async_fn_args: positional arguments of ``async_fn``.
        finalize_fns: called in order, on every rank, after ``async_fn`` finished on every rank.
        async_fn_kwargs: keyword arguments of ``async_fn``.
        is_frozen: a frozen request accepts no more finalize functions.
        outcome: how ``async_fn`` ended (its return value or error), filled in when it has;
            finalize functions created with the request may read it. Shared by the request's
            copies ([`freeze()`][.freeze]).
        abort_fns: called in order, on every rank, with the error when the request fails
            (``async_fn`` on any rank, or a finalize function): e.g. delete the files of the
            uncommitted save. Their own errors are logged, not raised.
        preload_fn: Megatron-Core's staging step, called on the caller when the request is run
            or scheduled: its result replaces ``async_fn_args[1]`` (e.g. the write buckets with
            their tensors copied to the host, from ``FileSystemWriterAsync``).
        call_idx: the request's index in its queue (Megatron-Core's field; informative).

    Example:

    ```python
    request = AsyncRequest(write_files, (root, parts), [commit])
    request.execute_sync()    # or AsyncCallsQueue().schedule_async_request(request)
    ```
    """

    async_fn: Optional[Callable[..., Any]]
    async_fn_args: Tuple[Any, ...]
    finalize_fns: List[Callable[[], Any]] = field(default_factory=list)
    async_fn_kwargs: Dict[str, Any] = field(default_factory=dict)
    is_frozen: bool = False
    outcome: AsyncOutcome = field(default_factory=AsyncOutcome, compare=False, repr=False)
    abort_fns: List[Callable[[BaseException], Any]] = field(default_factory=list)
    preload_fn: Optional[Callable[[], Any]] = None
    call_idx: int = 0

    def call_args(self) -> Tuple[Any, ...]:
        """``async_fn``'s positional arguments, with ``args[1]`` replaced by ``preload_fn()`` if
        there is one (it stages the data, e.g. device-to-host copies).

        Raises:
            AsyncSaveError: a ``preload_fn`` with fewer than two arguments to replace.
        """
        if self.preload_fn is None:
            return self.async_fn_args
        if len(self.async_fn_args) < 2:
            raise AsyncSaveError(
                f"an AsyncRequest with a preload_fn replaces async_fn_args[1], but it has {len(self.async_fn_args)} "
                f"arguments"
            )
        args = list(self.async_fn_args)
        args[1] = self.preload_fn()
        return tuple(args)

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Append a finalization step (only before the request is frozen)."""
        if self.is_frozen:
            raise CheckpointingException("cannot add a finalize function to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def add_abort_fn(self, fn: Callable[[BaseException], Any]) -> None:
        """Append a function run (with the error) when the request fails (before it is frozen)."""
        if self.is_frozen:
            raise CheckpointingException("cannot add an abort function to a frozen AsyncRequest")
        self.abort_fns.append(fn)

    def run_abort_fns(self, error: BaseException) -> None:
        """Run the abort functions after a failure (logging, not raising, their own errors)."""
        for fn in self.abort_fns:
            try:
                fn(error)
            except Exception as e:  # noqa: BLE001 -- the request's own error is what is reported
                logger.warning("an abort function of a failed async save raised: %s", e)

    def execute_sync(self) -> None:
        """Run the whole request in the calling process (collective: the synchronous fallback).

        A failure of ``async_fn`` on any rank raises on every rank before any finalization.
        """
        error: Optional[BaseException] = None
        try:
            result = self.async_fn(*self.call_args(), **self.async_fn_kwargs) if self.async_fn is not None else None
            self.outcome.succeed(result)
        except Exception as e:  # noqa: BLE001 -- exchanged below, so that every rank raises
            self.outcome.fail(e)
            error = e
        try:
            raise_if_any_rank_failed(error, "writing the checkpoint files")
            for fn in self.finalize_fns:
                fn()
        except BaseException as e:
            self.run_abort_fns(e)
            raise

    def freeze(self) -> "AsyncRequest":
        """A frozen copy, ready to be scheduled (sharing this request's outcome)."""
        return replace(self, finalize_fns=list(self.finalize_fns), abort_fns=list(self.abort_fns), is_frozen=True)


def _agree_on_head(idx: int, outcome: AsyncOutcome) -> Tuple[bool, bool, Tuple[int, int]]:
    """Collective, one all-reduce of four integers (at any number of ranks): whether the call at
    the head of every rank's queue (call ``idx`` here) finished on every rank, whether it failed on
    any, and the lowest and highest of the ranks' head calls (equal when every rank is at the
    same call)."""
    failed = outcome.done and outcome.error is not None
    unfinished, failed_anywhere, highest, minus_lowest = all_reduce_max(
        [0 if outcome.done else 1, 1 if failed else 0, idx, -idx]
    )
    return not unfinished, bool(failed_anywhere), (-minus_lowest, highest)


def _check_same_call(idx: int, heads: Tuple[int, int]) -> None:
    """Raise (on every rank: ``heads`` is the same everywhere) if the ranks' head calls differ."""
    lowest, highest = heads
    if lowest != highest:
        raise AsyncSaveError(
            f"[rank {get_rank()}] ranks are finalizing different async calls (from call {lowest} to call "
            f"{highest}; this rank's is call {idx}): every rank must schedule the same requests and call "
            f"maybe_finalize_async_calls equally often"
        )


def _import_default_save_strategies() -> None:
    """Import the default save strategies' modules (what a first save would import, in its
    caller's time); a failure is left for the save itself to report."""
    try:
        get_default_strategy(StrategyAction.SAVE_SHARDED, *DEFAULT_SHARDED_BACKEND)
        get_default_strategy(StrategyAction.SAVE_COMMON, *DEFAULT_COMMON_BACKEND)
    except Exception as e:  # noqa: BLE001 -- only a warm-up
        logger.debug("could not import the default save strategies ahead of the first save: %s", e)


@dataclass
class _ActiveCall:
    idx: int
    request: AsyncRequest
    worker: AsyncWorker


class AsyncCallsQueue:
    """Runs scheduled [`AsyncRequest`][dist_ckpt.asynchronous.queue.AsyncRequest] s in a background process
    and finalizes them in order.

    The background process is a fresh ``python -m dist_ckpt.asynchronous.writer``: it never imports
    the user's main module, so saving works from any script (no ``if __name__ == "__main__":``
    guard needed, ``python -c``, stdin, notebooks). ``async_fn`` must come from an importable
    module.

    Args:
        persistent: keep one writer process for every request (started with the queue, in the
            background, then reused); False starts a fresh process per request and stops it once
            the request is finalized.
        writer_timeout_s: how long a writer may take to start, or go without answering or using
            CPU while it writes, before it is killed: its request then fails, and finalization
            raises [`AsyncSaveError`][dist_ckpt.errors.AsyncSaveError] on every rank naming the rank and
            what the writer was doing (keyword only; may be changed later).
        start_writer: start the persistent writer process now, without waiting for it (it
            imports torch: seconds), so that the first save does not wait for its start-up;
            False starts it at the first request.
        snapshot_bytes: fault in a snapshot buffer of this many bytes now, on a thread of its own
            ([`reserve()`][dist_ckpt.asynchronous.snapshot.SnapshotPool.reserve]), so that the
            first save's snapshot copies at the speed of the later ones' (e.g. the bytes of this
            rank's tensors; 0: none).

    Example:

    ```python
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dc.save(sd, path, async_sharded_save=True))
    finished = queue.maybe_finalize_async_calls(blocking=False)   # call indices finalized
    queue.close()
    ```
    """

    def __init__(
        self,
        persistent: bool = True,
        *,
        writer_timeout_s: float = DEFAULT_WRITER_TIMEOUT_S,
        start_writer: bool = True,
        snapshot_bytes: int = 0,
    ) -> None:
        if not writer_timeout_s > 0:
            raise AsyncSaveError(f"writer_timeout_s must be positive, got {writer_timeout_s!r}")
        if snapshot_bytes < 0:
            raise AsyncSaveError(f"snapshot_bytes must not be negative, got {snapshot_bytes!r}")
        self.persistent = persistent
        self._writer_timeout_s = writer_timeout_s
        self._calls: Deque[_ActiveCall] = deque()
        self._next_idx = 0
        self._worker: Optional[AsyncWorker] = None
        if persistent and start_writer:
            self._get_worker().start()
            # the first save imports its backend's modules (0.2-0.9 s): done now, beside training
            threading.Thread(target=_import_default_save_strategies, name="dist_ckpt-warm-up", daemon=True).start()
        if snapshot_bytes:
            PROCESS_SNAPSHOTS.reserve(snapshot_bytes, background=True)

    @property
    def writer_timeout_s(self) -> float:
        """See the class arguments; setting it applies to the writers already started too."""
        return self._writer_timeout_s

    @writer_timeout_s.setter
    def writer_timeout_s(self, value: float) -> None:
        if not value > 0:
            raise AsyncSaveError(f"writer_timeout_s must be positive, got {value!r}")
        self._writer_timeout_s = value
        for worker in [c.worker for c in self._calls] + ([self._worker] if self._worker is not None else []):
            worker.timeout_s = value

    def _get_worker(self) -> AsyncWorker:
        if not self.persistent:
            return AsyncWorker(get_rank(), self._writer_timeout_s)
        if self._worker is None:
            self._worker = AsyncWorker(get_rank(), self._writer_timeout_s)
        self._worker.rank = get_rank()  # a queue may be made before the process group
        return self._worker

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        """Start the request's background work; return its call index (the same on every rank
        when every rank schedules the same requests).

        Raises:
            AsyncSaveError: the work cannot be sent to the background process.
        """
        idx = self._next_idx
        request = replace(async_request.freeze(), call_idx=idx)
        self._next_idx += 1
        worker = self._get_worker()
        if request.async_fn is None:
            request.outcome.succeed(None)
        else:
            worker.submit(idx, request.async_fn, request.call_args(), request.async_fn_kwargs, request.outcome)
        self._calls.append(_ActiveCall(idx, request, worker))
        logger.debug("scheduled async call %d", idx)
        return idx

    def get_num_unfinalized_calls(self) -> int:
        """Requests scheduled and not finalized yet."""
        return len(self._calls)

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> List[int]:
        """Finalize, oldest first, every request whose background work finished on every rank.

        Collective (unless ``no_dist``): every rank must call it, equally often.

        Args:
            blocking: wait until every scheduled request finished, and finalize them all.
            no_dist: decide from this rank's work only, without a collective (only for
                requests whose finalize functions need no other rank, or a single process).

        Returns:
            The call indices finalized by this call.

        Raises:
            AsyncSaveError: the background work failed on some rank (raised on every rank, naming
                it); the request is dropped and nothing of it is committed. Also when the oldest
                requests of the ranks, finished everywhere, are different calls (a rank scheduled
                or finalized one more than the others): they are dropped, unfinalized.
        """
        finalized: List[int] = []
        while self._calls:
            call = self._calls[0]
            call.worker.poll()
            if blocking:
                call.worker.wait(call.request.outcome)
            outcome = call.request.outcome
            if no_dist:
                done, failed_anywhere, heads = outcome.done, outcome.error is not None, (call.idx, call.idx)
            else:
                done, failed_anywhere, heads = _agree_on_head(call.idx, outcome)
            if not done:
                break
            self._calls.popleft()
            try:
                _check_same_call(call.idx, heads)  # the call is dropped, unfinalized, if not
                self._finalize(call, no_dist, failed_anywhere)
            finally:
                if not self.persistent:
                    call.worker.close()
            finalized.append(call.idx)
        return finalized

    def _finalize(self, call: _ActiveCall, no_dist: bool, failed_anywhere: bool) -> None:
        error = call.request.outcome.error
        try:
            if no_dist:
                if error is not None:
                    raise error
            elif failed_anywhere:  # every rank raises the error of the lowest failing rank
                raise_if_any_rank_failed(error, f"the background save (async call {call.idx})")
            for fn in call.request.finalize_fns:
                fn()
        except BaseException as e:
            call.request.run_abort_fns(e)
            raise
        logger.debug("finalized async call %d", call.idx)

    def close(self, abort: bool = False) -> None:
        """Finalize every scheduled request (collective) and stop the worker process.

        Args:
            abort: do not wait or finalize: kill the worker now (the pending saves are never
                committed).
        """
        try:
            if not abort:
                self.maybe_finalize_async_calls(blocking=True)
        finally:
            workers = {id(c.worker): c.worker for c in self._calls}
            if self._worker is not None:
                workers[id(self._worker)] = self._worker
            for worker in workers.values():
                worker.close(abort=abort)
            self._calls.clear()
            self._worker = None
