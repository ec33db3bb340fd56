"""``dist-ckpt convert``: a checkpoint in another backend, one tensor in memory at a time."""

from __future__ import annotations

import argparse
from typing import Tuple, Union

from dist_ckpt.cli.common import (
    EXIT_OK,
    SubParsers,
    add_progress_option,
    backend_arg,
    human_bytes,
    print_json,
    progress_enabled,
    size_arg,
)

__all__ = ["add_convert_command"]


def _target(text: str) -> Union[str, Tuple[str, int]]:
    from dist_ckpt.tools.convert import HF_TARGET

    return HF_TARGET if text == HF_TARGET else backend_arg(text)


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
        help="target backend: safetensors, zarr, torch_dist, NAME:VERSION, or hf",
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
    add_progress_option(p)
    p.set_defaults(run=run_convert_command, parser=p)


def run_convert_command(args: argparse.Namespace) -> int:
    """Convert, with a progress bar in bytes, and print what was written."""
    from dist_ckpt.cli.progress import ProgressBars
    from dist_ckpt.tools.convert import convert, trusting_strategies  # keeps `dist-ckpt --help` fast

    sharded_strategy, common_strategy = trusting_strategies(args.src) if args.allow_pickle else (None, None)
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
    if args.json:
        print_json(result.to_json())
        return EXIT_OK
    report = result.report
    carried = (
        f"; common state ({result.common_keys} keys) and {result.sharded_objects} ShardedObjects copied"
        if result.target_backend != "hf"
        else ""
    )
    files = "" if report.files is None else f": {report.files} files, {human_bytes(report.file_bytes or 0)}"
    print(
        f"dist-ckpt convert: {result.tensors} tensors, {human_bytes(report.total_nbytes)}, "
        f"{result.source_backend} -> {result.target_backend}"
    )
    print(f"  from {result.source}")
    print(f"  to   {result.destination}{files}{carried}")
    print(f"  in {report.max_seconds:.2f} s ({report.gb_per_s:.3g} GB/s)")
    for note in result.dropped:
        print(f"note: not copied (a HuggingFace folder holds tensors only): {note}")
    return EXIT_OK
