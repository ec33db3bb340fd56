"""``dist-ckpt verify``: check every file of a checkpoint against its recorded checksums."""

from __future__ import annotations

import argparse
from typing import List

from dist_ckpt.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    BadPathError,
    CommandFailed,
    SubParsers,
    add_progress_option,
    human_bytes,
    print_json,
    progress_enabled,
    require_directory,
)
from dist_ckpt.errors import counted

__all__ = ["add_verify_command"]


def add_verify_command(subparsers: SubParsers, common: argparse.ArgumentParser) -> None:
    """Declare ``dist-ckpt verify``."""
    p = subparsers.add_parser(
        "verify",
        parents=[common],
        help="check every file of a checkpoint against the checksums recorded when it was saved",
        description=(
            "Read every file of the checkpoint DIR once and check it: the commit record "
            "(metadata.json), each file's presence and size, safetensors headers, and the crc32c "
            "recorded at save time for every block of every tensor, every zarr file, common.pt and "
            "every ShardedObject file. Prints one line per problem ('FILE (key KEY): PROBLEM') and "
            "exits 1 if there is any (a save that never committed is one), 0 if the checkpoint is healthy, "
            "2 if DIR does not exist, is a file, or holds no checkpoint at all (neither metadata.json nor "
            "any file a save writes). A HuggingFace folder records no checksums: its index and the header "
            "of every file are checked against the files (a truncated or garbled file exits 1), and the "
            "output says that the tensor data was not. "
            "Works on s3:// URLs too (every object is read once). Needs no process group."
        ),
    )
    p.add_argument(
        "dir",
        metavar="DIR",
        help="a checkpoint directory, or s3://bucket/prefix (credentials and endpoint "
        "from the AWS environment variables)",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON document (exit status as above)")
    add_progress_option(p)
    p.set_defaults(run=run_verify_command, parser=p)


def run_verify_command(args: argparse.Namespace) -> int:
    """Verify and print one line per problem (or the JSON report)."""
    from dist_ckpt.cli.progress import ProgressBars
    from dist_ckpt.storage.location import resolve_location
    from dist_ckpt.tools.verify import verify_checkpoint  # keeps `dist-ckpt --help` fast

    require_directory(args.dir)  # a bad path, not a damaged checkpoint: exit 2
    with ProgressBars(progress_enabled(args), "verifying") as bars:
        report = verify_checkpoint(resolve_location(args.dir), progress=bars)
    if not report.found and "://" not in args.dir:
        from dist_ckpt.hf.folder import has_hf_weights

        if has_hf_weights(args.dir):
            return _verify_hf_folder(args)
    if args.json:
        print_json(report.to_json())
        return EXIT_OK if report.ok else EXIT_FAILURE if report.found else EXIT_USAGE
    if not report.found:
        raise BadPathError(
            f"{args.dir!r} holds no checkpoint: no metadata.json and none of the files a save writes "
            "(a run directory? verify one of the checkpoints in it)"
        )
    for problem in report.problems:
        print(problem)
    for note in report.notes:
        print(f"note: {note}")
    summary = f"{counted(report.files_checked, 'file')}, {human_bytes(report.bytes_checked)} checked"
    if not report.ok:
        raise CommandFailed(f"{args.dir}: {counted(len(report.problems), 'problem')} ({summary})")
    print(f"OK: {args.dir} ({', '.join(report.backends)}): {summary}")
    return EXIT_OK


def _verify_hf_folder(args: argparse.Namespace) -> int:
    """Check a HuggingFace folder as far as it can be: it records no checksums, so its index and
    every file's header are checked against the files (dtypes, shapes, byte ranges that tile each
    file, file sizes: a truncated or garbled file is found), and the output says the tensor data
    itself was not checked."""
    from pathlib import Path

    from dist_ckpt.errors import CheckpointingException
    from dist_ckpt.hf.folder import open_folder

    files: List[str] = []
    try:
        folder = open_folder(args.dir)
        files = sorted(set(folder.weight_map.values()))
        folder.tensor_index()  # reads and validates every header, and the index against them
        problem = ""
    except CheckpointingException as e:
        problem = str(e)
    nbytes = sum(p.stat().st_size for p in (Path(args.dir) / f for f in files) if p.is_file())
    if args.json:
        print_json(
            {
                "checkpoint": args.dir,
                "kind": "hf",
                "ok": not problem,
                "found": True,
                "checksums": False,
                "problems": [problem] if problem else [],
                "files_checked": len(files),
                "bytes_checked": nbytes,
            }
        )
        return EXIT_FAILURE if problem else EXIT_OK
    if problem:
        raise CommandFailed(f"{args.dir} (HuggingFace folder): {problem}")
    print(
        f"OK: {args.dir} (HuggingFace folder): {counted(len(files), 'file')}, {human_bytes(nbytes)}, headers checked "
        "(index, dtypes, shapes, byte ranges, file sizes); a HuggingFace folder holds no checksums, so the tensor "
        "data itself was not checked"
    )
    return EXIT_OK
