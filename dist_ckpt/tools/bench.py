"""Measure a storage: dist_ckpt's save and load throughput next to the raw disk, in one run.

What ``dist-ckpt bench`` and ``benchmarks/bench_save_load.py`` run. The state is the demo's
(`dist_ckpt.tools.demo`): a GPT-like model in bf16 plus distributed-optimizer Adam moments in
fp32, scaled to the requested size. It is saved from N spawned ranks (TP=N), loaded back on them
resharded (TP=N/2 x DP=2), then loaded whole by one process, and every value is verified. Before
and after, [`measure_disk()`][dist_ckpt.tools.bench.measure_disk] writes a file of the same size with large sequential
writes + fsync and reads it back cold: the better of the two runs is what the storage can give, and the
ratios say how much of it dist_ckpt gets. Every timed load starts from a cold page cache
(``posix_fadvise(DONTNEED)`` on every file after fsync).

Nothing is asserted about time; [`BenchResult.ok`][dist_ckpt.tools.bench.BenchResult.ok] is False only if a loaded value
differs from what was saved. Throughputs are in GiB/s (2**30 bytes per second), like the demo's.

Example:

```python
result = run_bench(BenchOptions(directory=Path("/mnt/nvme/scratch"), size_mib=1024, ranks=2))
print(render_table(result))
result.rows()[2].ratio     # the save's fraction of the disk's write bandwidth
```
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from dist_ckpt.backends.registry import DEFAULT_SHARDED_BACKEND
from dist_ckpt.tools.demo import DemoOptions, DemoResult, run_demo
from dist_ckpt.tools.gpt_state import DemoConfig, state_bytes

__all__ = ["BLOCK_BYTES", "BenchOptions", "BenchResult", "BenchRow", "measure_disk", "render_table", "run_bench"]

#: large sequential I/O, like a well-behaved checkpoint writer
BLOCK_BYTES = 64 * 2**20


def measure_disk(directory: Path, nbytes: int, block: int = BLOCK_BYTES) -> Tuple[float, float]:
    """Seconds to write ``nbytes`` sequentially + fsync into a new file under ``directory``, and
    to read them back from a cold page cache. The file is deleted afterwards.

    Example:

    ```python
    write_s, read_s = measure_disk(Path("/tmp"), 2**30)
    ```
    """
    path = Path(directory) / f"bench_raw_{os.getpid()}.bin"
    data = memoryview(os.urandom(block))  # incompressible, in case the file system compresses
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            start = time.perf_counter()
            remaining = nbytes
            while remaining > 0:
                remaining -= os.write(fd, data[: min(block, remaining)])
            os.fsync(fd)
            write_s = time.perf_counter() - start
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        buf = bytearray(block)
        fd = os.open(path, os.O_RDONLY)
        try:
            start = time.perf_counter()
            while os.readv(fd, [buf]) > 0:
                pass
            read_s = time.perf_counter() - start
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return write_s, read_s


def _gib_s(nbytes: int, seconds: float) -> float:
    return nbytes / 2**30 / seconds if seconds > 0 else float("inf")


@dataclass(frozen=True)
class BenchOptions:
    """What [`run_bench()`][dist_ckpt.tools.bench.run_bench] measures.

    Attributes:
        directory: where the checkpoint and the raw test file are written (on the storage to
            measure); both are deleted afterwards.
        size_mib: size of the state in MiB.
        ranks: ranks that save (even, >= 2).
        backend: sharded backend ``(name, version)``.
        engine: the library for the ``zarr`` backend, ``"zarr-python"`` or ``"tensorstore"``.
    """

    directory: Path = field(default_factory=lambda: Path(tempfile.gettempdir()))
    size_mib: float = 1024.0
    ranks: int = 2
    backend: Tuple[str, int] = DEFAULT_SHARDED_BACKEND
    engine: str = "zarr-python"

    def demo_options(self) -> DemoOptions:
        """The demo run the benchmark times (page cache evicted before each load)."""
        return DemoOptions(
            size_mib=self.size_mib,
            ranks=self.ranks,
            backend=self.backend,
            directory=self.directory,
            evict_page_cache=True,
            engine=self.engine,
        )


@dataclass(frozen=True)
class BenchRow:
    """One line of the results: an operation, its throughput, and its ratio to the disk.

    Attributes:
        operation: what was timed, e.g. ``"save TP=2 DP=1, 2 ranks"``.
        seconds: its time.
        gib_per_s: state bytes over that time.
        ratio: ``gib_per_s`` over the reference's.
        reference: ``"disk write"`` or ``"disk read"``.
    """

    operation: str
    seconds: float
    gib_per_s: float
    ratio: float
    reference: str


@dataclass(frozen=True)
class BenchResult:
    """Everything [`run_bench()`][dist_ckpt.tools.bench.run_bench] measured.

    Attributes:
        demo: the save and loads, timed and verified.
        nbytes: bytes of the state (and of the raw test file).
        disk_before: ``(write_s, read_s)`` of the raw disk before the checkpoint.
        disk_after: the same, after it.
    """

    demo: DemoResult
    nbytes: int
    disk_before: Tuple[float, float]
    disk_after: Tuple[float, float]

    @property
    def write_s(self) -> float:
        """The better raw write time: what the storage demonstrably delivered."""
        return min(self.disk_before[0], self.disk_after[0])

    @property
    def read_s(self) -> float:
        """The better raw cold-read time."""
        return min(self.disk_before[1], self.disk_after[1])

    @property
    def ok(self) -> bool:
        """Every loaded value equals what was saved."""
        return self.demo.ok

    def rows(self) -> List[BenchRow]:
        """The disk's two rows, then each dist_ckpt step with its ratio to the disk."""
        disk_w, disk_r = _gib_s(self.nbytes, self.write_s), _gib_s(self.nbytes, self.read_s)
        rows = [
            BenchRow("disk write, sequential + fsync (best of 2)", self.write_s, disk_w, 1.0, "disk write"),
            BenchRow("disk read, sequential, cold cache (best of 2)", self.read_s, disk_r, 1.0, "disk read"),
        ]
        for ph in self.demo.phases:
            base, name = (disk_w, "disk write") if ph.name == "save" else (disk_r, "disk read")
            label = f"{ph.name} {ph.layout}" + (f", {ph.ranks} ranks" if ph.ranks > 1 else "")
            if ph.name == "load":
                label += ", cold cache"
            rows.append(BenchRow(label, ph.seconds, ph.gib_per_s, ph.gib_per_s / base, name))
        return rows

    def to_json(self) -> Dict[str, Any]:
        """A JSON-serializable dict (``dist-ckpt bench --json``)."""
        demo = self.demo
        return {
            "ok": self.ok,
            "backend": f"{demo.backend[0]}:{demo.backend[1]}",
            "engine": demo.engine,
            "ranks": demo.ranks,
            "state_bytes": self.nbytes,
            "tensors": demo.num_tensors,
            "saved_shards": demo.num_shards,
            "files": demo.num_files,
            "disk_bytes": demo.disk_bytes,
            "directory": str(demo.checkpoint_dir.parent),
            "disk": {
                "write_gib_per_s": {
                    "before": _gib_s(self.nbytes, self.disk_before[0]),
                    "after": _gib_s(self.nbytes, self.disk_after[0]),
                },
                "read_gib_per_s": {
                    "before": _gib_s(self.nbytes, self.disk_before[1]),
                    "after": _gib_s(self.nbytes, self.disk_after[1]),
                },
            },
            "rows": [
                {
                    "operation": r.operation,
                    "seconds": r.seconds,
                    "gib_per_s": r.gib_per_s,
                    "ratio": r.ratio,
                    "reference": r.reference,
                }
                for r in self.rows()
            ],
            "mismatches": demo.mismatches,
        }


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i in (0, 4) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    )


