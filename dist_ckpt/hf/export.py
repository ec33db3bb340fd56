"""Export any checkpoint to a HuggingFace folder, streaming one tensor at a time.

Every stored tensor is assembled whole from its shards (by the checkpoint's own load strategy,
see :mod:`dist_ckpt.tools.unshard`) and written into ``model.safetensors`` -- or into shard files of
at most ``max_shard_size`` bytes plus ``model.safetensors.index.json`` -- then freed before the
next one is read: memory for one tensor suffices, whatever the size of the state. Runs in one
process without a process group; the CLI runs it as ``dist-ckpt export-hf SRC DST``. The source
may be on an object store (``s3://bucket/prefix``: each tensor's bytes are fetched with ranged
GETs); the destination is a local folder.

Keys are written as they are stored (Megatron-style names stay Megatron-style; renaming to a
particular transformers architecture is a model-specific step). Stacked layers (prepended
axes) are exported as one stacked tensor.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from dist_ckpt.backends.safetensors import SafetensorsFileWriter
from dist_ckpt.errors import CheckpointExistsError
from dist_ckpt.hf.folder import has_hf_weights
from dist_ckpt.hf.index import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    plan_shards,
    save_shard_index,
    shard_file_name,
)
from dist_ckpt.storage.location import LocationLike, require_local, resolve_location
from dist_ckpt.tools.unshard import iter_with, unsharded_metadata

__all__ = ["ExportResult", "export"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export` wrote.

    Attributes:
        directory: the HuggingFace folder.
        files: weight files written, in order (``model.safetensors``, or shard files).
        index: the index file, or None for a single file.
        tensors: number of tensors.
        total_bytes: bytes of tensor data.
    """

    directory: Path
    files: Tuple[str, ...]
    index: Optional[str]
    tensors: int
    total_bytes: int


def export(
    src: LocationLike,
    dst: Union[str, Path],
    max_shard_size: int = 2**31,
    metadata: Optional[Dict[str, Any]] = None,
    device: Union[str, torch.device] = "cpu",
    *,
    on_tensor: Optional[Callable[[str, int], None]] = None,
) -> ExportResult:
    """Write every tensor of checkpoint ``src`` into the HuggingFace folder ``dst``.

    Steps: 1. read ``src``'s metadata (shapes and dtypes; no tensor data) and refuse a ``dst``
    that already holds HF weights; 2. plan files of at most ``max_shard_size`` bytes (keys in
    sorted order); 3. for each file, declare its tensors, then assemble and write them one at a
    time, fsync, and rename the file into place; 4. write the index last (when there are
    several files), so an interrupted export never looks complete.

    Args:
        src: a committed dist_ckpt checkpoint of any backend (a directory, an ``s3://`` URL or a
            storage), or an HF folder.
        dst: the local folder to create (it may exist but must not hold HF weights).
        max_shard_size: most bytes per file (a larger tensor gets a file of its own).
        metadata: extra JSON-serializable entries of the index metadata.
        device: where tensors are assembled (``"cuda"`` to use GPU memory instead of host).
        on_tensor: called with ``(key, bytes)`` after each tensor is written (for progress).

    Raises:
        CheckpointExistsError: ``dst`` already holds HuggingFace weights.
        IncompatibleStrategyError: ``dst`` is an object-store URL (export to a local folder,
            then upload it).

    Example::

        result = export("ckpt/iter_1000", "hf/iter_1000", max_shard_size=5 * 10**9)
        # then: safetensors.torch.load_file("hf/iter_1000/model-00001-of-00003.safetensors")
    """
    out = require_local(resolve_location(dst), "export-hf's destination")
    source = resolve_location(src)
    # 1. metadata, destination
    strategy, tensors = unsharded_metadata(source)
    if has_hf_weights(out):
        raise CheckpointExistsError(f"{str(out)!r} already holds HuggingFace weights; export to a new folder")
    out.mkdir(parents=True, exist_ok=True)
    sizes = [(key, math.prod(tensors[key].global_shape) * tensors[key].dtype.itemsize) for key in sorted(tensors)]
    complex_keys = [k for k in tensors if tensors[k].dtype == torch.complex128]
    if complex_keys:
        logger.warning(
            "safetensors has no complex128: %s are written as float64 with a trailing axis of 2 (real, imaginary)",
            complex_keys,
        )
    # 2. plan the files
    shards = plan_shards(sizes, max_shard_size) if sizes else [[]]
    names = [SAFE_WEIGHTS_NAME] if len(shards) == 1 else [shard_file_name(i, len(shards)) for i in range(len(shards))]
    # 3. stream the tensors into each file
    for file, keys in zip(names, shards):
        layout = [(k, tensors[k].dtype, tensors[k].global_shape) for k in keys]
        with SafetensorsFileWriter(out / file, layout, {"format": "pt"}, atomic=True) as writer:
            for key, tensor in iter_with(strategy, tensors, keys, source, device):
                writer.write(tensor)
                nbytes = tensor.numel() * tensor.element_size()
                del tensor  # free it before the next one is assembled
                if on_tensor is not None:
                    on_tensor(key, nbytes)
        logger.info("wrote %s: %d tensors, %d bytes", out / file, len(keys), writer.size)
    # 4. the index, last
    total = sum(n for _, n in sizes)
    index_name: Optional[str] = None
    if len(names) > 1:
        index_metadata: Dict[str, Any] = {"total_size": total}
        index_metadata.update(metadata or {})
        weight_map = {k: file for file, keys in zip(names, shards) for k in keys}
        save_shard_index({"metadata": index_metadata, "weight_map": weight_map}, out, SAFE_WEIGHTS_INDEX_NAME)
        index_name = SAFE_WEIGHTS_INDEX_NAME
    files: List[str] = list(names)
    return ExportResult(out, tuple(files), index_name, len(sizes), total)
