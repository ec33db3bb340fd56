"""Read DCP's ``.metadata`` without running code from the checkpoint.

``.metadata`` is a pickle of `torch.distributed.checkpoint.metadata.Metadata`. Unpickling
an arbitrary pickle runs whatever callables it names, so DCP's own reader (``pickle.load``),
Megatron-Core and torchtitan all execute code from the checkpoint directory. This module reads
it with a restricted unpickler that admits only what DCP metadata is made of:

* DCP's metadata dataclasses (``Metadata``, ``TensorStorageMetadata``, ``BytesStorageMetadata``,
  ``ChunkStorageMetadata``, ``TensorProperties``, ``MetadataIndex``, ``StorageMeta``, the
  memory-format enum), the file system's ``_StorageInfo``, and the save-plan classes that
  Megatron-Core pickles into ``all_local_plans`` (``SavePlan``, ``WriteItem``,
  ``WriteItemType``, ``TensorWriteData``);
* ``torch.Size``, every ``torch.dtype`` by name, ``torch.serialization._get_layout`` (which turns
  ``"torch.strided"`` back into the layout object);
* ``pathlib`` paths (``StorageMeta.checkpoint_id`` of ``torch.distributed.checkpoint.save``) and
  ``collections.OrderedDict``;
* the two classes Megatron-Core <= 0.15 pickled (``MCoreMetadata``, ``MCoreSavePlan``), mapped to
  local stand-ins so that megatron-core need not be installed.

Rebuilding any of them runs no code from the file (dataclass instances are created with
``__new__`` and their fields set; ``torch.Size``, the enums and ``_get_layout`` only convert
values). Any other global raises [`UnsafeObjectError`][dist_ckpt.errors.UnsafeObjectError] naming the file,
the global and the opt-in (``allow_pickle=True`` on the load strategy, for checkpoints you
trust), before it is called.

Example:

```python
md = read_metadata("ckpt/iter_10")                 # a DcpMetadata
md.state_dict_metadata["decoder.w"].size
```
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from typing import IO, Any, Dict, FrozenSet, Mapping, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan

from dist_ckpt.errors import CorruptCheckpointError, NotACheckpointError, UnsafeObjectError
from dist_ckpt.record.commit import DCP_METADATA_FILENAME
from dist_ckpt.storage.errors import ObjectNotFoundError
from dist_ckpt.storage.location import LocationLike, resolve_location

__all__ = [
    "DCP_METADATA_FILENAME",
    "LegacyMCoreMetadata",
    "LegacyMCoreSavePlan",
    "RestrictedUnpickler",
    "mcore_data",
    "read_metadata",
    "unpickle_metadata",
]

#: how a caller lets a trusted checkpoint's metadata use any pickled class
METADATA_OPT_IN = "sharded_strategy=TorchDistLoadShardedStrategy(allow_pickle=True)"


@dataclass
class LegacyMCoreMetadata(Metadata):
    """Stand-in for megatron-core <= 0.15's ``MCoreMetadata``: DCP's Metadata plus ``mcore_data``
    (``{key: {"nd_reformulated_orig_global_shape": shape}}`` for flattened tensors)."""

    mcore_data: Dict[str, Dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class LegacyMCoreSavePlan(SavePlan):
    """Stand-in for megatron-core <= 0.15's ``MCoreSavePlan`` (found only in ``all_local_plans``,
    which dist_ckpt never reads)."""

    mcore_data: Optional[Dict[str, Any]] = None


_DCP = "torch.distributed.checkpoint"
_PATHS = frozenset({"Path", "PosixPath", "PurePath", "PurePosixPath", "PureWindowsPath", "WindowsPath"})

#: module -> names that a DCP ``.metadata`` may reference
_ALLOWED: Mapping[str, FrozenSet[str]] = {
    f"{_DCP}.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    f"{_DCP}.filesystem": frozenset({"_StorageInfo"}),
    f"{_DCP}.planner": frozenset(
        {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem", "LoadItemType"}
    ),
    # checkpoints written by torch <= 2.1 pickled these from the sharded-tensor package
    "torch.distributed._shard.sharded_tensor.metadata": frozenset({"TensorProperties", "MEM_FORMAT_ENCODING"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "collections": frozenset({"OrderedDict"}),
    "pathlib": _PATHS,
    "pathlib._local": _PATHS,  # Python 3.13 pickles paths from here
}

_MEGATRON = "megatron.core.dist_checkpointing.strategies.torch"
_STAND_INS: Mapping[Tuple[str, str], type] = {
    (_MEGATRON, "MCoreMetadata"): LegacyMCoreMetadata,
    (_MEGATRON, "MCoreSavePlan"): LegacyMCoreSavePlan,
}


def _torch_attribute(name: str) -> Optional[Any]:
    """``torch.Size``, or a dtype by name; None for anything else of ``torch``."""
    if name == "Size":
        return torch.Size
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals DCP metadata is made of (see the module
    docstring); with ``allow_pickle`` every other global is resolved as ``pickle`` would.

    Args:
        file: the binary stream to read.
        where: the file, named in errors.
        allow_pickle: resolve any global (runs code from the file: trusted checkpoints only).
    """

    def __init__(self, file: IO[bytes], where: str, allow_pickle: bool = False) -> None:
        super().__init__(file)
        self.where = where
        self.allow_pickle = allow_pickle

    def find_class(self, module: str, name: str) -> Any:
        stand_in = _STAND_INS.get((module, name))
        if stand_in is not None:
            return stand_in
        if module == "torch":
            found = _torch_attribute(name)
            if found is not None:
                return found
        elif name in _ALLOWED.get(module, frozenset()):
            if module.startswith("pathlib") and name == "WindowsPath":
                name = "PureWindowsPath"  # a WindowsPath cannot be built on POSIX; the pure one holds the same text
            return super().find_class(module, name)
        if self.allow_pickle:
            return super().find_class(module, name)
        raise UnsafeObjectError(
            f"{self.where} references {module}.{name}, which is not part of DCP's checkpoint metadata: loading it "
            f"could run code from the checkpoint, so it was not loaded. If you trust this checkpoint, pass "
            f"{METADATA_OPT_IN}"
        )


