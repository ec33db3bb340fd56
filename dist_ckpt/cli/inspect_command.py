"""``dist-ckpt inspect``: what a checkpoint holds and how each tensor is stored."""

from __future__ import annotations

import argparse
import fnmatch
from dataclasses import replace
from typing import TYPE_CHECKING, List, Sequence

from dist_ckpt.cli.common import (
    EXIT_OK,
    SubParsers,
    elide,
    format_table,
    human_bytes,
    print_json,
    require_directory,
    table_width,
    terminal_width,
)
from dist_ckpt.errors import counted

if TYPE_CHECKING:
    from dist_ckpt.training.checkpoints import RunCheckpoint

__all__ = ["add_inspect_command"]


def add_inspect_command(subparsers: SubParsers, common: argparse.ArgumentParser) -> None:
    """Declare ``dist-ckpt inspect``."""
    p = subparsers.add_parser(
        "inspect",
        parents=[common],
        help="list the tensors, common state and files of a checkpoint and how each tensor is stored",
        description=(
            "Describe the checkpoint DIR (any dist_ckpt backend, or a HuggingFace folder) from its "
            "metadata alone, without reading tensor data or needing a process group: backend and "
            "version, the ranks that saved it, every tensor's global shape, dtype and size, how it "
            "is stored (number of stored shards, chunk shape or flattened ranges, files), the keys "
            "of the common state and the ShardedObjects. On a terminal (or with $COLUMNS set) the "
            "layout column wraps to fit its width, and keys too long to share a line with the other "
            "columns get lines of their own; keys are always shown whole."
        ),
    )
    p.add_argument(
        "dir",
        metavar="DIR",
        help="a committed checkpoint, a HuggingFace folder, a torch.distributed.checkpoint directory, or a run's "
        "directory of checkpoints (listed with their steps and metrics): a directory, or s3://bucket/prefix "
        "(credentials and endpoint from the AWS environment variables)",
    )
    p.add_argument(
        "--keys",
        metavar="PATTERN",
        default=None,
        help="only tensors whose key matches this shell pattern, e.g. 'decoder.layers.0.*'",
    )
    p.add_argument(
        "--shards",
        action="store_true",
        help="also list every stored shard: offset, shape or flattened range, file, bytes",
    )
    p.add_argument("--json", action="store_true", help="print everything as one JSON document")
    p.set_defaults(run=run_inspect_command, parser=p)


_KIND_NAMES = {"hf": "HuggingFace folder", "dcp": "torch.distributed.checkpoint directory (no metadata.json)"}


#: the column of the tensor table that wraps when the terminal is narrow (keys never shrink)
_LAYOUT = 5
#: narrower than this, the layout column would wrap over three lines or more: each key gets a
#: line of its own instead ("4 flattened ranges of" / "chunks [1, 42]" still reads as one)
_LAYOUT_MIN_WIDTH = 22


def _shape(shape: Sequence[int]) -> str:
    return f"[{', '.join(map(str, shape))}]"


def _print_run(args: argparse.Namespace, run: Sequence["RunCheckpoint"]) -> int:
    """Describe a run directory: its complete checkpoints, oldest first, with their metrics (found
    by [`list_checkpoints()`][dist_ckpt.training.checkpoints.list_checkpoints], as a training loop
    finds them), and the directories that look like checkpoints but are not complete."""
    from dist_ckpt.storage.location import resolve_location
    from dist_ckpt.training.checkpoints import checkpoint_names

    listed = {c.name for c in run}
    partial = [name for _, name in checkpoint_names(resolve_location(args.dir)) if name not in listed]
    if args.json:
        checkpoints = [
            {"path": c.path, "name": c.name, "step": c.step, "format": c.format.value, "metrics": c.metrics}
            for c in run
        ]
        print_json({"path": args.dir, "kind": "run", "checkpoints": checkpoints, "not_complete": partial})
        return EXIT_OK
    print(f"{args.dir}: a run directory of {counted(len(run), 'complete checkpoint')}, oldest first")
    print()
    rows = [
        [
            str(c.step),
            c.name,
            c.format.value,
            ", ".join(f"{k}={v:.4g}" for k, v in c.metrics.items()) if c.metrics else "-",
        ]
        for c in run
    ]
    print(format_table(["step", "checkpoint", "format", "metrics"], rows, [True, False, False, False]))
    print()
    print(f"the latest: dist-ckpt inspect {run[-1].path}")
    if partial:
        print(f"note: not complete (a save in progress, or one that did not finish): {', '.join(partial)}")
    return EXIT_OK


