"""``dist-ckpt export-hf``: every tensor of a checkpoint into a HuggingFace safetensors folder."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional

from dist_ckpt.cli.common import (
    EXIT_OK,
    SubParsers,
    add_progress_option,
    human_bytes,
    human_rate,
    print_json,
    progress_enabled,
    require_directory,
    size_arg,
)
from dist_ckpt.errors import counted

if TYPE_CHECKING:
    from dist_ckpt.hf.export import ExportResult

__all__ = ["add_export_hf_command"]


def add_export_hf_command(subparsers: SubParsers, common: argparse.ArgumentParser) -> None:
    """Declare ``dist-ckpt export-hf``.

    Long by nature: one declaration per option, each with its help text; nothing to factor out.
    """
    p = subparsers.add_parser(
        "export-hf",
        parents=[common],
        help="write the model weights of a checkpoint into a HuggingFace safetensors folder",
        description=(
            "Assemble the model weights of the checkpoint SRC (any backend, saved by any number of "
            "ranks) and write them to the HuggingFace folder DST: model.safetensors, or shard files "
            "of at most --max-shard-size bytes plus model.safetensors.index.json, the layout "
            "transformers' from_pretrained reads. By default optimizer state is left out (keys under "
            "optimizer., optim., or with a part named exp_avg, exp_avg_sq, momentum_buffer, fp32_param, "
            "...), and so is the common state; --include / --exclude choose otherwise. Keys are "
            "written as stored unless --rename maps prefixes (a checkpoint of save_model_and_optim_state "
            "stores model.<parameter name>: --rename model.= gives the module's own names). --config "
            "copies the model's config.json beside the weights. One tensor is in memory at a time; "
            "no process group is needed."
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
    p.add_argument(
        "--include",
        action="append",
        default=None,
        metavar="PATTERN",
        help="export the stored keys matching this shell pattern (repeatable), e.g. 'decoder.*'; "
        "replaces the default (every key but optimizer state); '*' exports everything",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="PATTERN",
        help="leave out the stored keys matching this shell pattern (repeatable), e.g. '*._extra_state'",
    )
    p.add_argument(
        "--rename",
        action="append",
        default=[],
        type=_rename_arg,
        metavar="OLD=NEW",
        help="write keys starting with the dot-separated prefix OLD as NEW + the rest (repeatable; "
        "the longest OLD wins), e.g. model.= or decoder.=model.layers.",
    )
    p.add_argument(
        "--rename-file",
        type=_rename_file_arg,
        default=None,
        metavar="JSON",
        help="a JSON object {OLD: NEW} of prefixes, as --rename (merged with it; --rename wins)",
    )
    p.add_argument(
        "--config",
        type=_config_arg,
        default=None,
        metavar="PATH",
        help="the model's config.json, copied into DST as config.json (for from_pretrained)",
    )
    p.add_argument("--json", action="store_true", help="print what was written as one JSON document")
    add_progress_option(p)
    p.set_defaults(run=run_export_hf_command, parser=p)


def _rename_arg(text: str) -> Dict[str, str]:
    old, sep, new = text.partition("=")
    if not sep or not old:
        raise argparse.ArgumentTypeError(f"expected OLD=NEW (a key prefix and its replacement), got {text!r}")
    return {old: new}


def _json_object(path_text: str, what: str) -> Dict[str, object]:
    try:
        doc = json.loads(Path(path_text).read_text(encoding="utf-8"))
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {what} {path_text!r}: {e.strerror or e}") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{what} {path_text!r} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise argparse.ArgumentTypeError(f"{what} {path_text!r} holds a JSON {type(doc).__name__}, not an object")
    return doc


def _rename_file_arg(text: str) -> Dict[str, str]:
    doc = _json_object(text, "the rename file")
    if not all(isinstance(v, str) for v in doc.values()):
        raise argparse.ArgumentTypeError(f"the rename file {text!r} must map strings to strings")
    return {str(k): str(v) for k, v in doc.items()}


def _config_arg(text: str) -> str:
    _json_object(text, "the config")  # checked here: a bad file is a usage error (exit 2)
    return text


def _rename_map(args: argparse.Namespace) -> Optional[Dict[str, str]]:
    merged: Dict[str, str] = dict(args.rename_file or {})
    for one in args.rename:
        merged.update(one)
    return merged or None


def run_export_hf_command(args: argparse.Namespace) -> int:
    """Export, with a progress bar in bytes."""
    from dist_ckpt.hf.export import export  # keeps `dist-ckpt --help` fast
    from dist_ckpt.hf.select import select_keys
    from dist_ckpt.tools.unshard import unsharded_metadata

    require_directory(args.src)
    bar = None
    if progress_enabled(args):
        from dist_ckpt.cli.progress import byte_bar

        _, tensors = unsharded_metadata(args.src)
        chosen = select_keys(sorted(tensors), args.include, args.exclude)
        total = sum(math.prod(tensors[k].global_shape) * tensors[k].dtype.itemsize for k in chosen)
        bar = byte_bar(total, "exporting tensors")

    def on_tensor(key: str, nbytes: int) -> None:
        if bar is not None:
            bar.update(nbytes)
            bar.set_postfix_str(key, refresh=False)

    start = time.perf_counter()
    try:
        result = export(
            args.src,
            args.dst,
            max_shard_size=args.max_shard_size,
            include=args.include,
            exclude=args.exclude,
            rename=_rename_map(args),
            config=args.config,
            on_tensor=on_tensor,
        )
    finally:
        if bar is not None:
            bar.close()
    _print_export(args, result, start)
    return EXIT_OK


def _print_export(args: argparse.Namespace, result: ExportResult, start: float) -> None:
    """Report a finished export: JSON with --json, else a summary and what was renamed and left out."""
    seconds = time.perf_counter() - start
    if args.json:
        print_json(
            {
                "source": str(args.src),
                "directory": str(result.directory),
                "files": list(result.files),
                "index": result.index,
                "config": result.config,
                "tensors": result.tensors,
                "nbytes": result.total_bytes,
                "seconds": seconds,
                "left_out": list(result.left_out),
                "renamed": result.names or {},
            }
        )
        return
    files = len(result.files)
    extra: List[str] = [result.index] if result.index else []
    extra += [result.config] if result.config else []
    print(
        f"dist-ckpt export-hf: {counted(result.tensors, 'tensor')}, {human_bytes(result.total_bytes)}, from {args.src}"
    )
    print(
        f"  to {result.directory}: {counted(files, 'file')}"
        + "".join(f" + {name}" for name in extra)
        + f", in {seconds:.2f} s ({human_rate(result.total_bytes, seconds)})"
    )
    if result.names:
        print(
            f"  renamed {counted(len(result.names), 'key')}, e.g. {next(iter(result.names.items()))[0]} -> "
            f"{next(iter(result.names.items()))[1]}"
        )
    if result.left_out:
        shown = ", ".join(result.left_out[:3]) + (
            f" and {len(result.left_out) - 3} more" if len(result.left_out) > 3 else ""
        )
        print(
            f"note: left out {counted(len(result.left_out), 'stored tensor')} (optimizer state, or by "
            "--include/--exclude): "
            f"{shown}; the common state is never exported"
        )
