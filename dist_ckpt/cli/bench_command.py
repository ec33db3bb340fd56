"""``dist-ckpt bench``: save/load throughput on a chosen storage, as ratios to its raw speed."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from dist_ckpt.backends.registry import DEFAULT_SHARDED_BACKEND
from dist_ckpt.cli.common import (
    EXIT_OK,
    BadPathError,
    CommandFailed,
    SubParsers,
    add_engine_option,
    add_progress_option,
    backend_arg,
    even_ranks_arg,
    positive_float_arg,
    print_json,
    progress_enabled,
)

__all__ = ["add_bench_command"]


def add_bench_command(subparsers: SubParsers, common: argparse.ArgumentParser) -> None:
    """Declare ``dist-ckpt bench``."""
    default_backend = f"{DEFAULT_SHARDED_BACKEND[0]}:{DEFAULT_SHARDED_BACKEND[1]}"
    p = subparsers.add_parser(
        "bench",
        parents=[common],
        help="measure save/load throughput on your storage next to its raw bandwidth",
        description=(
            "Measure the storage under --dir: write a file as large as the state with large "
            "sequential writes + fsync and read it back from a cold page cache (the raw disk); "
            "save a GPT-like sharded state from N ranks, load it resharded on them and whole in "
            "one process, every load from a cold cache and verified bit for bit; measure the disk "
            "again. Prints each step's GiB/s and its ratio to the better raw measurement. Needs a "
            "little more than --size of free space under --dir (deleted afterwards) and about twice "
            "--size of memory. Exits 1 only if a loaded value differs from what was saved."
        ),
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        metavar="DIR",
        help="a directory on the storage to measure (default: %(default)s)",
    )
    p.add_argument(
        "--size",
        type=positive_float_arg,
        default=1024.0,
        metavar="MIB",
        help="size of the state in MiB (default: %(default)s)",
    )
    p.add_argument(
        "--ranks",
        type=even_ranks_arg,
        default=2,
        metavar="N",
        help="ranks that save; even, >= 2 (default: %(default)s)",
    )
    p.add_argument(
        "--backend",
        type=backend_arg,
        default=default_backend,
        metavar="NAME[:VERSION]",
        help="sharded backend to measure (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print the measurements as one JSON document")
    add_engine_option(p)
    add_progress_option(p)
    p.set_defaults(run=run_bench_command, parser=p)


def run_bench_command(args: argparse.Namespace) -> int:
    """Run the benchmark and print its table (or JSON)."""
    from dist_ckpt.tools.bench import BenchOptions, render_table, run_bench  # keeps `dist-ckpt --help` fast

    try:
        args.dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadPathError(f"--dir {str(args.dir)!r} cannot be used: {e.strerror or e}") from e

    bar = None
    if progress_enabled(args):
        from tqdm import tqdm

        bar = tqdm(total=3, desc="benchmark", unit="step", dynamic_ncols=True)

    def on_phase(phase: str) -> None:
        if bar is not None:
            if bar.n or phase != "measuring the raw disk":
                bar.update(1)
            bar.set_postfix_str(phase, refresh=True)

    try:
        result = run_bench(
            BenchOptions(
                directory=args.dir, size_mib=args.size, ranks=args.ranks, backend=args.backend, engine=args.engine
            ),
            on_phase=on_phase,
        )
        if bar is not None:
            bar.update(bar.total - bar.n)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print_json(result.to_json())
    else:
        print(render_table(result))
    if not result.ok:
        raise CommandFailed(f"verification failed: {result.demo.mismatches[0]}", result.demo.mismatches)
    if not args.json:
        print("\nevery loaded value verified bit-exact")
    return EXIT_OK
