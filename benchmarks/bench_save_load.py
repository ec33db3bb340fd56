"""Save and load throughput of dist_ckpt next to the raw disk bandwidth measured in the same run.

A thin command-line wrapper over :mod:`dist_ckpt.tools.bench` (which ``dist-ckpt bench`` also runs):
the state is the demo's GPT-like model in bf16 plus distributed-optimizer Adam moments in fp32,
scaled to ``--size-gb`` GiB, saved from N spawned ranks (TP=N), loaded back on them resharded
(TP=N/2 x DP=2), then loaded whole by one process, every value verified; the raw disk is measured
before and after with a file of the same size, and the ratios say how much of it dist_ckpt gets.

No timing is asserted; the script exits 1 only if a loaded value differs from what was saved.

Usage::

    python benchmarks/bench_save_load.py --size-gb 1 --ranks 2 --dir /path/on/the/disk/to/test
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Tuple

from dist_ckpt.backends.registry import DEFAULT_SHARDED_BACKEND
from dist_ckpt.tools.bench import BenchOptions, render_table, run_bench


def _backend(text: str) -> Tuple[str, int]:
    name, _, version = text.partition(":")
    try:
        return name, int(version or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME or NAME:VERSION, got {text!r}") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="state size in GiB (default: %(default)s)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks that save; even (default: %(default)s)")
    default_backend = f"{DEFAULT_SHARDED_BACKEND[0]}:{DEFAULT_SHARDED_BACKEND[1]}"
    parser.add_argument(
        "--backend",
        type=_backend,
        default=default_backend,
        help="sharded backend NAME[:VERSION] (default: %(default)s)",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="directory on the storage to measure (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    result = run_bench(
        BenchOptions(directory=args.dir, size_mib=args.size_gb * 1024, ranks=args.ranks, backend=args.backend)
    )
    print(render_table(result))
    if not result.ok:
        print(f"error: verification failed: {result.demo.mismatches[0]}", file=sys.stderr)
        return 1
    print("\nevery loaded value verified bit-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
