"""``dist-ckpt convert``: a checkpoint in another backend, one tensor in memory at a time."""

from __future__ import annotations

import argparse
import logging
from typing import Tuple, Union

from dist_ckpt.cli.common import (
    EXIT_OK,
    SubParsers,
    add_engine_option,
    add_progress_option,
    backend_arg,
    human_bytes,
    human_rate,
    print_json,
    progress_enabled,
    require_directory,
    size_arg,
    use_engine,
)
from dist_ckpt.errors import counted

__all__ = ["add_convert_command"]


def _target(text: str) -> Union[str, Tuple[str, int]]:
    from dist_ckpt.tools.convert import HF_TARGET

    return HF_TARGET if text.strip().lower() == HF_TARGET else backend_arg(text)


class _DropNotesPrintedBelow(logging.Filter):
    """Drops the library's warning about what a HuggingFace folder cannot hold: the command
    prints the same facts once, as ``note:`` lines of its report."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("converting %s to a HuggingFace folder drops")


def add_convert_command(subparsers: SubParsers, common: argparse.ArgumentParser) -> None:
    """Declare ``dist-ckpt convert``."""
    p = subparsers.add_parser(
        "convert",
        parents=[common],
        help="write a checkpoint again in another backend (safetensors, zarr, torch_dist, hf), tensor by tensor",
        description=(
            "Read every tensor of the checkpoint SRC (any backend, saved by any number of ranks, "
            "a HuggingFace folder, or a torch.distributed.checkpoint directory) and write it to DST in the "
            "backend --to: a dist_ckpt backend (safetensors, zarr, torch_dist; NAME or NAME:VERSION) with the "
            "common state and every "
            "ShardedObject, or 'hf' for a HuggingFace folder (tensors only). One tensor is in memory "
            "at a time, so memory stays bounded by the largest tensor; no process group is needed. "
            "metadata.json is written last: an interrupted conversion is never a checkpoint, and a "
            "failed one removes what it wrote."
        ),
    )
    p.add_argument(
        "src",
        metavar="SRC",
        help="a committed checkpoint, a HuggingFace folder or a torch.distributed.checkpoint directory: a directory "
        "or s3://bucket/prefix",
    )
    p.add_argument(
        "dst",
        metavar="DST",
        help="the new checkpoint: a directory that does not exist or is empty, or an "
        "empty s3://bucket/prefix (--to safetensors only)",
    )
    p.add_argument(
        "--to",
        type=_target,
        required=True,
        metavar="BACKEND",
        help="target backend: safetensors, zarr, torch_dist, NAME:VERSION, or hf (case-insensitive)",
    )
    p.add_argument(
        "--max-shard-size",
        type=size_arg,
        default=2**31,
        metavar="SIZE",
        help="with --to hf: most bytes per file, e.g. 5GB (default: 2GiB)",
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="read a common state and ShardedObjects (and a DCP .metadata) that need full pickle (runs code "
        "from SRC: only for checkpoints you trust)",
    )
    p.add_argument("--json", action="store_true", help="print what was done as one JSON document")
    # TensorStore's save strategy writes whole state dicts, not tensor by tensor: a zarr target
    # is written by zarr-python (the same layout), a zarr source is read by the engine chosen
    add_engine_option(
        p,
        "library that reads a zarr SRC: zarr-python (default) or tensorstore; a zarr DST is "
        "written by zarr-python, tensor by tensor, in the layout both read",
    )
    add_progress_option(p)
    p.set_defaults(run=run_convert_command, parser=p)


def run_convert_command(args: argparse.Namespace) -> int:
    """Convert, with a progress bar in bytes, and print what was written."""
    from dist_ckpt.cli.progress import ProgressBars
    from dist_ckpt.tools.convert import convert, trusting_strategies  # keeps `dist-ckpt --help` fast

    require_directory(args.src)
    use_engine(args.engine, include_save=False)  # before convert picks the zarr load strategy
    # --allow-pickle trusts every loader of SRC that can unpickle (common state, ShardedObjects, DCP .metadata)
    sharded_strategy, common_strategy = trusting_strategies(args.src) if args.allow_pickle else (None, None)
    quiet_notes = _DropNotesPrintedBelow()
    convert_logger = logging.getLogger(convert.__module__)  # the logger of dist_ckpt.tools.convert
    convert_logger.addFilter(quiet_notes)
    try:
        with ProgressBars(progress_enabled(args), "converting") as bars:
            result = convert(
                args.src,
                args.dst,
                args.to,
                max_shard_size=args.max_shard_size,
                common_strategy=common_strategy,
                sharded_strategy=sharded_strategy,
                progress=bars,
            )
    finally:
        convert_logger.removeFilter(quiet_notes)
    if args.json:
        print_json(result.to_json())
        return EXIT_OK
    report = result.report
    carried = (
        f"; common state ({counted(result.common_keys, 'key')}) and {counted(result.sharded_objects, 'ShardedObject')} "
        "copied"
        if result.target_backend != "hf"
        else ""
    )
    files = "" if report.files is None else f": {counted(report.files, 'file')}, {human_bytes(report.file_bytes or 0)}"
    engine = f" (read with {args.engine})" if result.source_backend.startswith("zarr:") else ""
    print(
        f"dist-ckpt convert: {counted(result.tensors, 'tensor')}, {human_bytes(report.total_nbytes)}, "
        f"{result.source_backend}{engine} -> {result.target_backend}"
    )
    print(f"  from {result.source}")
    print(f"  to   {result.destination}{files}{carried}")
    print(f"  in {report.max_seconds:.2f} s ({human_rate(report.total_nbytes, report.max_seconds)})")
    for note in result.dropped:  # with --json, the document lists them
        print(f"note: not copied (a HuggingFace folder holds tensors only): {note}")
    return EXIT_OK
