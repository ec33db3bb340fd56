"""`async_save()`: an asynchronous save in one call, returning a handle to wait on.

Users of ``torch.distributed.checkpoint`` look for ``async_save(state_dict, ...)`` returning a
future; Megatron-Core users schedule an [`AsyncRequest`][dist_ckpt.asynchronous.queue.AsyncRequest]
on their own [`AsyncCallsQueue`][dist_ckpt.asynchronous.queue.AsyncCallsQueue]. This module gives
the first on top of the second: `async_save()` runs a save with ``async_sharded_save=True``,
schedules the request on a queue (the process's default one unless given) and returns an
`AsyncSaveFuture`. Training goes on as soon as it returns; the snapshot is taken by then.

Committing a checkpoint is collective, so `AsyncSaveFuture.result` is too: every rank calls it.
The default queue finalizes what is still pending when the interpreter exits, so a script that
never waits still commits its last checkpoint.
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Callable, Optional

from dist_ckpt.asynchronous.queue import AsyncCallsQueue
from dist_ckpt.backends.registry import StrategySpec
from dist_ckpt.collectives.distributed import run_collectively
from dist_ckpt.engine.report import ProgressCallback
from dist_ckpt.engine.save import save
from dist_ckpt.engine.watchdog import DEFAULT_WATCHDOG_TIMEOUT_S
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.model.sharded import ShardedStateDict, StateDict
from dist_ckpt.storage.location import LocationLike, resolve_location

__all__ = ["AsyncSaveFuture", "async_save", "default_async_queue"]

logger = logging.getLogger(__name__)

_default_queue: Optional[AsyncCallsQueue] = None
_default_queue_lock = threading.Lock()


def default_async_queue() -> AsyncCallsQueue:
    """The process's queue for `async_save()` calls that pass none (made at first use).

    It is closed when the interpreter exits: pending saves are waited for and committed then
    (collective, as at any finalization: every rank must still be alive).
    """
    global _default_queue
    with _default_queue_lock:
        if _default_queue is None:
            _default_queue = AsyncCallsQueue()
            atexit.register(_close_default_queue)
        return _default_queue


def _close_default_queue() -> None:
    global _default_queue
    queue, _default_queue = _default_queue, None
    if queue is None:
        return
    try:
        queue.close()
    except Exception as e:  # noqa: BLE001 -- at exit there is no caller left to raise to
        logger.error("dist_ckpt: an async save still pending at exit failed: %s", e)


class AsyncSaveFuture:
    """The handle `async_save()` returns: wait for the save with `result`.

    Saves are committed in the order they were scheduled on their queue; waiting for one also
    finalizes the ones scheduled before it. The error of an earlier save that failed is
    raised by that save's own `result`, and logged when it happens.

    Args:
        checkpoint_dir: where the save writes (its URL).
        queue: the queue the save was scheduled on.
        call_idx: its call index on that queue.
    """

    def __init__(self, checkpoint_dir: str, queue: AsyncCallsQueue, call_idx: int) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.call_idx = call_idx
        self._queue = queue
        self._settled = threading.Event()
        self._error: Optional[BaseException] = None

    def _committed(self) -> None:
        self._settled.set()

    def _failed(self, error: BaseException) -> None:
        self._error = error
        self._settled.set()

    def done(self) -> bool:
        """True once the save was committed or failed (a `result` call, on this or a later
        future of the same queue, finalized it). Local: no collective."""
        return self._settled.is_set()

    def result(self) -> str:
        """Wait until the save is written on every rank and committed; return its location.

        Collective: every rank calls it (the ranks agree that every write finished, then rank 0
        commits ``metadata.json``).

        Raises:
            AsyncSaveError: the background write failed on some rank (raised on every rank,
                naming it); nothing of this save was committed.
            CheckpointingException: finalizing failed, or the ranks' queues disagree.
        """
        while not self._settled.is_set():
            if self._queue.get_num_unfinalized_calls() == 0:
                raise CheckpointingException(
                    f"async save {self.call_idx} to {self.checkpoint_dir!r} was dropped from its queue without "
                    "being finalized: the ranks did not schedule the same saves"
                )
            try:
                self._queue.maybe_finalize_async_calls(blocking=True)
            except Exception:
                if not self._settled.is_set() and self._queue.get_num_unfinalized_calls() == 0:
                    raise  # this save's own failure, not recorded through its abort function
                # an earlier save failed (its future holds the error): keep waiting for this one
        if self._error is not None:
            raise self._error
        return self.checkpoint_dir

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "committed" if self.done() else "pending"
        return f"AsyncSaveFuture({self.checkpoint_dir!r}, {state})"


def async_save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: LocationLike,
    sharded_strategy: StrategySpec = None,
    common_strategy: StrategySpec = None,
    validate_access_integrity: bool = True,
    preprocess_common_before_consistancy_check: Optional[Callable[[StateDict], StateDict]] = None,
    *,
    queue: Optional[AsyncCallsQueue] = None,
    progress: Optional[ProgressCallback] = None,
    watchdog_timeout_s: Optional[float] = DEFAULT_WATCHDOG_TIMEOUT_S,
    host_memory_budget_bytes: Optional[int] = None,
) -> AsyncSaveFuture:
    """Save in the background (collective); return once the state is snapshotted.

    The arguments are [`save()`][dist_ckpt.engine.save.save]'s; ``queue`` is the
    [`AsyncCallsQueue`][dist_ckpt.asynchronous.queue.AsyncCallsQueue] to run it on (default:
    `default_async_queue()`); ``host_memory_budget_bytes`` bounds the snapshot (what does not
    fit is written before this returns). Everything before the background write -- checks, the common
    state, the snapshot -- happens before this returns, and raises here.

    Example:

    ```python
    future = dc.async_save(sd, "ckpt/iter_1000")
    train_step()                      # the tensors may change now
    future.result()                   # every rank: wait, and commit
    ```
    """
    target_queue = queue if queue is not None else default_async_queue()
    location = run_collectively("opening the checkpoint location", lambda: resolve_location(checkpoint_dir))
    request = save(
        sharded_state_dict,
        location,
        sharded_strategy,
        common_strategy,
        validate_access_integrity,
        True,
        preprocess_common_before_consistancy_check,
        progress=progress,
        watchdog_timeout_s=watchdog_timeout_s,
        host_memory_budget_bytes=host_memory_budget_bytes,
    )
    if request is None:  # pragma: no cover -- save() returns a request whenever asked for one
        raise CheckpointingException(f"save to {location.url!r} returned no asynchronous request")
    future = AsyncSaveFuture(location.url, target_queue, -1)
    request.add_finalize_fn(future._committed)
    request.add_abort_fn(future._failed)
    request.add_abort_fn(lambda e: logger.error("async save to %r failed: %s", future.checkpoint_dir, e))
    future.call_idx = target_queue.schedule_async_request(request)
    return future
