"""The asynchronous saves a [`Checkpointer`][dist_ckpt.training.checkpointer.Checkpointer] has scheduled.

``Checkpointer.save(..., async_save=True)`` runs a save up to its snapshot (``dist_ckpt.save``
with ``async_sharded_save=True``) and hands the request to `PendingSaves`, which schedules
it on its [`AsyncCallsQueue`][dist_ckpt.asynchronous.queue.AsyncCallsQueue] -- one writer process per rank,
started at the first save and reused -- and remembers the checkpoint's directory. The semantics
are the queue's, nothing is re-implemented here:

* a save is committed (its ``metadata.json`` written) only when it is finalized, collectively,
  after every rank's writer finished it; until then ``find_latest_checkpoint`` skips it and
  rotation (``maybe_delete_oldest_checkpoint``) does not count it as complete;
* saves are finalized in the order they were scheduled;
* a writer's failure on any rank raises [`AsyncSaveError`][dist_ckpt.errors.AsyncSaveError] on every rank
  at finalization, naming the rank and the cause, and that save is never committed.

What this module adds is the bookkeeping the queue does not do: which directories were committed
by a finalization (so that the caller can rotate, record metrics or print), and the refusal of a
second save into a directory whose save is still in flight (its preparation would delete the
files the first save's writer is writing).

Example:

```python
pending = PendingSaves()
pending.schedule(dc.save(sd, "ckpt/iter_10", async_sharded_save=True), "ckpt/iter_10")
...
for path in pending.maybe_finalize(blocking=False):   # every rank, every step
    print("committed", path)
pending.close()
```
"""

from __future__ import annotations

import logging
import os
from typing import List, Optional

from dist_ckpt.asynchronous.queue import AsyncCallsQueue, AsyncRequest
from dist_ckpt.asynchronous.worker import DEFAULT_WRITER_TIMEOUT_S
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import CheckpointExistsError
from dist_ckpt.storage import Storage
from dist_ckpt.storage.location import LocationLike

__all__ = ["PendingSaves"]

logger = logging.getLogger(__name__)


def _name(location: LocationLike) -> str:
    """How a checkpoint location is named back to the caller: as it was given."""
    return location.url if isinstance(location, Storage) else os.fspath(location)


def _place(name: str) -> str:
    """A comparable form of a location: the real path of a local one, the URL of a remote one."""
    return name.rstrip("/") if "://" in name else os.path.realpath(name)


class PendingSaves:
    """An asynchronous-save queue and the directories of the saves scheduled on it, in order.

    Every method that finalizes is collective: all ranks call it, equally often (the queue's
    rule). The queue starts its writer processes at the first `schedule()`.

    Args:
        writer_timeout_s: the queue's bound on a writer that does not start or stops making
            progress (see [`AsyncCallsQueue`][dist_ckpt.asynchronous.queue.AsyncCallsQueue]).
    """

    def __init__(self, writer_timeout_s: float = DEFAULT_WRITER_TIMEOUT_S) -> None:
        self._writer_timeout_s = writer_timeout_s
        self._queue: Optional[AsyncCallsQueue] = None
        self._names: List[str] = []

    @property
    def directories(self) -> List[str]:
        """The checkpoints scheduled and not finalized yet, oldest first, named as given."""
        return list(self._names)

    def check_free(self, location: LocationLike) -> None:
        """Refuse a save into ``location`` while an earlier save into it is not finalized.

        Raises:
            CheckpointExistsError: naming the directory and what to do.
        """
        place = _place(_name(location))
        if any(_place(n) == place for n in self._names):
            raise CheckpointExistsError(
                f"[rank {get_rank()}] an asynchronous save into {_name(location)!r} is not finalized yet: finalize "
                f"it (maybe_finalize_async_saves(blocking=True)) before saving into that directory again"
            )

    def schedule(self, request: AsyncRequest, location: LocationLike) -> None:
        """Start ``request``'s background work; its finalization will commit ``location``."""
        if self._queue is None:
            self._queue = AsyncCallsQueue(writer_timeout_s=self._writer_timeout_s)
        self._queue.schedule_async_request(request)
        self._names.append(_name(location))

    def maybe_finalize(self, blocking: bool = False) -> List[str]:
        """Finalize (collectively) the saves that every rank's writer finished, oldest first;
        with ``blocking``, wait for all of them. Returns the directories committed, the same on
        every rank.

        Raises:
            AsyncSaveError: a save failed on some rank (raised on every rank, naming it); it is
                not committed, and neither is a later one until the next call. The saves this
                call committed before the failure stay committed.
        """
        if self._queue is None:
            return []
        queue = self._queue
        try:
            queue.maybe_finalize_async_calls(blocking=blocking)
        finally:
            # finalized (or failed) calls leave the queue in order: the rest are the newest names
            finished = len(self._names) - queue.get_num_unfinalized_calls()
            committed, self._names = self._names[:finished], self._names[finished:]
        for name in committed:
            logger.debug("asynchronous save committed: %s", name)
        return committed

    def close(self, abort: bool = False) -> List[str]:
        """Finalize every pending save (collective, waiting for the writers) and stop the
        writer processes; returns the directories committed. With ``abort``, nothing is
        finalized: the writers are killed and the pending saves are never committed. A later
        `schedule()` starts new writers.
        """
        if self._queue is None:
            return []
        committed: List[str] = []
        aborted = abort
        try:
            if not abort:
                committed = self.maybe_finalize(blocking=True)
        except BaseException:
            aborted = True
            raise
        finally:
            queue, self._queue = self._queue, None
            queue.close(abort=aborted)
            self._names = []
        return committed
