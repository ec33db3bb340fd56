"""A watchdog that says which rank is stuck in which step of a save or load.

A collective that one rank never reaches, or an I/O call on a hung file system, makes a save
wait forever, silently: every rank sits in some step and nothing says which. The
[`Watchdog`][dist_ckpt.engine.watchdog.Watchdog] runs one daemon thread while a save or load is in progress; the save
enters each of its steps with [`Watchdog.step()`][dist_ckpt.engine.watchdog.Watchdog.step], and when a step has lasted
``timeout_s`` seconds the thread logs a WARNING:

```text
rank 3 has been in step 'saving sharded tensors' > 'writing the safetensors index' of the save of
ckpt/iter_1000 for 600 s
```

and again every further ``timeout_s`` seconds while the step lasts. It only logs: the step keeps
going (a slow disk is not an error), and nothing is killed. The nested step names after ``>``
are the collective steps the strategies are in at that moment
(`dist_ckpt.collectives.distributed.active_steps()`).

The thread starts when the watchdog is entered and is joined when it exits, so no thread is
left behind after a save or load returns.

Example:

```python
with Watchdog(timeout_s=600, what="the save of ckpt/iter_1000") as watchdog:
    with watchdog.step("saving sharded tensors"):
        strategy.save(sharded_state_dict, checkpoint_dir)
```
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from types import TracebackType
from typing import Iterator, Optional, Type

from dist_ckpt.collectives.distributed import active_steps, get_rank
from dist_ckpt.errors import CheckpointingException

__all__ = ["DEFAULT_WATCHDOG_TIMEOUT_S", "Watchdog"]

logger = logging.getLogger(__name__)

#: default timeout of ``save`` / ``load``: generous, so that only a step that is really stuck
#: (a missing rank, a hung file system) is reported, never a large but healthy write
DEFAULT_WATCHDOG_TIMEOUT_S = 600.0


class Watchdog:
    """Logs a WARNING naming the rank and the step when a step exceeds ``timeout_s`` seconds.

    Use it as a context manager around the whole operation, and [`step()`][.step] around each step.
    Only the thread that entered the watchdog may call [`step()`][.step] (the steps of one save run
    on one thread).

    Args:
        timeout_s: seconds a step may take before it is reported (and again every further
            ``timeout_s`` seconds); must be positive.
        what: the operation, for the message (e.g. ``"the save of ckpt/iter_10"``).
        poll_s: how often the thread checks (default: a tenth of the timeout, at most 5 s).

    Example:

    ```python
    with Watchdog(timeout_s=0.5, what="the load of ckpt") as dog:
        with dog.step("loading sharded tensors"):
            time.sleep(1.2)        # logs twice: after 0.5 s and after 1.0 s
    ```
    """

    def __init__(self, timeout_s: float, what: str = "the operation", poll_s: Optional[float] = None) -> None:
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0:
            raise CheckpointingException(
                f"watchdog timeout must be a positive number of seconds (or None to disable it), got {timeout_s!r}"
            )
        self.timeout_s = float(timeout_s)
        self.what = what
        self.poll_s = poll_s if poll_s is not None else min(max(self.timeout_s / 10, 0.001), 5.0)
        self.warnings = 0  #: warnings logged so far
        self._lock = threading.Lock()
        self._step: Optional[str] = None
        self._started = 0.0
        self._reported = 0  # how many timeouts of the current step were reported
        self._owner: Optional[int] = None
        self._rank = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "Watchdog":
        self._owner = threading.get_ident()
        self._rank = get_rank()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="dist_ckpt_watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Mark the body as step ``name`` (the clock of the timeout restarts)."""
        with self._lock:
            previous = (self._step, self._started, self._reported)
            self._step, self._started, self._reported = name, time.monotonic(), 0
        try:
            yield
        finally:
            with self._lock:
                if previous[0] is None:
                    self._step = None
                else:  # a nested step: the outer one resumes with its own clock
                    self._step, self._started, self._reported = previous

    def touch(self) -> None:
        """Restart the clock of the current step: it is making progress (e.g. a conversion
        finished a tensor), so only a step without progress for ``timeout_s`` is reported."""
        with self._lock:
            if self._step is not None:
                self._started, self._reported = time.monotonic(), 0

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                step, started, reported = self._step, self._started, self._reported
                elapsed = time.monotonic() - started
                due = step is not None and elapsed >= self.timeout_s * (reported + 1)
                if due:
                    self._reported = int(elapsed // self.timeout_s)
            if due:
                self._warn(str(step), elapsed)

    def _warn(self, step: str, elapsed: float) -> None:
        inner = [s for s in active_steps(self._owner) if s != step] if self._owner is not None else []
        where = " > ".join(repr(s) for s in [step, *inner])
        self.warnings += 1
        logger.warning(
            "rank %d has been in step %s of %s for %s (watchdog timeout %g s); it may be waiting for "
            "another rank or for the storage",
            self._rank,
            where,
            self.what,
            _seconds(elapsed),
            self.timeout_s,
        )


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.2f} s"
