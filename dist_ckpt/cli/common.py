"""What every ``dist-ckpt`` command shares: argument types, output formatting, failures.

Example::

    parser.add_argument("--backend", type=backend_arg)      # "zarr" or "zarr:1", checked
    print(format_table(["key", "size"], [["w", "4.0 MiB"]], [False, True]))
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Callable, List, Sequence, Tuple

from dist_ckpt.engine.registry import StrategyAction, registered_strategies
from dist_ckpt.tools.launch import RankError

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "BadPathError",
    "CommandAdder",
    "CommandFailed",
    "SubParsers",
    "backend_arg",
    "even_ranks_arg",
    "format_table",
    "human_bytes",
    "mib",
    "one_line",
    "positive_float_arg",
    "print_json",
    "size_arg",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2  # what argparse itself exits with

SubParsers = Any  # argparse._SubParsersAction, private in typeshed
CommandAdder = Callable[[SubParsers, argparse.ArgumentParser], None]

_RANK_FAILED = re.compile(r"rank \d+ failed:")


class BadPathError(Exception):
    """A command was given a path it cannot use (e.g. ``--dir`` under a file); exit status 2."""


class CommandFailed(Exception):
    """A command ran but did not succeed (e.g. a verification failed); exit status 1.

    Args:
        message: the one line printed on stderr.
        details: further lines, printed with ``--debug``.
    """

    def __init__(self, message: str, details: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.details = list(details)


# --------------------------------------------------------------------------- output


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    """A plain-text table; ``right[i]`` right-aligns column ``i`` (numbers).

    Example::

        format_table(["key", "bytes"], [["w", "16"]], [False, True])
    """
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [str(c).rjust(w) if r else str(c).ljust(w) for c, w, r in zip(cells, widths, right)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def mib(nbytes: int) -> str:
    """``nbytes`` in MiB, for tables of one scale (the demo's): ``"1,024.0 MiB"``."""
    return f"{nbytes / 2**20:,.1f} MiB"


def human_bytes(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1: ``"212 B"``, ``"1.5 KiB"``,
    ``"3.25 GiB"`` (for sizes that span several scales, such as a checkpoint's tensors)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def print_json(doc: Any) -> None:
    """Print ``doc`` as one JSON document on stdout (``--json``)."""
    print(json.dumps(doc, indent=2))


def one_line(error: BaseException) -> str:
    """A single line describing ``error``; for failed ranks, the first one's final exception line.

    Example::

        one_line(NotACheckpointError("'x' does not exist"))   # "NotACheckpointError: 'x' does not exist"
    """
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


def positive_float_arg(text: str) -> float:
    """A positive number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def even_ranks_arg(text: str) -> int:
    """An even number of ranks, at least 2 (the demo's reload halves TP)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 2 or value % 2:
        raise argparse.ArgumentTypeError(f"must be an even number >= 2 (the reload halves TP), got {value}")
    return value


def sharded_backends() -> List[Tuple[str, int]]:
    """``(backend, version)`` of every registered sharded save strategy."""
    keys = registered_strategies()
    return [(k.backend, k.version) for k in keys if k.action == StrategyAction.SAVE_SHARDED]


def backend_arg(text: str) -> Tuple[str, int]:
    """``NAME`` (its newest registered version) or ``NAME:VERSION``, checked against the registry."""
    name, sep, version_text = text.partition(":")
    known = sharded_backends()
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


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*")


def size_arg(text: str) -> int:
    """A byte count: ``5GB`` (10**9), ``512MiB`` (2**20), or plain bytes."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 5GB, 500MiB or 1000000, got {text!r}")
    value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte, got {text!r}")
    return value


def add_progress_option(parser: argparse.ArgumentParser) -> None:
    """``--progress`` / ``--no-progress``: progress bars on stderr (default: when it is a terminal)."""
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force progress bars on stderr on or off (default: on when stderr is a terminal, "
        "unless --quiet or --json)",
    )


def progress_enabled(args: argparse.Namespace) -> bool:
    """Whether to draw progress bars: as ``--progress`` / ``--no-progress`` say, else when stderr
    is a terminal and neither ``--quiet`` nor ``--json`` is given."""
    if args.progress is not None:
        return bool(args.progress)
    return sys.stderr.isatty() and not getattr(args, "quiet", False) and not getattr(args, "json", False)
