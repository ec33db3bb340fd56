"""The ``dist-ckpt`` command (also ``python -m dist_ckpt``).

Each subcommand is one ``_add_<name>_command(subparsers, common)`` function that declares its
options and sets ``run`` (a function from the parsed arguments to an exit status) and ``parser``;
adding a command means writing one such function and listing it in :data:`_COMMANDS`. This is the
only module of dist_ckpt that prints.

Exit status: 0 success; 1 failure (a checkpointing error, a failed rank, a failed verification
or an OS error such as an unwritable directory), reported as one line on stderr (``--debug`` adds the traceback); 2 usage error.

Example::

    $ dist-ckpt demo --ranks 2 --size 16
    $ dist-ckpt export-hf ckpt/iter_1000 hf/iter_1000 --max-shard-size 5GB
    $ dist-ckpt verify ckpt/iter_1000 --json
    $ dist-ckpt verify s3://bucket/run1/iter_1000
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

from . import __version__
from .errors import CheckpointingException
from .serialization import DEFAULT_SHARDED_BACKEND
from .strategies.base import StrategyAction, registered_strategies
from .testing import RankError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2  # what argparse itself exits with

_RANK_FAILED = re.compile(r"rank \d+ failed:")
SubParsers = Any  # argparse._SubParsersAction, private in typeshed
CommandAdder = Callable[[SubParsers, argparse.ArgumentParser], None]


class CommandFailed(Exception):
    """A command ran but did not succeed (e.g. a verification failed); exit status 1."""

    def __init__(self, message: str, details: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.details = list(details)


# --------------------------------------------------------------------------- formatting


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    """A plain-text table; ``right[i]`` right-aligns column ``i`` (numbers)."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [str(c).rjust(w) if r else str(c).ljust(w) for c, w, r in zip(cells, widths, right)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _one_line(error: BaseException) -> str:
    """A single line describing ``error``; for failed ranks, the first one's final exception line."""
    text = str(error).strip()
    lines = text.splitlines() or [type(error).__name__]
    if not isinstance(error, RankError):
        return f"{type(error).__name__}: {lines[0]}"
    failed = [i for i, ln in enumerate(lines) if _RANK_FAILED.fullmatch(ln)]
    if not failed:  # e.g. a timeout
        return lines[0]
    first, stop = failed[0], (failed[1:] or [len(lines)])[0]
    cause = [ln.strip() for ln in lines[first + 1 : stop] if ln.strip()]
    others = len(failed) - 1
    more = f" ({others} other rank{'s' if others > 1 else ''} failed too)" if others else ""
    return f"{lines[first]} {cause[-1] if cause else ''}{more}"


