"""Export any checkpoint to a HuggingFace folder, streaming one tensor at a time.

Every stored tensor is assembled whole from its shards (by the checkpoint's own load strategy,
see [`dist_ckpt.tools.unshard`][dist_ckpt.tools.unshard]) and written into ``model.safetensors`` -- or into shard files
of at most ``max_shard_size`` bytes plus ``model.safetensors.index.json`` -- then freed before the
next one is read: memory for one tensor suffices, whatever the size of the state. Runs in one
process without a process group; the CLI runs it as ``dist-ckpt export-hf SRC DST``. The source
may be on an object store (``s3://bucket/prefix``: each tensor's bytes are fetched with ranged
GETs); the destination is a local folder.

What is exported (`dist_ckpt.hf.select`): by default the model weights only -- optimizer
state (Adam moments, fp32 master copies, ...) is left out, and so is the common state, which a
HuggingFace folder cannot hold; ``include`` / ``exclude`` shell patterns choose otherwise. Keys
are written as stored unless ``rename`` maps prefixes (``{"model.": ""}`` for a checkpoint of
``save_model_and_optim_state``); ``config`` (a ``config.json`` path or a dict) is copied into
the folder, so ``transformers``' ``from_pretrained`` finds the model's configuration beside the
weights. Stacked layers (prepended axes) are exported as one stacked tensor.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from dist_ckpt.backends.safetensors import SafetensorsFileWriter
from dist_ckpt.errors import CheckpointExistsError, CheckpointingException, KeyMismatchError
from dist_ckpt.hf.folder import has_hf_weights
from dist_ckpt.hf.index import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    plan_shards,
    save_shard_index,
    shard_file_name,
)
from dist_ckpt.hf.select import rename_keys, select_keys
from dist_ckpt.storage import write_bytes_atomic
from dist_ckpt.storage.location import LocationLike, require_local, resolve_location
from dist_ckpt.tools.unshard import iter_with, unsharded_metadata

#: the model configuration file ``from_pretrained`` reads beside the weights
CONFIG_NAME = "config.json"

__all__ = ["CONFIG_NAME", "ExportResult", "export"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportResult:
    """What `export()` wrote.

    Attributes:
        directory: the HuggingFace folder.
        files: weight files written, in order (``model.safetensors``, or shard files).
        index: the index file, or None for a single file.
        tensors: number of tensors.
        total_bytes: bytes of tensor data.
        left_out: stored keys that were not exported (optimizer state by default, or what the
            include / exclude patterns left out), sorted.
        names: ``{stored key: exported name}`` of every key whose name the rename map changed.
        config: the config file written (``"config.json"``), or None.
    """

    directory: Path
    files: Tuple[str, ...]
    index: Optional[str]
    tensors: int
    total_bytes: int
    left_out: Tuple[str, ...] = ()
    names: Optional[Dict[str, str]] = None
    config: Optional[str] = None


def export(
    src: LocationLike,
    dst: Union[str, Path],
    max_shard_size: int = 2**31,
    metadata: Optional[Dict[str, Any]] = None,
    device: Union[str, torch.device] = "cpu",
    *,
    include: Optional[Sequence[str]] = None,
    exclude: Sequence[str] = (),
    rename: Optional[Mapping[str, str]] = None,
    config: Union[str, Path, Mapping[str, Any], None] = None,
    on_tensor: Optional[Callable[[str, int], None]] = None,
) -> ExportResult:
    """Write the model weights of checkpoint ``src`` into the HuggingFace folder ``dst``.

    Long on purpose: choosing keys, renaming, sharding into files and writing the index and config
    are one pass over the tensors, written in the order they happen.

    Steps: 1. read ``src``'s metadata (shapes and dtypes; no tensor data), pick the keys and
    their names, and refuse a ``dst`` that already holds HF weights; 2. write ``config.json``
    when ``config`` is given; 3. plan files of at most ``max_shard_size`` bytes (names in sorted
    order); 4. for each file, declare its tensors, then assemble and write them one at a time,
    fsync, and rename the file into place; 5. write the index last (when there are several
    files), so an interrupted export never looks complete.

    Args:
        src: a committed dist_ckpt checkpoint of any backend (a directory, an ``s3://`` URL or a
            storage), or an HF folder.
        dst: the local folder to create (it may exist but must not hold HF weights).
        max_shard_size: most bytes per file (a larger tensor gets a file of its own).
        metadata: extra JSON-serializable entries of the index metadata.
        device: where tensors are assembled (``"cuda"`` to use GPU memory instead of host).
        include: shell patterns of the stored keys to export; None (default) exports every key
            that is not optimizer state
            ([`dist_ckpt.hf.select.is_optimizer_key()`][dist_ckpt.hf.select.is_optimizer_key]), ``["*"]`` everything.
        exclude: shell patterns of stored keys to leave out (after ``include``).
        rename: ``{old prefix: new prefix}`` of whole dot-separated key parts, longest first
            ([`dist_ckpt.hf.select.rename_keys()`][dist_ckpt.hf.select.rename_keys]); e.g. ``{"model.": ""}``.
        config: the model's ``config.json`` (a path to a JSON file, or a dict), written into
            ``dst`` as ``config.json``.
        on_tensor: called with ``(key, bytes)`` after each tensor is written (for progress).

    Raises:
        CheckpointExistsError: ``dst`` already holds HuggingFace weights, or a ``config.json``
            other than ``config``.
        CheckpointingException: ``config`` is not a readable JSON object (naming the file).
        InvalidKeyError: the rename map gives two keys one name.
        KeyMismatchError: no key is left to export (naming the patterns).
        IncompatibleStrategyError: ``dst`` is an object-store URL (export to a local folder,
            then upload it).

    Example:

    ```python
    result = export("ckpt/iter_1000", "hf/iter_1000", max_shard_size=5 * 10**9,
                    rename={"model.": ""}, config="configs/gpt.json")
    # then: safetensors.torch.load_file("hf/iter_1000/model-00001-of-00003.safetensors")
    ```
    """
    out = require_local(resolve_location(dst), "export-hf's destination")
    source = resolve_location(src)
    # 1. metadata, selection, names, destination
    strategy, tensors = unsharded_metadata(source)
    keys = select_keys(sorted(tensors), include, exclude)
    _require_keys(keys, sorted(tensors), include, exclude, src)
    names = rename_keys(keys, rename)
    config_text = None if config is None else _config_text(config)
    if has_hf_weights(out):
        raise CheckpointExistsError(f"{str(out)!r} already holds HuggingFace weights; export to a new folder")
    if config_text is not None and (out / CONFIG_NAME).exists() and (out / CONFIG_NAME).read_text() != config_text:
        raise CheckpointExistsError(
            f"{str(out / CONFIG_NAME)!r} exists and differs from the config to write; export to a new folder"
        )
    out.mkdir(parents=True, exist_ok=True)
    sizes = sorted((names[key], math.prod(tensors[key].global_shape) * tensors[key].dtype.itemsize) for key in keys)
    source_of = {name: key for key, name in names.items()}
    complex_keys = [k for k in keys if tensors[k].dtype == torch.complex128]
    if complex_keys:
        logger.warning(
            "safetensors has no complex128: %s are written as float64 with a trailing axis of 2 (real, imaginary)",
            complex_keys,
        )
    # 2. the configuration
    if config_text is not None:
        write_bytes_atomic(out / CONFIG_NAME, config_text.encode("utf-8"))
    # 3. plan the files
    shards = plan_shards(sizes, max_shard_size) if sizes else [[]]
    files = [SAFE_WEIGHTS_NAME] if len(shards) == 1 else [shard_file_name(i, len(shards)) for i in range(len(shards))]
    # 4. stream the tensors into each file
    for file, file_names in zip(files, shards):
        layout = [(n, tensors[source_of[n]].dtype, tensors[source_of[n]].global_shape) for n in file_names]
        with SafetensorsFileWriter(out / file, layout, {"format": "pt"}, atomic=True) as writer:
            for key, tensor in iter_with(strategy, tensors, [source_of[n] for n in file_names], source, device):
                writer.write(tensor)
                nbytes = tensor.numel() * tensor.element_size()
                del tensor  # free it before the next one is assembled
                if on_tensor is not None:
                    on_tensor(key, nbytes)
        logger.info("wrote %s: %d tensors, %d bytes", out / file, len(file_names), writer.size)
    # 5. the index, last
    total = sum(n for _, n in sizes)
    index_name: Optional[str] = None
    if len(files) > 1:
        index_metadata: Dict[str, Any] = {"total_size": total}
        index_metadata.update(metadata or {})
        weight_map = {n: file for file, file_names in zip(files, shards) for n in file_names}
        save_shard_index({"metadata": index_metadata, "weight_map": weight_map}, out, SAFE_WEIGHTS_INDEX_NAME)
        index_name = SAFE_WEIGHTS_INDEX_NAME
    left_out = tuple(sorted(set(tensors) - set(keys)))
    renamed = {k: n for k, n in names.items() if k != n}
    written: List[str] = list(files)
    return ExportResult(
        out,
        tuple(written),
        index_name,
        len(sizes),
        total,
        left_out,
        renamed,
        CONFIG_NAME if config_text is not None else None,
    )


def _require_keys(
    keys: List[str], stored: List[str], include: Optional[Sequence[str]], exclude: Sequence[str], src: LocationLike
) -> None:
    """Refuse an export that would write no tensor although the checkpoint has some."""
    if keys or not stored:
        return
    chosen = f"include {list(include)}" if include is not None else "the default (model weights, no optimizer state)"
    raise KeyMismatchError(
        f"no tensor of {str(src)!r} is selected by {chosen}"
        + (f" and exclude {list(exclude)}" if exclude else "")
        + f"; stored keys include {stored[:5]}: adjust the patterns (include ['*'] exports everything)"
    )


def _config_text(config: Union[str, Path, Mapping[str, Any]]) -> str:
    """The text of ``config.json``: a file's own text once checked to be a JSON object, or a dict
    written as JSON."""
    if isinstance(config, Mapping):
        return json.dumps(dict(config), indent=2, sort_keys=True) + "\n"
    path = Path(config)
    try:
        text = path.read_text(encoding="utf-8")
        doc = json.loads(text)
    except OSError as e:
        raise CheckpointingException(f"cannot read the config {str(path)!r}: {e.strerror or e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointingException(f"the config {str(path)!r} is not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise CheckpointingException(f"the config {str(path)!r} is a JSON {type(doc).__name__}, not an object")
    return text