def render_table(result: BenchResult) -> str:
    """The results for people: a header, then the table of
    [`BenchResult.rows()`][dist_ckpt.tools.bench.BenchResult.rows], then the raw disk before and after.

    Example:

    ```python
    print(render_table(run_bench(BenchOptions(size_mib=256))))
    ```
    """
    demo, cfg = result.demo, result.demo.config
    rows = [["operation", "seconds", "GiB/s", "ratio", "ratio to"]]
    rows += [
        [r.operation, f"{r.seconds:.3f}", f"{r.gib_per_s:.3f}", f"{r.ratio:.2f}", r.reference] for r in result.rows()
    ]
    header = (
        f"dist_ckpt save/load benchmark: {demo.state_bytes / 2**30:.2f} GiB state (hidden {cfg.hidden}, "
        f"{cfg.layers} layers, vocab {cfg.vocab}), {demo.ranks} ranks, backend {demo.backend[0]}:{demo.backend[1]}"
        f"{' (' + demo.engine + ')' if demo.backend[0] == 'zarr' else ''}\n"
        f"checkpoint: {demo.num_tensors} tensors, {demo.num_shards} saved shards, {demo.num_files} files, "
        f"{demo.disk_bytes / 2**30:.2f} GiB on disk, under {demo.checkpoint_dir.parent}"
    )
    n = result.nbytes
    footer = (
        f"raw disk, before / after the checkpoint: write {_gib_s(n, result.disk_before[0]):.3f} / "
        f"{_gib_s(n, result.disk_after[0]):.3f} GiB/s, read {_gib_s(n, result.disk_before[1]):.3f} / "
        f"{_gib_s(n, result.disk_after[1]):.3f} GiB/s"
    )
    return f"{header}\n\n{_table(rows)}\n\n{footer}"


def run_bench(options: BenchOptions = BenchOptions(), on_phase: Optional[Callable[[str], None]] = None) -> BenchResult:
    """Measure the raw disk, save and load with dist_ckpt, measure the disk again.

    ``on_phase`` is called with the name of each of the three phases as it starts
    (``"measuring the raw disk"``, ``"saving and loading"``, ``"measuring the raw disk again"``).

    Raises:
        ValueError: invalid options (see `dist_ckpt.tools.demo.run_demo()`).
        CheckpointingException: the backend is unknown or a step failed in this process.
        dist_ckpt.tools.launch.RankError: a spawned rank raised.

    Example:

    ```python
    result = run_bench(BenchOptions(directory=Path("/scratch"), size_mib=4096, ranks=4))
    assert result.ok
    ```
    """
    demo_options = options.demo_options()
    Path(options.directory).mkdir(parents=True, exist_ok=True)
    # the disk is measured with the exact byte count of the state the demo will build
    cfg = DemoConfig.for_size(int(demo_options.size_mib * 2**20), demo_options.ranks, demo_options.layers)
    nbytes = state_bytes(cfg)
    notify = on_phase or (lambda phase: None)
    notify("measuring the raw disk")
    before = measure_disk(Path(options.directory), nbytes)
    notify("saving and loading")
    demo = run_demo(demo_options)
    # shared and virtual disks vary from one minute to the next: measure around the checkpoint
    notify("measuring the raw disk again")
    after = measure_disk(Path(options.directory), nbytes)
    return BenchResult(demo, nbytes, before, after)