# --------------------------------------------------------------------------- argument types


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _even_ranks(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 2 or value % 2:
        raise argparse.ArgumentTypeError(f"must be an even number >= 2 (the reload halves TP), got {value}")
    return value


def _sharded_backends() -> List[Tuple[str, int]]:
    keys = registered_strategies()
    return [(k.backend, k.version) for k in keys if k.action == StrategyAction.SAVE_SHARDED]


def _backend(text: str) -> Tuple[str, int]:
    """``NAME`` (its newest registered version) or ``NAME:VERSION``, checked against the registry."""
    name, sep, version_text = text.partition(":")
    known = _sharded_backends()
    listing = ", ".join(f"{b}:{v}" for b, v in known) or "none"
    if sep:
        try:
            version = int(version_text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected NAME or NAME:VERSION, got {text!r}") from None
        if (name, version) not in known:
            raise argparse.ArgumentTypeError(f"no sharded backend {text!r} (registered: {listing})")
        return name, version
    versions = [v for b, v in known if b == name]
    if not versions:
        raise argparse.ArgumentTypeError(f"no sharded backend {name!r} (registered: {listing})")
    return name, max(versions)


# --------------------------------------------------------------------------- demo


def _add_demo_command(subparsers: SubParsers, common: argparse.ArgumentParser) -> None:
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
    p.add_argument("--size", type=_positive_float, default=64.0, metavar="MIB",
                   help="target size of the saved state, model + optimizer, in MiB (default: %(default)s)")
    p.add_argument("--ranks", type=_even_ranks, default=4, metavar="N",
                   help="ranks that save; even, >= 2 (default: %(default)s)")
    p.add_argument("--backend", type=_backend, default=default_backend, metavar="NAME[:VERSION]",
                   help="sharded backend to save with (default: %(default)s)")
    p.add_argument("--dir", type=Path, default=None, metavar="DIR",
                   help="create the checkpoint in a new subdirectory of DIR (default: the system temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint instead of deleting it")
    p.add_argument("--seed", type=int, default=1234,
                   help="seed of every saved value (default: %(default)s)")
    p.set_defaults(run=_run_demo, parser=p)


def _run_demo(args: argparse.Namespace) -> int:
    from .demo import DemoOptions, run_demo  # keeps `dist-ckpt --help` fast

    result = run_demo(
        DemoOptions(size_mib=args.size, ranks=args.ranks, backend=args.backend, directory=args.dir,
                    keep=args.keep, seed=args.seed)
    )
    cfg = result.config
    fate = "kept" if result.kept else "deleted"
    print(f"dist-ckpt demo: {result.ranks} ranks, backend {result.backend[0]}:{result.backend[1]}")
    print(f"  model      GPT-like, hidden {cfg.hidden}, {cfg.layers} layers, vocab {cfg.vocab} (bf16)"
          f" + Adam exp_avg, exp_avg_sq (fp32, distributed optimizer)")
    print(f"  checkpoint {result.num_tensors} tensors in {result.num_shards} saved shards, "
          f"{_mib(result.state_bytes)}; {result.num_files} files, {_mib(result.disk_bytes)} on disk")
    print(f"             {result.checkpoint_dir} ({fate})")
    print()
    rows = []
    for ph in result.phases:
        if ph.checked is None:
            verified = "-"
        elif ph.failed:
            verified = f"FAILED ({ph.failed} of {ph.checked} differ)"
        else:
            verified = f"bit-exact ({ph.checked} values)"
        timing = [f"{ph.seconds:.3f}", f"{ph.gib_per_s:.3g}"]
        rows.append([ph.name, ph.layout, str(ph.ranks), *timing, verified])
    print(format_table(["step", "layout", "ranks", "time (s)", "GiB/s", "verified"], rows,
                       [False, False, True, True, True, False]))
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


# --------------------------------------------------------------------------- export-hf

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*")


def _size(text: str) -> int:
    """A byte count: ``5GB`` (10**9), ``512MiB`` (2**20), or plain bytes."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 5GB, 500MiB or 1000000, got {text!r}")
    value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte, got {text!r}")
    return value


def _add_export_hf_command(subparsers: SubParsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "export-hf",
        parents=[common],
        help="write every tensor of a checkpoint into a HuggingFace safetensors folder",
        description=(
            "Assemble every tensor of the checkpoint SRC (any backend, saved by any number of "
            "ranks) and write it to the HuggingFace folder DST: model.safetensors, or shard files "
            "of at most --max-shard-size bytes plus model.safetensors.index.json. One tensor is in "
            "memory at a time; no process group is needed. Keys are written as stored."
        ),
    )
    p.add_argument("src", metavar="SRC", help="a committed dist_ckpt checkpoint: a directory or s3://bucket/prefix")
    p.add_argument("dst", metavar="DST", help="the local folder to write (must not hold HF weights yet)")
    p.add_argument("--max-shard-size", type=_size, default=2**31, metavar="SIZE",
                   help="most bytes per file, e.g. 5GB or 2GiB (default: 2GiB)")
    p.set_defaults(run=_run_export_hf, parser=p)


def _run_export_hf(args: argparse.Namespace) -> int:
    import time

    from .hf.export import export  # keeps `dist-ckpt --help` fast

    start = time.perf_counter()
    result = export(args.src, args.dst, max_shard_size=args.max_shard_size)
    seconds = time.perf_counter() - start
    files = len(result.files)
    print(f"dist-ckpt export-hf: {result.tensors} tensors, {_mib(result.total_bytes)}, from {args.src}")
    print(f"  to {result.directory}: {files} file{'s' if files != 1 else ''}"
          + (f" + {result.index}" if result.index else "") + f", in {seconds:.2f} s")
    return EXIT_OK


# --------------------------------------------------------------------------- verify


def _add_verify_command(subparsers: SubParsers, common: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "verify",
        parents=[common],
        help="check every file of a checkpoint against the checksums recorded when it was saved",
        description=(
            "Read every file of the checkpoint DIR once and check it: the commit record "
            "(metadata.json), each file's presence and size, safetensors headers, and the crc32c "
            "recorded at save time for every block of every tensor, every zarr file, common.pt and "
            "every ShardedObject file. Prints one line per problem ('FILE (key KEY): PROBLEM') and "
            "exits 1 if there is any (a save that never committed is one), 0 if the checkpoint is healthy. "
            "Works on s3:// URLs too (every object is read once). Needs no process group."
        ),
    )
    p.add_argument("dir", metavar="DIR", help="a checkpoint directory, or s3://bucket/prefix (credentials and endpoint "
                   "from the AWS environment variables)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON document (exit status as above)")
    p.set_defaults(run=_run_verify, parser=p)


def _run_verify(args: argparse.Namespace) -> int:
    import json

    from .verify import verify_checkpoint  # keeps `dist-ckpt --help` fast

    report = verify_checkpoint(args.dir)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return EXIT_OK if report.ok else EXIT_FAILURE
    for problem in report.problems:
        print(problem)
    for note in report.notes:
        print(f"note: {note}")
    summary = f"{report.files_checked} files, {_mib(report.bytes_checked)} checked"
    if not report.ok:
        n = len(report.problems)
        raise CommandFailed(f"{args.dir}: {n} problem{'s' if n != 1 else ''} ({summary})")
    print(f"OK: {args.dir} ({', '.join(report.backends)}): {summary}")
    return EXIT_OK


# --------------------------------------------------------------------------- parser and main

_COMMANDS: Tuple[CommandAdder, ...] = (_add_demo_command, _add_export_hf_command, _add_verify_command)


def _common_options(suppress_defaults: bool) -> argparse.ArgumentParser:
    """Options accepted before and after the command (``dist-ckpt --debug demo``, ``demo --debug``)."""
    default = argparse.SUPPRESS if suppress_defaults else False
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=default,
                        help="show tracebacks and debug logging on failure")
    common.add_argument("-v", "--verbose", action="store_true", default=default, help="log progress (INFO)")
    return common


def build_parser() -> argparse.ArgumentParser:
    """The ``dist-ckpt`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="dist-ckpt",
        parents=[_common_options(suppress_defaults=False)],
        description="Distributed checkpointing of sharded model and optimizer state: save under "
        "one parallel layout, load under another.",
        epilog="Run 'dist-ckpt COMMAND --help' for the options of a command. Exit status: 0 success, "
        "1 failure (checkpointing error or failed verification), 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True)
    for add_command in _COMMANDS:
        add_command(subparsers, _common_options(suppress_defaults=True))
    return parser


def _configure_logging(debug: bool, verbose: bool) -> None:
    level = logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``dist-ckpt`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # report it with the command's usage, not the top-level one
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    _configure_logging(args.debug, args.verbose)
    prefix = f"dist-ckpt {args.command}: error:"
    try:
        return int(args.run(args))
    except CommandFailed as e:
        print(f"{prefix} {e}", file=sys.stderr)
        if args.debug:
            print("\n".join(e.details), file=sys.stderr)
        return EXIT_FAILURE
    except (CheckpointingException, RankError, OSError) as e:
        if args.debug:
            traceback.print_exc()
        hint = "" if args.debug else " (--debug shows the traceback)"
        print(f"{prefix} {_one_line(e)}{hint}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"{prefix} interrupted", file=sys.stderr)
        return 130
