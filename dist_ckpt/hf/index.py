"""HuggingFace shard indexes and tied parameters.

A sharded HuggingFace checkpoint is a folder of safetensors files and an index,
``model.safetensors.index.json``:

```text
{"metadata": {"total_size": 123456, ...},
 "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors", ...}}
```

A checkpoint small enough for one file is just ``model.safetensors``. Tied parameters (e.g. the
input embedding and the output projection) are stored once: only the first name of each sharing
group is in the weight map; the groups themselves are kept in the index metadata under
``"param_sharing_metadata"`` (or, for a single file, in its header's ``__metadata__``), so that
[`retie_parameters()`][dist_ckpt.hf.index.retie_parameters] can restore the tying on load.

Only safetensors is written and read: a ``.bin`` checkpoint is a pickle, which loading would
have to execute, so ``safetensors=False`` raises [`CheckpointingException`][dist_ckpt.errors.CheckpointingException]
with the reason instead.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.nn import Module

from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError, with_article
from dist_ckpt.integrity.safe_json import loads
from dist_ckpt.model.module_names import ModuleNames
from dist_ckpt.record.commit import BIN_WEIGHTS_INDEX_NAME, BIN_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from dist_ckpt.storage import write_bytes_atomic

__all__ = [
    "BIN_WEIGHTS_INDEX_NAME",
    "BIN_WEIGHTS_NAME",
    "PARAM_SHARING_KEY",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "ShardIndex",
    "SharingMetadataT",
    "StateDictLike",
    "create_sharing_metadata",
    "index_file_name",
    "load_shard_index",
    "make_shard_index",
    "plan_shards",
    "retie_parameters",
    "save_shard_index",
    "shard_file_name",
]

StateDictLike = Union[Module, Dict[str, Tensor]]
ShardIndex = Dict[str, Dict[str, Any]]  # {"metadata": {...}, "weight_map": {name: file}}
SharingMetadataT = List[List[str]]  # groups of tied parameter names; the first one is stored

PARAM_SHARING_KEY = "param_sharing_metadata"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

_NO_BIN = (
    "dist_ckpt reads and writes HuggingFace checkpoints in safetensors format only: a .bin "
    "checkpoint is a pickle, and loading one would run code from the file. Convert it once in a "
    "trusted environment (e.g. transformers' save_pretrained(safe_serialization=True))"
)


def refuse_bin(safetensors: bool) -> None:
    """Raise the documented error for the ``.bin`` (pickle) format."""
    if not safetensors:
        raise CheckpointingException(_NO_BIN)


def index_file_name(safetensors: bool = True) -> str:
    """File name of the shard index: ``model.safetensors.index.json``.

    Example:

    ```python
    load_shard_index(model_dir, index_file_name(True))
    ```
    """
    refuse_bin(safetensors)
    return SAFE_WEIGHTS_INDEX_NAME


def shard_file_name(i: int, count: int) -> str:
    """HuggingFace's name of shard ``i`` (0-based) of ``count``.

    Example:

    ```python
    shard_file_name(0, 3)   # "model-00001-of-00003.safetensors"
    ```
    """
    return f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def is_shard_file_name(name: str) -> bool:
    """Whether ``name`` has the form of `shard_file_name()`."""
    return bool(_SHARD_NAME.fullmatch(name))


def tensor_nbytes(tensor: Tensor) -> int:
    """Bytes the tensor takes in a file (works for meta tensors too)."""
    return math.prod(tensor.shape) * tensor.element_size()


def _stored_once(state_dict: Dict[str, Tensor], sharing: Optional[SharingMetadataT]) -> List[str]:
    """Names of ``state_dict`` to store: all but the non-first members of each sharing group."""
    tied = {name for group in sharing or [] for name in group[1:]}
    return [name for name in state_dict if name not in tied]


def plan_shards(sizes: Sequence[Tuple[str, int]], max_shard_size: int) -> List[List[str]]:
    """Cut ``(name, nbytes)`` (in order) into consecutive shards of at most ``max_shard_size``
    bytes; a tensor larger than the limit gets a shard of its own.

    Example:

    ```python
    plan_shards([("a", 6), ("b", 6), ("c", 2)], 10)  # [["a"], ["b", "c"]]
    ```
    """
    if not isinstance(max_shard_size, int) or isinstance(max_shard_size, bool) or max_shard_size < 1:
        raise CheckpointingException(f"max_shard_size must be a positive number of bytes, got {max_shard_size!r}")
    shards: List[List[str]] = []
    size = 0
    for name, nbytes in sizes:
        if not shards or (size + nbytes > max_shard_size and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def make_shard_index(
    state_dictionaries: List[Dict[str, Tensor]],
    metadata: Optional[Dict[str, Any]] = None,
    safetensors: bool = True,
    max_shard_size: int = 2**32,
    param_sharing_metadata: Optional[SharingMetadataT] = None,
) -> ShardIndex:
    """Build a shard index for one or more state dicts (tensors may be on the meta device).

    Each state dict gets its own shard files (no file mixes two), so that e.g. each pipeline
    stage can write its own files. Tied parameters (``param_sharing_metadata``) are stored
    once, under the first name of their group; the groups are recorded in the index metadata.

    Args:
        state_dictionaries: the state dicts, in file order.
        metadata: extra entries for the index's ``"metadata"`` (JSON-serializable).
        safetensors: must be True (``.bin`` is refused, see the module docstring).
        max_shard_size: most bytes per shard file (a larger tensor gets a file of its own).
        param_sharing_metadata: groups of tied names.

    Example:

    ```python
    index = make_shard_index([model.state_dict()], max_shard_size=2**30)
    index["weight_map"]["lm_head.weight"]  # 'model-00002-of-00002.safetensors'
    ```
    """
    refuse_bin(safetensors)
    shards: List[List[str]] = []
    seen: Dict[str, int] = {}
    total = 0
    for i, sd in enumerate(state_dictionaries):
        for name, value in sd.items():
            if not isinstance(value, Tensor):
                raise CheckpointingException(
                    f"{name!r} is {with_article(type(value).__name__)}, not a tensor: safetensors files hold "
                    "tensors only"
                )
            if name in seen:
                raise CheckpointingException(f"{name!r} is in state dicts {seen[name]} and {i}; names must be unique")
            seen[name] = i
        names = _stored_once(sd, param_sharing_metadata)
        sizes = [(name, tensor_nbytes(sd[name])) for name in names]
        total += sum(n for _, n in sizes)
        shards.extend(plan_shards(sizes, max_shard_size) if sizes else [])
    weight_map = {name: shard_file_name(i, len(shards)) for i, shard in enumerate(shards) for name in shard}
    index_metadata: Dict[str, Any] = {"total_size": total}
    index_metadata.update(metadata or {})
    if param_sharing_metadata:
        index_metadata[PARAM_SHARING_KEY] = [list(g) for g in param_sharing_metadata]
    return {"metadata": index_metadata, "weight_map": weight_map}


def validate_shard_index(index: Any, where: str) -> ShardIndex:
    """Check the structure of a shard index; raise [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError]
    naming ``where``."""
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise CorruptCheckpointError(f"shard index {where} must be a JSON object with a 'weight_map' object")
    for name, file in index["weight_map"].items():
        if not isinstance(file, str) or not file or "/" in file or "\\" in file or file.startswith("."):
            raise CorruptCheckpointError(
                f"shard index {where}: tensor {name!r} maps to {file!r}, which is not a plain file name in the folder"
            )
    metadata = index.get("metadata", {})
    if not isinstance(metadata, dict):
        raise CorruptCheckpointError(f"shard index {where}: 'metadata' must be an object")
    groups = metadata.get(PARAM_SHARING_KEY, [])
    if not isinstance(groups, list) or not all(
        isinstance(g, list) and g and all(isinstance(n, str) for n in g) for g in groups
    ):
        raise CorruptCheckpointError(f"shard index {where}: {PARAM_SHARING_KEY!r} must be a list of lists of names")
    return {"metadata": metadata, "weight_map": index["weight_map"]}


def save_shard_index(shard_index: ShardIndex, output_dir: Union[str, Path], index_name: str) -> None:
    """Write ``shard_index`` to ``output_dir/index_name`` atomically (temporary file + rename).

    Example:

    ```python
    save_shard_index(index, "out/model", index_file_name(True))
    ```
    """
    path = Path(output_dir) / index_name
    validate_shard_index(shard_index, repr(str(path)))
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"metadata": shard_index.get("metadata", {}), "weight_map": dict(sorted(shard_index["weight_map"].items()))}
    write_bytes_atomic(path, (json.dumps(doc, indent=2) + "\n").encode("utf-8"))


def load_shard_index(output_dir: Union[str, Path], index_name: str) -> ShardIndex:
    """Read and validate ``output_dir/index_name``.

    Raises:
        CorruptCheckpointError: the file is missing, not JSON, or malformed (naming it).

    Example:

    ```python
    index = load_shard_index("out/model", "model.safetensors.index.json")
    ```
    """
    path = Path(output_dir) / index_name
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"shard index {str(path)!r} is missing") from None
    return validate_shard_index(loads(raw, f"shard index {str(path)!r}"), repr(str(path)))


def sharing_groups(metadata: Dict[str, Any]) -> SharingMetadataT:
    """The tied-parameter groups recorded in index metadata (empty if none)."""
    groups = metadata.get(PARAM_SHARING_KEY, [])
    return [list(g) for g in groups] if isinstance(groups, list) else []


# --------------------------------------------------------------------------- tied parameters


def _storage_key(t: Tensor) -> Optional[Tuple[Any, ...]]:
    if t.device.type == "meta" or t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def create_sharing_metadata(model: Module) -> SharingMetadataT:
    """Groups of parameter (and buffer) names that are the same tensor (tied), in model order.

    Tensors are the same when they are one object (``lm_head.weight = embed.weight``) or, off
    the meta device, views of the same memory with the same shape and strides.

    Example:

    ```python
    model.lm_head.weight = model.embed.weight
    create_sharing_metadata(model)  # [["embed.weight", "lm_head.weight"]]
    ```
    """
    groups: Dict[Any, List[str]] = {}
    names = ModuleNames(model)
    entries = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    named = [(names.canonical(name), tensor) for name, tensor in entries]
    by_storage: Dict[Tuple[Any, ...], Any] = {}
    for name, tensor in named:
        key: Any = id(tensor)
        storage = _storage_key(tensor)
        if storage is not None:
            key = by_storage.setdefault(storage, key)
        groups.setdefault(key, [])
        if name not in groups[key]:
            groups[key].append(name)
    return [g for g in groups.values() if len(g) > 1]


def _owner(names: ModuleNames, name: str) -> Tuple[Module, str]:
    path, _, attr = name.rpartition(".")
    try:
        return names.submodule(path), attr
    except AttributeError as e:
        raise CheckpointingException(f"cannot re-tie {name!r}: the model has no submodule {path!r}") from e


def retie_parameters(module: Module, sharing_metadata: SharingMetadataT) -> None:
    """Make every name of each group refer to the first name's parameter (or buffer) again.

    Loading a state dict copies values but leaves tied parameters as separate tensors (or, with
    ``assign=True``, replaces them); this restores the tying.

    Example:

    ```python
    load_checkpoint(model_dir, model)  # calls it with the checkpoint's groups
    retie_parameters(model, [["embed.weight", "lm_head.weight"]])
    ```
    """
    names = ModuleNames(module)  # groups name entries as the unwrapped model does
    for group in sharing_metadata:
        owner, attr = _owner(names, group[0])
        source = getattr(owner, attr, None)
        if not isinstance(source, Tensor):
            raise CheckpointingException(f"cannot re-tie {group}: the model has no parameter or buffer {group[0]!r}")
        for name in group[1:]:
            target_owner, target_attr = _owner(names, name)
            if isinstance(source, torch.nn.Parameter):
                setattr(target_owner, target_attr, source)
            else:
                target_owner.register_buffer(target_attr, source)
