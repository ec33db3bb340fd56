"""``dist-ckpt export-hf``: every tensor of a checkpoint into a HuggingFace safetensors folder."""

from __future__ import annotations

import argparse
import math
import time

from dist_ckpt.cli.common import (
    EXIT_OK,
    SubParsers,
    add_progress_option,
    human_bytes,
    print_json,
    progress_enabled,
    size_arg,
)

__all__ = ["add_export_hf_command"]


def add_export_hf_command(subparsers: SubParsers, common: argparse.ArgumentParser) -> None:
    """Declare ``dist-ckpt export-hf``."""
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
    p.add_argument(
        "src",
        metavar="SRC",
        help="a committed dist_ckpt checkpoint (any backend, torch_dist of Megatron-Core included) or a "
        "torch.distributed.checkpoint directory: a directory or s3://bucket/prefix",
    )
    p.add_argument("dst", metavar="DST", help="the local folder to write (must not hold HF weights yet)")
    p.add_argument(
        "--max-shard-size",
        type=size_arg,
        default=2**31,
        metavar="SIZE",
        help="most bytes per file, e.g. 5GB or 2GiB (default: 2GiB)",
    )
    p.add_argument("--json", action="store_true", help="print what was written as one JSON document")
    add_progress_option(p)
    p.set_defaults(run=run_export_hf_command, parser=p)


def run_export_hf_command(args: argparse.Namespace) -> int:
    """Export, with a progress bar in bytes."""
    from dist_ckpt.hf.export import export  # keeps `dist-ckpt --help` fast
    from dist_ckpt.tools.unshard import unsharded_metadata

    bar = None
    if progress_enabled(args):
        from tqdm import tqdm

        _, tensors = unsharded_metadata(args.src)
        total = sum(math.prod(t.global_shape) * t.dtype.itemsize for t in tensors.values())
        bar = tqdm(
            total=total, desc="exporting tensors", unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True
        )

    def on_tensor(key: str, nbytes: int) -> None:
        if bar is not None:
            bar.update(nbytes)
            bar.set_postfix_str(key, refresh=False)

    start = time.perf_counter()
    try:
        result = export(args.src, args.dst, max_shard_size=args.max_shard_size, on_tensor=on_tensor)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - start
    if args.json:
        print_json(
            {
                "source": str(args.src),
                "directory": str(result.directory),
                "files": list(result.files),
                "index": result.index,
                "tensors": result.tensors,
                "nbytes": result.total_bytes,
                "seconds": seconds,
            }
        )
        return EXIT_OK
    files = len(result.files)
    print(f"dist-ckpt export-hf: {result.tensors} tensors, {human_bytes(result.total_bytes)}, from {args.src}")
    print(
        f"  to {result.directory}: {files} file{'s' if files != 1 else ''}"
        + (f" + {result.index}" if result.index else "")
        + f", in {seconds:.2f} s"
    )
    return EXIT_OK
