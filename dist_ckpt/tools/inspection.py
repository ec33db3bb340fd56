"""What a checkpoint holds and how it is stored, read from its metadata alone.

[`inspect_checkpoint()`][dist_ckpt.tools.inspection.inspect_checkpoint] is what ``dist-ckpt inspect DIR`` runs. It works
on committed dist_ckpt checkpoints of any registered backend and on HuggingFace folders, in one process and
without any process group, and reads no tensor data:

1. the commit record (``metadata.json``): backends and versions, how many ranks saved it, which
   dist_ckpt wrote it (a HuggingFace folder has none: it is read as backend ``hf``);
2. every stored tensor's global shape and dtype, and -- when the backend describes its layout
   ([`describe_stored_shards()`][dist_ckpt.backends.base.LoadShardedStrategy.describe_stored_shards]) -- its
   stored pieces: boxes or flattened ranges, files, bytes;
3. the common state's keys (loaded safely, ``weights_only``) and the ShardedObjects' keys;
4. the files of the checkpoint, as its storage lists them.

Example:

```python
info = inspect_checkpoint("ckpt/iter_1000")
for t in info.tensors:
    print(t.key, t.global_shape, t.dtype, t.num_shards, t.layout)
```
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from dist_ckpt.backends.base import LoadCommonStrategy, LoadShardedStrategy
from dist_ckpt.backends.stored_shards import StoredShardInfo
from dist_ckpt.engine.checks.compatibility import verify_checkpoint_and_load_strategy
from dist_ckpt.engine.monitor import count_files
from dist_ckpt.errors import CheckpointingException, UnsafeObjectError
from dist_ckpt.model.dtypes import dtype_to_name
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.record.commit import DCP_CONFIG, HF_CONFIG, CheckpointingConfig, detect_config, read_save_record
from dist_ckpt.storage import Storage
from dist_ckpt.storage.location import LocationLike, resolve_location

#: the kind of a folder loaded without ``metadata.json``, by the config it is loaded with
_KINDS: Dict[CheckpointingConfig, str] = {config: config.sharded_backend for config in (HF_CONFIG, DCP_CONFIG)}

__all__ = ["CheckpointInfo", "TensorInfo", "inspect_checkpoint"]

logger = logging.getLogger(__name__)

_REPR_CHARS = 60


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor.

    Attributes:
        key: its checkpoint key.
        dtype: dist_ckpt's dtype name (``"bfloat16"``, ...).
        global_shape: the whole tensor's shape.
        nbytes: bytes of the whole tensor.
        shards: its stored pieces, or None if the backend does not describe them.
    """

    key: str
    dtype: str
    global_shape: Tuple[int, ...]
    nbytes: int
    shards: Optional[Tuple[StoredShardInfo, ...]] = None

    @property
    def num_shards(self) -> Optional[int]:
        """Number of stored pieces (None if unknown)."""
        return None if self.shards is None else len(self.shards)

    @property
    def files(self) -> Optional[List[str]]:
        """The distinct files holding the pieces, sorted (None if unknown)."""
        return None if self.shards is None else sorted({s.file for s in self.shards})

    @property
    def layout(self) -> str:
        """How it is cut, in words: ``"whole"``, ``"4 chunks of [256, 512]"``,
        ``"6 flattened ranges of chunks [512, 512]"``, or ``"unknown"``.

        Example:

        ```python
        TensorInfo("w", "float32", (8, 4), 128, (piece_a, piece_b)).layout   # "2 chunks of [4, 4]"
        ```
        """
        if self.shards is None:
            return "unknown"
        if not self.shards:
            return "no stored bytes"
        boxes = sorted({s.shape for s in self.shards})
        box = ", ".join(f"[{', '.join(map(str, b))}]" for b in boxes)
        flat = sum(1 for s in self.shards if s.flat_range is not None)
        if flat:
            return f"{flat} flattened range{'s' if flat != 1 else ''} of chunks {box}"
        if len(self.shards) == 1 and self.shards[0].shape == self.global_shape:
            return "whole"
        return f"{len(self.shards)} chunks of {box}"

    def to_json(self, with_shards: bool = True) -> Dict[str, Any]:
        """A JSON-serializable dict; ``with_shards`` adds every stored piece."""
        doc: Dict[str, Any] = {
            "key": self.key,
            "dtype": self.dtype,
            "global_shape": list(self.global_shape),
            "nbytes": self.nbytes,
            "num_shards": self.num_shards,
            "layout": self.layout,
            "files": self.files,
        }
        if with_shards:
            doc["shards"] = None if self.shards is None else [s.to_json() for s in self.shards]
        return doc


