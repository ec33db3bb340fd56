"""The fault-injection suite's scoreboard: one row per kind of fault, one column per outcome.

Every attempt (one injected fault, then the checks that follow it) ends in exactly one outcome:

* ``clean``: a typed error (the CheckpointingException family, or the injected OSError itself
  passing through a single-process save unchanged) or a correct result;
* ``silent wrong``: a load returned values that differ from what was saved, without an error;
* ``hang``: the attempt did not finish within its deadline;
* ``raw exception``: any other exception (RecursionError, KeyError, a library's RuntimeError...);
* ``data lost``: a checkpoint that was committed before (or by a concurrent save) was damaged.

Tests call :func:`attempt` for each fault and :func:`assert_clean` for their row; the suite's
conftest prints :func:`table` at the end of the run.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional

from dist_ckpt.errors import CheckpointingException
from tests.deadlines import scaled

COLUMNS = ("attempts", "clean", "silent wrong", "hang", "raw exception", "data lost")
CLEAN, SILENT, HANG, RAW, LOST = COLUMNS[1:]


class Hang(Exception):
    """Raised in the main thread when an attempt overruns its deadline."""


class SilentWrong(AssertionError):
    """A load returned wrong values without raising."""


class DataLost(AssertionError):
    """A committed checkpoint was damaged."""


@dataclass
class Row:
    counts: Dict[str, int] = field(default_factory=lambda: dict.fromkeys(COLUMNS, 0))
    failures: List[str] = field(default_factory=list)


ROWS: Dict[str, Row] = {}


def record(row: str, outcome: str, what: str = "") -> None:
    """Count one attempt of ``row`` ending in ``outcome`` (``what`` describes a non-clean one)."""
    entry = ROWS.setdefault(row, Row())
    entry.counts["attempts"] += 1
    entry.counts[outcome] += 1
    if outcome != CLEAN:
        entry.failures.append(f"{outcome}: {what}")


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`Hang` in the main thread after ``seconds`` (no-op off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise Hang(f"no result after {seconds}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def is_typed(error: BaseException, injected: Optional[type] = None) -> bool:
    """Our error family, or the injected fault (or an error caused by it) passing through."""
    if isinstance(error, CheckpointingException):
        return True
    seen: Optional[BaseException] = error
    while injected is not None and seen is not None:
        if isinstance(seen, injected):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def attempt(row: str, what: str, run: Callable[[], None], seconds: float = 120.0) -> str:
    """Run one attempt and record its outcome: ``run`` raises :class:`SilentWrong` /
    :class:`DataLost` for those outcomes, anything else for a raw exception; returns the outcome."""
    try:
        with deadline(scaled(seconds)):
            run()
        outcome, detail = CLEAN, ""
    except Hang as e:
        outcome, detail = HANG, str(e)
    except SilentWrong as e:
        outcome, detail = SILENT, str(e)
    except DataLost as e:
        outcome, detail = LOST, str(e)
    except Exception as e:  # noqa: BLE001 -- the point of the suite
        outcome, detail = RAW, f"{type(e).__name__}: {e}"
    record(row, outcome, f"{what}: {detail}"[:600])
    return outcome


def assert_clean(row: str) -> None:
    """Fail unless every attempt of ``row`` was clean (listing the first failures)."""
    entry = ROWS.get(row)
    assert entry is not None and entry.counts["attempts"] > 0, f"row {row!r} made no attempt"
    assert entry.counts["clean"] == entry.counts["attempts"], f"{row}:\n" + "\n".join(entry.failures[:10])


def table() -> str:
    """The scoreboard as a plain-text (and Markdown) table."""
    width = max([len("fault")] + [len(r) for r in ROWS])
    head = "| " + "fault".ljust(width) + " | " + " | ".join(COLUMNS) + " |"
    rule = "|" + "-" * (width + 2) + "|" + "|".join("-" * (len(c) + 2) for c in COLUMNS) + "|"
    lines = [head, rule]
    for name, entry in ROWS.items():
        cells = [str(entry.counts[c]).rjust(len(c)) for c in COLUMNS]
        lines.append("| " + name.ljust(width) + " | " + " | ".join(cells) + " |")
    return "\n".join(lines)
