"""Save and load throughput of dist_ckpt next to the raw disk bandwidth measured in the same run.

The state is the demo's (:mod:`dist_ckpt.demo`): a GPT-like model in bf16 plus distributed-
optimizer Adam moments in fp32, scaled to ``--size-gb`` GiB. It is saved from N spawned ranks
(TP=N), loaded back on them resharded (TP=N/2 x DP=2), then loaded whole by one process, and every
value is verified. Before and after the checkpoint, a file of the same size is written with large
sequential writes + fsync and read back cold: the better of the two runs is the bandwidth the
storage can give, and the ratios say how much of it dist_ckpt gets. Every timed load starts from
a cold page cache (``posix_fadvise(DONTNEED)`` on every file after fsync).

No timing is asserted; the script exits 1 only if a loaded value differs from what was saved.

Usage::

    python benchmarks/bench_save_load.py --size-gb 1 --ranks 2 --dir /path/on/the/disk/to/test
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from dist_ckpt.demo import DemoOptions, DemoResult, run_demo
from dist_ckpt.testing.gpt_state import DemoConfig, state_bytes
from dist_ckpt.serialization import DEFAULT_SHARDED_BACKEND

BLOCK_BYTES = 64 * 2**20  # large sequential I/O, like a well-behaved checkpoint writer


def measure_disk(directory: Path, nbytes: int, block: int = BLOCK_BYTES) -> Tuple[float, float]:
    """Seconds to write ``nbytes`` sequentially + fsync, and to read them back from a cold cache."""
    path = directory / f"bench_raw_{os.getpid()}.bin"
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
    return nbytes / 2**30 / seconds


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i in (0, 4) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        .rstrip()
        for r in rows
    )


def report(result: DemoResult, nbytes: int, write_s: float, read_s: float) -> str:
    """The results table: disk first, then each dist_ckpt step with its ratio to the disk."""
    disk_w, disk_r = _gib_s(nbytes, write_s), _gib_s(nbytes, read_s)
    rows: List[List[str]] = [
        ["operation", "seconds", "GiB/s", "ratio", "ratio to"],
        ["disk write, sequential + fsync (best of 2)", f"{write_s:.3f}", f"{disk_w:.3f}", "1.00",
         "disk write"],
        ["disk read, sequential, cold cache (best of 2)", f"{read_s:.3f}", f"{disk_r:.3f}", "1.00",
         "disk read"],
    ]
    for ph in result.phases:
        base, name = (disk_w, "disk write") if ph.name == "save" else (disk_r, "disk read")
        label = f"{ph.name} {ph.layout}" + (f", {ph.ranks} ranks" if ph.ranks > 1 else "")
        if ph.name == "load":
            label += ", cold cache"
        rows.append([label, f"{ph.seconds:.3f}", f"{ph.gib_per_s:.3f}", f"{ph.gib_per_s / base:.2f}", name])
    cfg = result.config
    header = (
        f"dist_ckpt save/load benchmark: {result.state_bytes / 2**30:.2f} GiB state (hidden {cfg.hidden}, "
        f"{cfg.layers} layers, vocab {cfg.vocab}), {result.ranks} ranks, backend "
        f"{result.backend[0]}:{result.backend[1]}\n"
        f"checkpoint: {result.num_tensors} tensors, {result.num_shards} saved shards, "
        f"{result.num_files} files, "
        f"{result.disk_bytes / 2**30:.2f} GiB on disk, under {result.checkpoint_dir.parent}"
    )
    return header + "\n\n" + _table(rows)


def _backend(text: str) -> Tuple[str, int]:
    name, _, version = text.partition(":")
    try:
        return name, int(version or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME or NAME:VERSION, got {text!r}") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0,
                        help="state size in GiB (default: %(default)s)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks that save; even (default: %(default)s)")
    default_backend = f"{DEFAULT_SHARDED_BACKEND[0]}:{DEFAULT_SHARDED_BACKEND[1]}"
    parser.add_argument("--backend", type=_backend, default=default_backend,
                        help="sharded backend NAME[:VERSION] (default: %(default)s)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="directory on the storage to measure (default: %(default)s)")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)

    options = DemoOptions(size_mib=args.size_gb * 1024, ranks=args.ranks, backend=args.backend,
                          directory=args.dir, evict_page_cache=True)
    # the disk is measured with the exact byte count of the state the demo will build
    nbytes = state_bytes(DemoConfig.for_size(int(options.size_mib * 2**20), options.ranks, options.layers))
    before = measure_disk(args.dir, nbytes)
    result = run_demo(options)
    after = measure_disk(args.dir, nbytes)
    # shared and virtual disks vary from one minute to the next: measure around the checkpoint
    # and compare with the better of the two, i.e. what the storage demonstrably delivered
    write_s, read_s = min(before[0], after[0]), min(before[1], after[1])
    print(report(result, nbytes, write_s, read_s))
    print(f"\nraw disk, before / after the checkpoint: write {_gib_s(nbytes, before[0]):.3f} / "
          f"{_gib_s(nbytes, after[0]):.3f} GiB/s, read {_gib_s(nbytes, before[1]):.3f} / "
          f"{_gib_s(nbytes, after[1]):.3f} GiB/s")
    if not result.ok:
        print(f"error: verification failed: {result.mismatches[0]}", file=sys.stderr)
        return 1
    print("\nevery loaded value verified bit-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