@dataclass(frozen=True)
class CheckpointInfo:
    """Everything [`inspect_checkpoint()`][dist_ckpt.tools.inspection.inspect_checkpoint] found.

    Attributes:
        path: the checkpoint directory.
        kind: ``"dist_ckpt"`` (a committed checkpoint: ``metadata.json``), or the name of the backend a
            folder without one is read with: ``"hf"`` (a HuggingFace folder), ``"dcp"`` (a plain
            torch.distributed.checkpoint directory).
        sharded_backend: ``"name:version"`` of the tensors' format.
        common_backend: ``"name:version"`` of the common state's format.
        world_size: ranks that saved it (None if not recorded, e.g. HuggingFace).
        library_version: the dist_ckpt version that wrote it (None if not recorded).
        tensors: every stored tensor, sorted by key.
        common_keys: the common state's leaves, ``"path/to/key" -> description``.
        sharded_objects: unique keys of the stored ShardedObjects.
        files: files of the checkpoint (None if they could not be listed).
        file_bytes: their total size (None likewise).
        notes: things that could not be shown, and why.
    """

    path: str
    kind: str
    sharded_backend: str
    common_backend: str
    world_size: Optional[int]
    library_version: Optional[str]
    tensors: Tuple[TensorInfo, ...]
    common_keys: Dict[str, str] = field(default_factory=dict)
    sharded_objects: Tuple[str, ...] = ()
    files: Optional[int] = None
    file_bytes: Optional[int] = None
    notes: Tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of every stored tensor."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def num_shards(self) -> Optional[int]:
        """Stored pieces of every tensor (None if some backend does not describe them)."""
        counts = [t.num_shards for t in self.tensors]
        return None if any(c is None for c in counts) else sum(c for c in counts if c is not None)

    def to_json(self, with_shards: bool = False) -> Dict[str, Any]:
        """A JSON-serializable dict (``dist-ckpt inspect --json``); ``with_shards`` lists every
        stored piece of every tensor."""
        return {
            "checkpoint": self.path,
            "kind": self.kind,
            "sharded_backend": self.sharded_backend,
            "common_backend": self.common_backend,
            "world_size": self.world_size,
            "library_version": self.library_version,
            "num_tensors": len(self.tensors),
            "nbytes": self.nbytes,
            "num_shards": self.num_shards,
            "files": self.files,
            "file_bytes": self.file_bytes,
            "tensors": [t.to_json(with_shards) for t in self.tensors],
            "common": self.common_keys,
            "sharded_objects": list(self.sharded_objects),
            "notes": list(self.notes),
        }


