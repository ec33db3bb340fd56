"""What every ``dist-ckpt`` command shares: argument types, output formatting, failures.

Example:

```python
parser.add_argument("--backend", type=backend_arg)      # "zarr" or "zarr:1", checked
print(format_table(["key", "size"], [["w", "4.0 MiB"]], [False, True]))
```
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

from dist_ckpt.backends.registry import StrategyAction, registered_strategies
from dist_ckpt.engine.report import format_bytes, format_rate, gib_per_s
from dist_ckpt.errors import counted
from dist_ckpt.tools.launch import RankError

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "BadPathError",
    "CommandAdder",
    "CommandFailed",
    "SubParsers",
    "add_engine_option",
    "backend_arg",
    "did_you_mean",
    "elide",
    "engine_arg",
    "even_ranks_arg",
    "format_table",
    "gib_per_s",
    "human_bytes",
    "human_rate",
    "mib",
    "one_line",
    "positive_float_arg",
    "print_json",
    "require_directory",
    "size_arg",
    "table_width",
    "terminal_width",
    "use_engine",
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


def format_table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    right: Sequence[bool],
    max_width: Optional[int] = None,
    shrink: Sequence[int] = (),
    wrap: Sequence[int] = (),
    keys_on_own_lines: bool = False,
) -> str:
    """A plain-text table; ``right[i]`` right-aligns column ``i`` (numbers).

    With ``max_width``, the columns listed in ``shrink`` (widest first) are narrowed until every
    line fits, down to `MIN_COLUMN_WIDTH` each. A narrowed cell of a column in ``wrap`` goes on
    over as many lines as it needs, broken between words; one of any other column is shortened in
    the middle (`elide()`), so both of its ends stay readable.

    With ``keys_on_own_lines``, each cell of the first column (a key) is printed whole on a line
    of its own, and the other columns below it, indented: for keys too long to share a line of
    the terminal with the rest (see `table_width()`).

    Example:

    ```python
    format_table(["key", "bytes"], [["w", "16"]], [False, True])
    format_table(headers, rows, right, max_width=terminal_width(), shrink=[5], wrap=[5])
    ```
    """
    if not keys_on_own_lines:
        return "\n".join(line for lines in _cell_lines(headers, rows, right, max_width, shrink, wrap) for line in lines)
    rest = _cell_lines(
        headers[1:],
        [r[1:] for r in rows],
        right[1:],
        None if max_width is None else max_width - len(_KEY_INDENT),
        [i - 1 for i in shrink if i > 0],
        [i - 1 for i in wrap if i > 0],
    )
    out: List[str] = []
    for cells, lines in zip([headers, *rows], rest):
        if cells[0]:
            out.append(str(cells[0]))
        out.extend((_KEY_INDENT + line).rstrip() for line in lines)
    return "\n".join(out)


#: how far `format_table()` indents the other columns under a key on its own line
_KEY_INDENT = "    "


def _cell_lines(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    right: Sequence[bool],
    max_width: Optional[int],
    shrink: Sequence[int],
    wrap: Sequence[int],
) -> List[List[str]]:
    """The lines of `format_table()`'s header and of each row (several for a wrapped cell)."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    if max_width is not None:
        _shrink_widths(widths, max_width, shrink)

    def lines(cells: Sequence[str]) -> List[str]:
        parts = [
            (textwrap.wrap(str(c), w) or [""]) if i in wrap else [elide(str(c), w)]
            for i, (c, w) in enumerate(zip(cells, widths))
        ]
        height = max(len(p) for p in parts)
        parts = [p + [""] * (height - len(p)) for p in parts]
        return [
            "  ".join(p[k].rjust(w) if r else p[k].ljust(w) for p, w, r in zip(parts, widths, right)).rstrip()
            for k in range(height)
        ]

    return [lines(cells) for cells in [headers, *rows]]


def table_width(
    headers: Sequence[str], rows: Sequence[Sequence[str]], narrowest: Sequence[int] = (), floor: int = 0
) -> int:
    """The width of `format_table()`'s widest line, with the columns in ``narrowest`` shrunk
    to ``floor`` characters (default `MIN_COLUMN_WIDTH`): whether a table fits a terminal."""
    floor = floor or MIN_COLUMN_WIDTH
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    widths = [min(w, floor) if i in narrowest else w for i, w in enumerate(widths)]
    return sum(widths) + 2 * (len(widths) - 1)


#: the narrowest a shrunk table column gets (keys shorter than this are never shortened)
MIN_COLUMN_WIDTH = 12
_ELLIPSIS = "..."


def _shrink_widths(widths: List[int], max_width: int, shrink: Sequence[int]) -> None:
    """Narrow the ``shrink`` columns of ``widths`` (in place), widest first, to fit ``max_width``."""
    excess = sum(widths) + 2 * (len(widths) - 1) - max_width
    while excess > 0:
        candidates = [i for i in shrink if widths[i] > MIN_COLUMN_WIDTH]
        if not candidates:
            return
        widest = max(candidates, key=lambda i: widths[i])
        widths[widest] -= 1
        excess -= 1


