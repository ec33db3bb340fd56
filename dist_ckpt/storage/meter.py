"""Byte progress of a long save or load: the bytes the I/O primitives move, reported as they move.

A step that writes or reads tensor data ("saving sharded tensors", "loading sharded tensors")
can take minutes. While it runs, the engine's step monitor installs a
[`ByteMeter`][dist_ckpt.storage.meter.ByteMeter] for this process (`metering()`), and the
primitives that every byte of the built-in backends goes through -- `SequentialWriter.write()`
and `preadv_into()` for local files, temporary-file writes, the object-store requests -- call
`count_bytes()` from whichever thread moved them. The meter adds them up and passes the sum to
its callback, one call at a time and throttled: when the bytes grew by a hundredth of the
total, or a fifth of a second passed, since the last call.

The meter lives in the process, not in a storage or a strategy, so that the byte count needs no
new argument through every backend's write and read functions (they get a file descriptor, not
a storage). One meter counts at a time: a metered step inside another (a load that saves?)
counts into the outer one. An async save's background process has no meter: its bytes show as
the finalization's end, not as they are written.

Example:

```python
meter = ByteMeter(total=nbytes, report=lambda done: print(f"{done}/{nbytes}"))
with metering(meter):
    strategy.save(sharded_state_dict, storage)     # its writes call count_bytes()
```
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

__all__ = ["ByteMeter", "count_bytes", "metering"]

#: report when the bytes grew by this share of the total since the last report ...
REPORT_FRACTION = 0.01
#: ... or when this many seconds passed since it (and some bytes moved)
REPORT_INTERVAL_S = 0.2


class ByteMeter:
    """Adds up the bytes an operation moves, from any thread, and reports the sum, throttled.

    Args:
        total: the bytes the operation will move in all (reports never exceed it: headers and
            index files move a few bytes more than the tensors counted in ``total``).
        report: called with the bytes done so far (at most ``total``), one call at a time, on
            the thread that moved the bytes; an exception it raises goes to that thread's I/O
            call, failing the operation like an I/O error.
        fraction: report when the count grew by this share of ``total`` since the last report.
        interval_s: or when this many seconds passed since the last report.
        clock: a monotonic clock (tests pass their own).

    Example:

    ```python
    meter = ByteMeter(100, seen.append)
    meter.add(60)      # seen == [60]
    ```
    """

    def __init__(
        self,
        total: int,
        report: Callable[[int], None],
        *,
        fraction: float = REPORT_FRACTION,
        interval_s: float = REPORT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(0, int(total))
        self._report = report
        self._step = max(1, int(self.total * fraction))
        self._interval_s = interval_s
        self._clock = clock
        # re-entrant: a callback that itself writes through dist_ckpt (a metrics file) counts
        # those bytes on the same thread, inside the report; they are counted, not reported
        self._lock = threading.RLock()
        self._reporting = False
        self._done = 0
        self._reported = 0
        self._reported_at = clock()

    @property
    def done(self) -> int:
        """The bytes counted so far (may exceed `total`)."""
        with self._lock:
            return self._done

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more; report if a hundredth of the total or a fifth of a second
        passed since the last report (any thread)."""
        with self._lock:
            self._done += nbytes
            shown = min(self._done, self.total)
            now = self._clock()
            due = shown - self._reported >= self._step or now - self._reported_at >= self._interval_s
            if shown <= self._reported or not due or self._reporting:
                return
            self._reported, self._reported_at = shown, now
            self._reporting = True
            try:
                self._report(shown)  # under the lock: reports never overlap, and never go backwards
            finally:
                self._reporting = False


_active: Optional[ByteMeter] = None
_install = threading.Lock()


@contextmanager
def metering(meter: ByteMeter) -> Iterator[bool]:
    """Count this process's I/O into ``meter`` while the block runs; yields whether ``meter`` is
    the one counting (False inside another metered block, whose meter keeps counting)."""
    global _active
    with _install:
        mine = _active is None
        if mine:
            _active = meter
    try:
        yield mine
    finally:
        if mine:
            with _install:
                _active = None


def count_bytes(nbytes: int) -> None:
    """Count ``nbytes`` that an I/O primitive just moved into the installed meter, if any (any
    thread; costs one attribute read when nothing is metered)."""
    meter = _active
    if meter is not None and nbytes > 0:
        meter.add(nbytes)