def inspect_checkpoint(checkpoint_dir: LocationLike) -> CheckpointInfo:
    """Describe the checkpoint (or HuggingFace folder) at ``checkpoint_dir`` -- a directory, an
    ``s3://bucket/prefix`` URL or a storage -- without reading tensor data (see the module
    docstring for what is read).

    Raises:
        NotACheckpointError: the directory does not exist, or holds neither a committed
            checkpoint nor HuggingFace weights.
        CheckpointingException: its metadata is damaged, or its backend is not registered.

    Example:

    ```python
    info = inspect_checkpoint("ckpt/iter_1000")
    print(info.sharded_backend, len(info.tensors), info.nbytes)
    ```
    """
    directory = resolve_location(checkpoint_dir)
    sharded, common = verify_checkpoint_and_load_strategy(directory)
    config, recorded = _read_record(directory)
    notes: List[str] = []
    metadata = sharded.load_tensors_metadata(directory)
    layout = _stored_shards(sharded, directory, notes)
    tensors = []
    for key in sorted(metadata):
        meta = metadata[key]
        if not isinstance(meta, ShardedTensor):
            continue
        shape = tuple(meta.global_shape)
        pieces = None if layout is None else tuple(layout.get(key, ()))
        tensors.append(
            TensorInfo(key, dtype_to_name(meta.dtype), shape, math.prod(shape) * meta.dtype.itemsize, pieces)
        )
    files, file_bytes = count_files(directory)
    return CheckpointInfo(
        path=directory.url,
        kind=_KINDS.get(config, "dist_ckpt"),
        sharded_backend=f"{config.sharded_backend}:{config.sharded_backend_version}",
        common_backend=f"{config.common_backend}:{config.common_backend_version}",
        world_size=recorded.get("world_size"),
        library_version=recorded.get("library_version"),
        tensors=tuple(tensors),
        common_keys=_common_keys(common, directory, notes),
        sharded_objects=_sharded_objects(sharded, common, directory, notes),
        files=files,
        file_bytes=file_bytes,
        notes=tuple(notes),
    )


def _read_record(directory: Storage) -> Tuple[CheckpointingConfig, Dict[str, Any]]:
    """The config (HF_CONFIG or DCP_CONFIG for folders without ``metadata.json``) and dist_ckpt's
    record of the save (who wrote it), which ``core`` does not parse."""
    config = detect_config(directory)
    if config in _KINDS:
        return config, {}
    writer = read_save_record(directory)
    out: Dict[str, Any] = {}
    if isinstance(writer.get("world_size"), int):
        out["world_size"] = writer["world_size"]
    if isinstance(writer.get("library_version"), str):
        out["library_version"] = writer["library_version"]
    return config, out


def _stored_shards(
    strategy: LoadShardedStrategy, directory: Storage, notes: List[str]
) -> Optional[Dict[str, List[StoredShardInfo]]]:
    layout = strategy.describe_stored_shards(directory)
    if layout is None:
        notes.append(f"{strategy} does not describe how its tensors are stored: only shapes and dtypes are shown")
    return layout


def describe_value(value: Any) -> str:
    """A short description of a common-state value: its type, and the value itself when short.

    Example:

    ```python
    describe_value(1000)                  # "int = 1000"
    describe_value(torch.zeros(2, 3))     # "tensor [2, 3] float32"
    ```
    """
    if isinstance(value, torch.Tensor):
        return f"tensor [{', '.join(map(str, value.shape))}] {dtype_to_name(value.dtype)}"
    if isinstance(value, (list, tuple, set)):
        return f"{type(value).__name__} of {len(value)}"
    text = repr(value)
    if len(text) > _REPR_CHARS:
        text = text[: _REPR_CHARS - 3] + "..."
    return f"{type(value).__name__} = {text}"


def _flatten(value: Any, prefix: str, out: Dict[str, str]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}/{k}" if prefix else str(k), out)
    else:
        out[prefix or "<root>"] = describe_value(value)


def _common_keys(strategy: LoadCommonStrategy, directory: Storage, notes: List[str]) -> Dict[str, str]:
    try:
        state = strategy.load_common(directory)
    except UnsafeObjectError as e:
        notes.append(f"the common state needs full pickle to load and was not read: {e}")
        return {}
    out: Dict[str, str] = {}
    _flatten(state, "", out)
    return {} if out == {"<root>": "dict = {}"} else out


def _sharded_objects(
    sharded: LoadShardedStrategy, common: LoadCommonStrategy, directory: Storage, notes: List[str]
) -> Tuple[str, ...]:
    holder = sharded if sharded.can_handle_sharded_objects else common
    try:
        found = holder.load_sharded_metadata(directory)
    except CheckpointingException as e:
        notes.append(f"ShardedObjects could not be listed: {e}")
        return ()
    return tuple(sorted(k for k, v in found.items() if not isinstance(v, ShardedTensor)))