def elide(text: str, width: int) -> str:
    """``text`` shortened to ``width`` characters by replacing its middle with ``...``.

    Example:

    ```python
    elide("decoder.layers.self_attention.linear_qkv.weight", 24)   # "decoder.lay...qkv.weight"
    ```
    """
    if len(text) <= width:
        return text
    if width <= len(_ELLIPSIS):
        return text[:width]
    keep = width - len(_ELLIPSIS)
    head = (keep + 1) // 2
    return text[:head] + _ELLIPSIS + text[len(text) - (keep - head) :]


def terminal_width() -> Optional[int]:
    """The width output lines should fit: ``$COLUMNS``, else the terminal's when stdout is one;
    None (no limit) when stdout is a pipe or a file, so ``| grep`` sees whole lines."""
    isatty = getattr(sys.stdout, "isatty", None)  # a replaced stdout may have none
    if os.environ.get("COLUMNS", "").isdigit() or (isatty is not None and isatty()):
        return max(shutil.get_terminal_size().columns, 40)
    return None


def mib(nbytes: int) -> str:
    """``nbytes`` in MiB, for tables of one scale (the demo's): ``"1,024.0 MiB"``."""
    return f"{nbytes / 2**20:,.1f} MiB"


#: throughput in GiB/s, the one unit of every ``dist-ckpt`` command and report: ``"1.52 GiB/s"``
#: (never an exponent; the library's one definition)
human_rate = format_rate


#: sizes in binary units: ``"212 B"``, ``"1.5 KiB"``, ``"3.25 GiB"`` (the library's one definition)
human_bytes = format_bytes


def print_json(doc: Any) -> None:
    """Print ``doc`` as one JSON document on stdout (``--json``)."""
    print(json.dumps(doc, indent=2))


def one_line(error: BaseException) -> str:
    """A single line describing ``error``; for failed ranks, the first one's final exception line.

    Example:

    ```python
    one_line(NotACheckpointError("'x' does not exist"))   # "NotACheckpointError: 'x' does not exist"
    ```
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
    more = f" ({counted(others, 'other rank')} failed too)" if others else ""
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


def did_you_mean(name: str, choices: Sequence[str]) -> str:
    """`` (did you mean 'zarr'?)`` for the closest of ``choices``, or ``""`` if none is close."""
    close = difflib.get_close_matches(name.lower(), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def backend_arg(text: str) -> Tuple[str, int]:
    """``NAME`` (its newest registered version) or ``NAME:VERSION``, checked against the registry.

    Names are case-insensitive (``Zarr`` is ``zarr``); an unknown one is refused with the
    registered ones and the closest match (``zar`` -> "did you mean 'zarr'?").
    """
    name, sep, version_text = text.strip().partition(":")
    known = sharded_backends()
    by_lower = {b.lower(): b for b, _ in known}
    name = by_lower.get(name.lower(), name)
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
        hint = did_you_mean(name, sorted(by_lower))
        raise argparse.ArgumentTypeError(f"no sharded backend {name!r}{hint} (registered: {listing})")
    return name, max(versions)


def engine_arg(text: str) -> str:
    """A zarr engine name (``zarr-python``, ``tensorstore``), case-insensitive, with a suggestion
    for a typo."""
    from dist_ckpt.tools.demo import ZARR_ENGINES  # the one list; imported only when --engine is given

    name = text.strip().lower().replace("_", "-")
    if name in ("zarr", "zarrpython"):
        name = "zarr-python"
    if name not in ZARR_ENGINES:
        hint = did_you_mean(name, ZARR_ENGINES)
        raise argparse.ArgumentTypeError(f"no zarr engine {text!r}{hint} (choose from {', '.join(ZARR_ENGINES)})")
    return name


def add_engine_option(parser: argparse.ArgumentParser, help_text: str = "") -> None:
    """``--engine {zarr-python,tensorstore}``: which library reads and writes the zarr backend."""
    parser.add_argument(
        "--engine",
        type=engine_arg,
        default="zarr-python",
        metavar="ENGINE",
        help=help_text
        or "library that writes and reads the zarr backend: zarr-python (default) or "
        "tensorstore; both use the same on-disk layout (other backends ignore it)",
    )


def use_engine(engine: str, include_save: bool = True) -> None:
    """Make ``engine`` the registered ``("zarr", 1)`` load (and with ``include_save``, save)
    strategy of this process."""
    from dist_ckpt.tools.demo import use_zarr_engine

    use_zarr_engine(engine, include_save)


def require_directory(text: str) -> None:
    """Refuse a local ``text`` that is a regular file or does not exist (exit status 2), with a
    message that says which; URLs are left to the storage layer."""
    if "://" in text:
        return
    path = Path(text)
    if path.is_dir():
        return
    if path.exists():
        raise BadPathError(f"{text!r} is a file, not a checkpoint directory (give the directory that holds it)")
    raise BadPathError(f"{text!r} does not exist")


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
