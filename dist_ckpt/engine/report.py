"""What a save, load or conversion did: reports and progress events.

A [`CheckpointReport`][dist_ckpt.engine.report.CheckpointReport] is the summary of one operation on one rank -- the
seconds of each phase, the tensor bytes this rank wrote or read, and, gathered from every rank at the end, the
total bytes, the time of the slowest rank and the files of the checkpoint -- with the throughput
derived from them. ``dist_ckpt.save_with_report`` and ``dist_ckpt.load_with_report`` return one;
every save and load logs it at INFO (rank 0, the whole job) and DEBUG (each rank).

A [`ProgressEvent`][dist_ckpt.engine.report.ProgressEvent] is what an opt-in progress callback receives: a phase starts
or ends, or (in a conversion) one more tensor is done. Callbacks run on the calling thread, inside the
operation's steps: an exception raised by a callback fails the operation on every rank, like
any other error of that step.

Example:

```python
def progress(event: ProgressEvent) -> None:
    if event.done:
        print(f"{event.phase}: {event.seconds:.2f} s")

result = dc.save_with_report(sd, "ckpt/iter_10", progress=progress)
print(result.report.summary())     # "save of ckpt/iter_10: 1020 MiB in 0.53 s (1.88 GiB/s), ..."
```
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from dist_ckpt.errors import counted

__all__ = [
    "CheckpointReport",
    "Operation",
    "PhaseTiming",
    "ProgressCallback",
    "ProgressEvent",
    "format_bytes",
    "format_rate",
    "gib_per_s",
    "significant",
]


def format_bytes(nbytes: int) -> str:
    """A byte count for people, in the largest binary unit that keeps it >= 1 (the unit of every
    size dist_ckpt prints; throughputs are in GiB/s, [`gib_per_s()`][dist_ckpt.engine.report.gib_per_s]).

    Example:

    ```python
    format_bytes(212)            # "212 B"
    format_bytes(1_070_000_000)  # "1020 MiB"
    format_bytes(3 * 2**30)      # "3 GiB"
    ```
    """
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def gib_per_s(nbytes: float, seconds: float) -> float:
    """Throughput in GiB/s (2**30 bytes per second), the one throughput unit of dist_ckpt's
    reports, logs and commands; 0 for no time."""
    return nbytes / 2**30 / seconds if seconds > 0 else 0.0


def format_rate(nbytes: float, seconds: float) -> str:
    """A throughput for people, in GiB/s ([`gib_per_s()`][dist_ckpt.engine.report.gib_per_s]) written by
    [`significant()`][dist_ckpt.engine.report.significant]: a tiny test save reads "0.0000960 GiB/s", not
    "9.6e-05 GiB/s".

    Example:

    ```python
    format_rate(2 * 2**30, 1.07)     # "1.87 GiB/s"
    format_rate(100_000, 1.0)        # "0.0000931 GiB/s"
    ```
    """
    return f"{significant(gib_per_s(nbytes, seconds))} GiB/s"


def significant(value: float, digits: int = 3) -> str:
    """``value`` with ``digits`` significant digits and never an exponent (a table column of
    throughputs reads "0.00842", "1.88", "123"; ``format(value, ".3g")`` would write "8.42e-03").

    Example:

    ```python
    significant(9.6e-05)    # "0.0000960"
    significant(1234.5)     # "1234"
    ```
    """
    if not (value > 0 and math.isfinite(value)):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(value)))
    return f"{value:.{decimals}f}"


class Operation(enum.Enum):
    """What a report or progress event is about."""

    SAVE = "save"
    LOAD = "load"
    CONVERT = "convert"
    VERIFY = "verify"


@dataclass(frozen=True)
class ProgressEvent:
    """One step of progress of a save, load, conversion or verification.

    Attributes:
        operation: save, load or convert.
        checkpoint_dir: the checkpoint (for a conversion, the destination).
        phase: name of the phase, e.g. ``"saving sharded tensors"``.
        index: number of the phase, from 1.
        total: number of phases of the operation.
        done: False when the phase starts, True when it ended (successfully).
        seconds: seconds since the operation started.
        item: in a phase that goes item by item (a conversion's tensors), the item just done.
        bytes_done: bytes done so far in this phase (0 where the phase does not count bytes).
        bytes_total: bytes the phase will do in all (0 if it does not count bytes).
    """

    operation: Operation
    checkpoint_dir: str
    phase: str
    index: int
    total: int
    done: bool
    seconds: float
    item: Optional[str] = None
    bytes_done: int = 0
    bytes_total: int = 0


#: an opt-in progress callback (``save(..., progress=fn)``); see :class:`ProgressEvent`
ProgressCallback = Callable[[ProgressEvent], None]


@dataclass(frozen=True)
class PhaseTiming:
    """Seconds one phase took on this rank (its collective error exchange included)."""

    name: str
    seconds: float


@dataclass
class CheckpointReport:
    """The summary of one save, load or conversion, on one rank.

    Filled in as the operation goes; `complete` once it ended. An asynchronous save's
    report is complete only after the request is finalized (its last phases are added then).

    Attributes:
        operation: save, load or convert.
        checkpoint_dir: the checkpoint.
        rank: this rank.
        world_size: ranks that took part.
        phases: seconds of each phase on this rank, in order.
        nbytes: tensor bytes this rank wrote (its main replicas) or read (the shards it
            requested), counted from the ShardedTensors.
        seconds: wall time of the operation on this rank.
        total_nbytes: ``nbytes`` summed over every rank.
        max_seconds: ``seconds`` of the slowest rank.
        files: files of the checkpoint (listed on rank 0 after the commit, or while a load
            reads), or None if they could not be listed.
        file_bytes: their total size, or None.
        complete: False until the operation ended (an async save: until it is finalized).
        host_memory_budget_bytes: the host-memory budget the operation ran under (None: no
            bound; see `dist_ckpt.storage.host_memory`).
        snapshot_nbytes: an async save: bytes this rank copied into its snapshot (None for
            other operations).
        written_before_return_nbytes: an async save: bytes this rank wrote before returning,
            because they did not fit the budget (None for other operations).
        blocked_seconds: an async save: seconds the call blocked the caller on this rank
            (checks, common state, what was written at once, and the snapshot).
    """

    operation: Operation
    checkpoint_dir: str
    rank: int = 0
    world_size: int = 1
    phases: List[PhaseTiming] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0
    total_nbytes: int = 0
    max_seconds: float = 0.0
    files: Optional[int] = None
    file_bytes: Optional[int] = None
    complete: bool = False
    host_memory_budget_bytes: Optional[int] = None
    snapshot_nbytes: Optional[int] = None
    written_before_return_nbytes: Optional[int] = None
    blocked_seconds: Optional[float] = None

    @property
    def gib_per_s(self) -> float:
        """Throughput of the whole job in GiB/s: every rank's bytes over the slowest rank's time."""
        return gib_per_s(self.total_nbytes, self.max_seconds)

    @property
    def rank_gib_per_s(self) -> float:
        """This rank's throughput in GiB/s: its bytes over its time."""
        return gib_per_s(self.nbytes, self.seconds)

    @property
    def gb_per_s(self) -> float:
        """The job's throughput in decimal GB/s (10**9 bytes), kept for code written against
        dist_ckpt 0.1.0; everything dist_ckpt prints uses [`gib_per_s`][..gib_per_s]."""
        return self.total_nbytes / 1e9 / self.max_seconds if self.max_seconds > 0 else 0.0

    def phase_seconds(self, name: str) -> float:
        """Seconds spent in the phase(s) named ``name`` (0 if it did not run); ``name`` is a
        [`Step`][dist_ckpt.engine.steps.Step] (a str) or its value.

        Example:

        ```python
        report.phase_seconds(Step.SAVE_SHARDED)   # == report.phase_seconds("saving sharded tensors")
        ```
        """
        return sum(p.seconds for p in self.phases if p.name == name)

    def summary(self) -> str:
        """One line for people and logs: the whole job's figures, then each phase.

        Example:

        ```text
        "save of ckpt/iter_10: 1020 MiB in 0.53 s (1.88 GiB/s) on 2 ranks; 5 files, 1020 MiB;
         phases: preparing the save 0.01 s, ..."
        ```
        """
        files = "" if self.files is None else f"; {counted(self.files, 'file')}, {format_bytes(self.file_bytes or 0)}"
        ranks = f" on {counted(self.world_size, 'rank')}"
        phases = ", ".join(f"{p.name} {p.seconds:.3f} s" for p in self.phases)
        state = "" if self.complete else " (not complete)"
        return (
            f"{self.operation.value} of {self.checkpoint_dir}{state}: {format_bytes(self.total_nbytes)} in "
            f"{self.max_seconds:.3f} s ({format_rate(self.total_nbytes, self.max_seconds)}){ranks}{files}"
            f"{self._memory_summary()}; phases: {phases}"
        )

    def _memory_summary(self) -> str:
        """The budget and, for an async save, how this rank split its bytes ("" without either)."""
        parts = (
            [] if self.host_memory_budget_bytes is None else [f"budget {format_bytes(self.host_memory_budget_bytes)}"]
        )
        if self.snapshot_nbytes is not None:
            parts.append(
                f"snapshotted {format_bytes(self.snapshot_nbytes)}, written before returning "
                f"{format_bytes(self.written_before_return_nbytes or 0)}, blocked {self.blocked_seconds or 0.0:.3f} s"
            )
        return f"; {', '.join(parts)}" if parts else ""

    def to_json(self) -> Dict[str, Any]:
        """The report as a JSON-serializable dict.

        Example:

        ```python
        json.dumps(report.to_json())
        ```
        """
        return {
            "operation": self.operation.value,
            "checkpoint": self.checkpoint_dir,
            "complete": self.complete,
            "rank": self.rank,
            "world_size": self.world_size,
            "nbytes": self.nbytes,
            "seconds": self.seconds,
            "total_nbytes": self.total_nbytes,
            "max_seconds": self.max_seconds,
            "gib_per_s": self.gib_per_s,
            "files": self.files,
            "file_bytes": self.file_bytes,
            "phases": [{"name": p.name, "seconds": p.seconds} for p in self.phases],
            "host_memory_budget_bytes": self.host_memory_budget_bytes,
            "snapshot_nbytes": self.snapshot_nbytes,
            "written_before_return_nbytes": self.written_before_return_nbytes,
            "blocked_seconds": self.blocked_seconds,
        }
