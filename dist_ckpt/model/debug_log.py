"""Scoped debug logging: nested names and loggers for timing and tracing checkpoint phases.

`logger_stack()` pushes a name (and optionally a logger) for the duration of a block;
`debug_time()` times a block and logs the stacked name with the seconds it took;
`debug_msg()` logs a DEBUG message prefixed by the stacked name. Nested blocks read as
``save.sharded.write took 0.0123s``, so a log of a long save says where the time went without
threading a logger through every call. Megatron-Core's ``dist_checkpointing.utils`` offers the
same three functions; code using them runs unchanged.

The stacks are per thread: a block on a writer thread never pops a name that the main thread
pushed.

Example:

```python
with debug_time("save", logger):
    with debug_time("sharded"):
        write()           # logs "save.sharded took 0.1234s", then "save took 0.2000s"
```
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from typing import Iterator, List, Optional, Tuple

#: the logger used when no block on the stack named one
fallback_logger = logging.getLogger(__name__)


class _Stacks(threading.local):
    def __init__(self) -> None:
        self.names: List[str] = []
        self.loggers: List[logging.Logger] = []


_stacks = _Stacks()


@contextmanager
def logger_stack(
    name: Optional[str] = None, current_logger: Optional[logging.Logger] = None
) -> Iterator[Tuple[str, logging.Logger]]:
    """Push ``name`` and ``current_logger`` (each if given) for the block; yields the dotted
    names of every enclosing block and the innermost logger given (or `fallback_logger`).

    Example:

    ```python
    with logger_stack("load", logger) as (name, log):
        log.info("%s: reading", name)     # "load: reading"
    ```
    """
    stacks = _stacks
    if name:
        stacks.names.append(name)
    if current_logger is not None:
        stacks.loggers.append(current_logger)
    last = stacks.loggers[-1] if stacks.loggers else fallback_logger
    try:
        yield ".".join(stacks.names), last
    finally:
        if name and stacks.names:
            stacks.names.pop()
        if current_logger is not None and stacks.loggers:
            stacks.loggers.pop()


@contextmanager
def debug_time(
    name: str, logger: Optional[logging.Logger] = None, threshold: float = float("-inf"), level: Optional[int] = None
) -> Iterator[None]:
    """Time a block (or, used as a decorator, each call of a function) and log
    ``"<names> took <s>s"``.

    Args:
        name: this block's name, appended to the enclosing blocks' names.
        logger: the logger to use (default: the innermost one on the stack).
        threshold: log only when the block took at least this many seconds.
        level: the logging level; default DEBUG, or WARNING when a threshold is set (a slow
            block is worth a warning, a timing trace is not).

    Example:

    ```python
    @debug_time("exchange", logger)
    def exchange() -> None: ...

    with debug_time("read", threshold=10.0):   # warns only if reading took 10 s or more
        read()
    ```
    """
    with logger_stack(name, logger) as (stacked_name, last):
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            if elapsed >= threshold:
                if level is None:
                    level = logging.DEBUG if threshold == float("-inf") else logging.WARNING
                last.log(level, "%s took %.4fs", stacked_name, elapsed)


def debug_msg(msg: str) -> None:
    """Log ``msg`` at DEBUG on the innermost logger of the stack, after the stacked names.

    Example:

    ```python
    with logger_stack("save"):
        debug_msg("claimed the location")   # DEBUG "save claimed the location"
    ```
    """
    with logger_stack() as (stacked_name, last):
        last.debug("%s %s", stacked_name, msg)


__all__ = ["debug_msg", "debug_time", "fallback_logger", "logger_stack"]