def unpickle_metadata(data: bytes, where: str, allow_pickle: bool = False) -> Metadata:
    """The DCP ``Metadata`` pickled in ``data`` (``where`` names it in errors).

    Raises:
        UnsafeObjectError: the pickle references a global DCP metadata does not use.
        CorruptCheckpointError: not a pickle, truncated, or not a ``Metadata``.

    Example:

    ```python
    md = unpickle_metadata(Path("ckpt/.metadata").read_bytes(), "ckpt/.metadata")
    ```
    """
    try:
        found = RestrictedUnpickler(io.BytesIO(data), where, allow_pickle).load()
    except UnsafeObjectError:
        raise
    except Exception as e:  # noqa: BLE001 -- unpickling damaged bytes fails in many ways
        raise CorruptCheckpointError(
            f"{where} is not a readable DCP metadata pickle ({type(e).__name__}: {e}); the checkpoint's metadata "
            f"is truncated or corrupt"
        ) from e
    if not isinstance(found, Metadata) or not isinstance(getattr(found, "state_dict_metadata", None), dict):
        raise CorruptCheckpointError(f"{where} holds a {type(found).__name__}, not DCP's checkpoint Metadata")
    if not isinstance(getattr(found, "storage_data", None), dict):
        raise CorruptCheckpointError(f"{where}: the DCP metadata records no storage locations (storage_data)")
    _check_structure(found, where)
    return found


def _ints(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _check_structure(md: Metadata, where: str) -> None:
    """Raise CorruptCheckpointError unless every entry of ``md`` has the fields, of the types,
    that readers use: a damaged pickle can rebuild DCP's dataclasses with fields renamed or of
    other types, which would otherwise surface later as AttributeError or TypeError."""
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise CorruptCheckpointError(f"{where}: a DCP key is a {type(key).__name__}, not a str: {key!r}")
        if isinstance(entry, BytesStorageMetadata):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{where}: {key!r} has metadata of unknown kind {type(entry).__name__}")
        chunks = getattr(entry, "chunks", None)
        properties = getattr(entry, "properties", None)
        if (
            not _ints(getattr(entry, "size", None))
            or not isinstance(chunks, list)
            or not isinstance(properties, TensorProperties)
            or not isinstance(getattr(properties, "dtype", None), torch.dtype)
            or not all(
                isinstance(c, ChunkStorageMetadata)
                and _ints(getattr(c, "offsets", None))
                and _ints(getattr(c, "sizes", None))
                for c in chunks
            )
        ):
            raise CorruptCheckpointError(
                f"{where}: the metadata of tensor {key!r} is damaged (size, chunks or dtype missing or of the wrong "
                f"type)"
            )
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(getattr(index, "fqn", None), str):
            raise CorruptCheckpointError(
                f"{where}: a storage entry is keyed by a {type(index).__name__}, not a DCP index"
            )
        offset = getattr(index, "offset", None)
        fields = [getattr(info, name, None) for name in ("relative_path", "offset", "length")]
        if (offset is not None and not _ints(offset)) or not isinstance(fields[0], str) or not _ints(fields[1:]):
            raise CorruptCheckpointError(
                f"{where}: the storage entry of {index.fqn!r} is damaged (not a file, offset and length)"
            )


def read_metadata(checkpoint_dir: LocationLike, allow_pickle: bool = False) -> Metadata:
    """The DCP ``Metadata`` of the checkpoint at ``checkpoint_dir`` (read through its storage).

    Raises:
        NotACheckpointError: the checkpoint has no ``.metadata`` (a DCP save that never finished).
        UnsafeObjectError, CorruptCheckpointError: see `unpickle_metadata()`.

    Example:

    ```python
    md = read_metadata("ckpt/iter_10")
    sorted(md.state_dict_metadata)
    ```
    """
    storage = resolve_location(checkpoint_dir)
    try:
        data = storage.read(DCP_METADATA_FILENAME)
    except ObjectNotFoundError:
        raise NotACheckpointError(
            f"{storage.url!r} holds no {DCP_METADATA_FILENAME}: it is not a torch.distributed.checkpoint "
            f"checkpoint, or its save did not finish"
        ) from None
    return unpickle_metadata(data, storage.url_of(DCP_METADATA_FILENAME), allow_pickle)


def mcore_data(md: Metadata) -> Dict[str, Dict[str, Any]]:
    """Megatron-Core's per-key extra data (``mcore_data``) of a ``.metadata``, or {}: an attribute of
    the pickled Metadata for megatron-core 0.13-0.14 and for dist_ckpt, a field of ``MCoreMetadata``
    for 0.15."""
    found = getattr(md, "mcore_data", None)
    return found if isinstance(found, dict) else {}
