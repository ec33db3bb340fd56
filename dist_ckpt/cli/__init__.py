"""The ``dist-ckpt`` command (also ``python -m dist_ckpt``).

One module per subcommand, each with one ``add_<name>_command(subparsers, common)`` function that
declares its options and sets ``run`` (a function from the parsed arguments to an exit status)
and ``parser``; adding a command means writing one such module and listing its function in
`COMMANDS`. This package is the only part of dist_ckpt that prints, and the only one that
imports tqdm (progress bars, `progress`).

Exit status: 0 success; 1 failure (a checkpointing error such as a corrupt checkpoint, a failed
rank, a failed verification, or an OS error such as an unwritable directory); 2 usage error,
including a bad location: a path that does not exist or holds no checkpoint, a destination that
is not empty, a malformed URL. Failures are one line on stderr (``--debug`` adds the
traceback). Commands with ``--json`` print one JSON document on stdout. Locations may be
``s3://bucket/prefix`` URLs wherever the backend supports object stores.

Example:

```console
$ dist-ckpt inspect ckpt/iter_1000 --json
$ dist-ckpt verify ckpt/iter_1000
$ dist-ckpt convert ckpt/iter_1000 ckpt_zarr/iter_1000 --to zarr
$ dist-ckpt export-hf ckpt/iter_1000 hf/iter_1000 --max-shard-size 5GB
$ dist-ckpt bench --dir /mnt/nvme/scratch --size 4096 --ranks 4
$ dist-ckpt demo --ranks 2 --size 16
```
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from typing import Optional, Sequence, Tuple

from dist_ckpt import __version__
from dist_ckpt.cli.bench_command import add_bench_command
from dist_ckpt.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    BadPathError,
    CommandAdder,
    CommandFailed,
    format_table,
    one_line,
)
from dist_ckpt.cli.convert_command import add_convert_command
from dist_ckpt.cli.demo_command import add_demo_command
from dist_ckpt.cli.export_hf_command import add_export_hf_command
from dist_ckpt.cli.inspect_command import add_inspect_command
from dist_ckpt.cli.verify_command import add_verify_command
from dist_ckpt.errors import CheckpointExistsError, CheckpointingException, NotACheckpointError
from dist_ckpt.storage.errors import BucketNotFoundError, StorageConfigError
from dist_ckpt.tools.launch import RankError

__all__ = ["COMMANDS", "EXIT_FAILURE", "EXIT_OK", "EXIT_USAGE", "CommandFailed", "build_parser", "format_table", "main"]

#: every subcommand, in the order ``dist-ckpt --help`` lists them
COMMANDS: Tuple[CommandAdder, ...] = (
    add_inspect_command,
    add_verify_command,
    add_convert_command,
    add_export_hf_command,
    add_bench_command,
    add_demo_command,
)


#: errors that mean the command was pointed at the wrong place: exit status 2, like a usage error
_BAD_LOCATION = (BadPathError, NotACheckpointError, CheckpointExistsError, BucketNotFoundError, StorageConfigError)


def _common_options(suppress_defaults: bool) -> argparse.ArgumentParser:
    """Options accepted before and after the command (``dist-ckpt --debug demo``, ``demo --debug``)."""
    default = argparse.SUPPRESS if suppress_defaults else False
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=default, help="show tracebacks and debug logging on failure"
    )
    common.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default,
        help="log what the library does (INFO), e.g. each save's and load's report",
    )
    common.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=default,
        help="no progress bars (they are only drawn when stderr is a terminal anyway)",
    )
    return common


def build_parser() -> argparse.ArgumentParser:
    """The ``dist-ckpt`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="dist-ckpt",
        parents=[_common_options(suppress_defaults=False)],
        description="Distributed checkpointing of sharded model and optimizer state: save under "
        "one parallel layout, load under another. These commands work on checkpoint directories "
        "from one process, without any process group.",
        epilog="Run 'dist-ckpt COMMAND --help' for the options of a command. Exit status: 0 success, "
        "1 failure (a corrupt checkpoint, a failed verification, an I/O error; one line on stderr), "
        "2 usage error or bad location (no checkpoint there, destination not empty, malformed URL), "
        "141 stdout's reader went away (| head).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True)
    for add_command in COMMANDS:
        add_command(subparsers, _common_options(suppress_defaults=True))
    return parser


def _configure_logging(debug: bool, verbose: bool) -> None:
    level = logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


#: what a shell reports for a process killed by SIGPIPE (128 + 13): the output was cut short
EXIT_BROKEN_PIPE = 141


def _detach_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush does not fail a second time."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file: nothing will be flushed to it
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``dist-ckpt`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # report it with the command's usage, not the top-level one
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    _configure_logging(args.debug, args.verbose)
    prefix = f"dist-ckpt {args.command}: error:"
    hint = "" if args.debug else " (--debug shows the traceback)"
    try:
        return int(args.run(args))
    except BrokenPipeError:  # `dist-ckpt inspect DIR | head`: the reader took what it wanted
        _detach_stdout()
        return EXIT_BROKEN_PIPE
    except CommandFailed as e:
        print(f"{prefix} {e}", file=sys.stderr)
        if args.debug:
            print("\n".join(e.details), file=sys.stderr)
        return EXIT_FAILURE
    except _BAD_LOCATION as e:
        if args.debug:
            traceback.print_exc()
        print(f"{prefix} {one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except (CheckpointingException, RankError, OSError) as e:
        if args.debug:
            traceback.print_exc()
        print(f"{prefix} {one_line(e)}{hint}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print(f"{prefix} interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 -- still one line, but say that it is unexpected
        if args.debug:
            traceback.print_exc()
        print(f"{prefix} unexpected {one_line(e)}: this is a bug in dist_ckpt, please report it{hint}", file=sys.stderr)
        return EXIT_FAILURE