def run_inspect_command(args: argparse.Namespace) -> int:
    """Inspect and print a summary, a table of tensors, the common keys and ShardedObjects.

    Long by nature: it lays the report out line by line in the order it is printed, so that the
    output can be read off the code.
    """
    from dist_ckpt.errors import NotACheckpointError
    from dist_ckpt.tools.inspection import inspect_checkpoint  # keeps `dist-ckpt --help` fast
    from dist_ckpt.training.checkpoints import list_checkpoints

    require_directory(args.dir)  # a file or a missing path: exit 2, saying which
    try:
        info = inspect_checkpoint(args.dir)
    except NotACheckpointError:
        run = list_checkpoints(args.dir)  # a run's directory of checkpoints, as training writes them
        if not run:
            raise
        return _print_run(args, run)
    if args.keys is not None:
        info = replace(info, tensors=tuple(t for t in info.tensors if fnmatch.fnmatchcase(t.key, args.keys)))
    if args.json:
        print_json(info.to_json(with_shards=args.shards))
        return EXIT_OK
    saved_by = counted(info.world_size, "rank") if info.world_size else "unknown ranks"
    writer = f", dist_ckpt {info.library_version}" if info.library_version else ""
    shards = "" if info.num_shards is None else f" in {info.num_shards} stored shards"
    files = "unknown" if info.files is None else f"{info.files}, {human_bytes(info.file_bytes or 0)} on disk"
    lines: List[str] = [
        f"{info.path}: {_KIND_NAMES.get(info.kind, 'dist_ckpt checkpoint')}",
        f"  backend   {info.sharded_backend} (common state: {info.common_backend})",
        f"  saved by  {saved_by}{writer}" if info.kind == "dist_ckpt" else "  saved by  (not recorded)",
        f"  tensors   {len(info.tensors)}{' matching ' + repr(args.keys) if args.keys else ''}, "
        f"{human_bytes(info.nbytes)}{shards}",
        f"  files     {files}",
    ]
    width = terminal_width()
    fit = (lambda text: elide(text, width)) if width else (lambda text: text)
    print("\n".join(fit(line) for line in lines))
    if info.tensors:
        rows = []
        for t in info.tensors:
            n_files = "?" if t.files is None else str(len(t.files))
            rows.append(
                [
                    t.key,
                    _shape(t.global_shape),
                    t.dtype,
                    human_bytes(t.nbytes),
                    str(t.num_shards or "?"),
                    t.layout,
                    n_files,
                ]
            )
            if args.shards and t.shards:
                for s in t.shards:
                    where = _shape(s.global_offset) + (
                        f" flat {s.flat_range[0]}:{s.flat_range[1]}" if s.flat_range else ""
                    )
                    rows.append([f"  @ {where}", _shape(s.shape), "", f"{s.nbytes:,} B", "", s.file, ""])
        headers = ["key", "shape", "dtype", "size", "shards", "layout", "files"]
        print()
        print(
            format_table(
                headers,
                rows,
                [False, False, False, True, True, False, True],
                max_width=width,
                shrink=[_LAYOUT],
                wrap=[_LAYOUT],
                # keys are what tells tensors apart: never shortened, on lines of their own if need be
                keys_on_own_lines=width is not None
                and table_width(headers, rows, [_LAYOUT], floor=_LAYOUT_MIN_WIDTH) > width,
            )
        )
    if info.common_keys:
        print()
        print(f"common state ({counted(len(info.common_keys), 'key')}):")
        for key, value in info.common_keys.items():
            print(fit(f"  {key}: {value}"))
    if info.sharded_objects:
        print()
        print(f"ShardedObjects ({len(info.sharded_objects)}):")
        for key in info.sharded_objects:
            print(f"  {key}")  # whole: the ends of two keys may be the same
    for note in info.notes:
        print(f"note: {note}")
    return EXIT_OK
