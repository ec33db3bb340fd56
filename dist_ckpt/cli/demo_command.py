"""``dist-ckpt demo``: save a sharded state on N local ranks, reload it in other layouts, verify."""

from __future__ import annotations

import argparse
from pathlib import Path

from dist_ckpt.backends.registry import DEFAULT_SHARDED_BACKEND
from dist_ckpt.cli.common import (
    EXIT_OK,
    CommandFailed,
    SubParsers,
    add_engine_option,
    backend_arg,
    even_ranks_arg,
    format_table,
    mib,
    positive_float_arg,
)
from dist_ckpt.engine.report import significant
from dist_ckpt.errors import counted

__all__ = ["add_demo_command"]


def add_demo_command(subparsers: SubParsers, common: argparse.ArgumentParser) -> None:
    """Declare ``dist-ckpt demo``."""
    default_backend = f"{DEFAULT_SHARDED_BACKEND[0]}:{DEFAULT_SHARDED_BACKEND[1]}"
    p = subparsers.add_parser(
        "demo",
        parents=[common],
        help="save a sharded state on N local ranks, reload it in other layouts, verify it",
        description=(
            "Start N CPU ranks (gloo). Each builds its part of a GPT-like model sharded with "
            "tensor parallelism TP=N (bf16), distributed-optimizer Adam moments (fp32, flattened "
            "ranges), common objects and a per-rank ShardedObject, and saves it. The same ranks "
            "then load it as TP=N/2 x DP=2 (the optimizer ranges split differently), and finally "
            "this process loads every tensor whole without any process group. Every loaded value "
            "is compared bit for bit with what was saved. Prints sizes, file count, times and "
            "throughput; exits 1 if any value differs."
        ),
    )
    p.add_argument(
        "--size",
        type=positive_float_arg,
        default=64.0,
        metavar="MIB",
        help="target size of the saved state, model + optimizer, in MiB (default: %(default)s)",
    )
    p.add_argument(
        "--ranks",
        type=even_ranks_arg,
        default=4,
        metavar="N",
        help="ranks that save; even, >= 2 (default: %(default)s)",
    )
    p.add_argument(
        "--backend",
        type=backend_arg,
        default=default_backend,
        metavar="NAME[:VERSION]",
        help="sharded backend to save with (default: %(default)s)",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="create the checkpoint in a new subdirectory of DIR (default: the system temp dir)",
    )
    add_engine_option(p)
    p.add_argument("--keep", action="store_true", help="keep the checkpoint instead of deleting it")
    p.add_argument("--seed", type=int, default=1234, help="seed of every saved value (default: %(default)s)")
    p.set_defaults(run=run_demo_command, parser=p)


def run_demo_command(args: argparse.Namespace) -> int:
    """Run the demo and print its table."""
    from dist_ckpt.tools.demo import DemoOptions, run_demo  # keeps `dist-ckpt --help` fast

    result = run_demo(
        DemoOptions(
            size_mib=args.size,
            ranks=args.ranks,
            backend=args.backend,
            engine=args.engine,
            directory=args.dir,
            keep=args.keep,
            seed=args.seed,
        )
    )
    cfg = result.config
    fate = "kept" if result.kept else "deleted"
    engine = f" ({result.engine})" if result.backend[0] == "zarr" else ""
    print(f"dist-ckpt demo: {counted(result.ranks, 'rank')}, backend {result.backend[0]}:{result.backend[1]}{engine}")
    print(
        f"  model      GPT-like, hidden {cfg.hidden}, {cfg.layers} layers, vocab {cfg.vocab} (bf16)"
        f" + Adam exp_avg, exp_avg_sq (fp32, distributed optimizer)"
    )
    print(
        f"  checkpoint {counted(result.num_tensors, 'tensor')} in {counted(result.num_shards, 'saved shard')}, "
        f"{mib(result.state_bytes)}; {counted(result.num_files, 'file')}, {mib(result.disk_bytes)} on disk"
    )
    print(f"             {result.checkpoint_dir} ({fate})")
    print()
    rows = []
    for ph in result.phases:
        if ph.checked is None:
            verified = "-"
        elif ph.failed:
            verified = f"FAILED ({ph.failed} of {ph.checked} differ)"
        else:
            verified = f"bit-exact ({counted(ph.checked, 'value')})"
        timing = [f"{ph.seconds:.3f}", significant(ph.gib_per_s)]
        rows.append([ph.name, ph.layout, str(ph.ranks), *timing, verified])
    print(
        format_table(
            ["step", "layout", "ranks", "time (s)", "GiB/s", "verified"], rows, [False, False, True, True, True, False]
        )
    )
    if not result.ok:
        failed = sum(ph.failed for ph in result.phases)
        raise CommandFailed(
            f"verification failed: {failed} loaded values differ from what was saved; first: "
            f"{result.mismatches[0]}" + ("" if len(result.mismatches) == 1 else " (--debug lists more)"),
            result.mismatches,
        )
    print()
    print("OK: every value loaded in every layout equals what was saved.")
    return EXIT_OK
