"""Save and load whole HuggingFace-format checkpoints, from modules or plain state dicts.

``save_checkpoint`` writes ``model.safetensors`` (one shard) or shard files plus
``model.safetensors.index.json``; every file is written from the tensors' memory to a temporary
name and renamed into place, and the index last, so a crash never leaves a folder whose index
names a half-written file. ``load_checkpoint`` reads either form into a module (in place, then
re-ties tied parameters) or into a dict. The low-level pair ``save_sharded_checkpoint`` /
``load_sharded_checkpoint`` works from an index, so several processes can each write or read the
files they own.

Example:

```python
from dist_ckpt.hf import save_checkpoint, load_checkpoint
save_checkpoint("out/model", model, max_shard_size=2**30)
load_checkpoint("out/model", model)                     # in place, tied weights re-tied
state = load_checkpoint("out/model", None, keys={"lm_head.weight"})
```
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple, Union, overload

import torch
from torch import Tensor
from torch.nn import Module

from dist_ckpt.backends.safetensors import ReadOptions, load_from_index, write_safetensors_file
from dist_ckpt.errors import CheckpointingException, KeyMismatchError, LoadMismatchError, format_keys
from dist_ckpt.hf.folder import INDEX_METADATA_KEY, HFFolder, open_folder
from dist_ckpt.hf.index import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    ShardIndex,
    SharingMetadataT,
    StateDictLike,
    create_sharing_metadata,
    is_shard_file_name,
    make_shard_index,
    refuse_bin,
    retie_parameters,
    save_shard_index,
    sharing_groups,
    validate_shard_index,
)
from dist_ckpt.model.module_names import canonical_state_dict, has_fsdp1
from dist_ckpt.model.sharded import ShardedTensor

__all__ = ["load_checkpoint", "load_sharded_checkpoint", "save_checkpoint", "save_sharded_checkpoint"]

logger = logging.getLogger(__name__)

Device = Union[str, torch.device]


def as_state_dict(module: StateDictLike) -> Dict[str, Tensor]:
    """The tensors to save: ``module.state_dict()`` for a module, by the names of the unwrapped
    model (no ``module.`` of DDP, ``_orig_mod.`` of ``torch.compile``, ...: see
    `dist_ckpt.model.module_names`), the dict itself otherwise."""
    if isinstance(module, Module):
        return canonical_state_dict(module)[0]
    if isinstance(module, dict):
        return module
    raise CheckpointingException(f"expected an nn.Module or a dict of tensors, got {type(module).__name__}")


# --------------------------------------------------------------------------- save


def _files_of(weight_map: Dict[str, str]) -> Dict[str, List[str]]:
    files: Dict[str, List[str]] = {}
    for name, file in weight_map.items():
        files.setdefault(file, []).append(name)
    return files


def save_sharded_checkpoint(
    output_dir: Union[str, Path],
    shard_index: ShardIndex,
    module: StateDictLike,
    safetensors: bool = True,
    debug: bool = False,
) -> None:
    """Write the shard files of ``shard_index`` whose tensors ``module`` holds.

    Each file is written whole by the caller that holds its tensors (a file whose tensors are
    only partly present is refused, naming the absent ones), so several processes can save
    their own parts of one index. Names of the state dict that are tied aliases (recorded in the
    index metadata) are stored under their group's first name and skipped here.

    Args:
        output_dir: the checkpoint folder (created if missing).
        shard_index: from [`make_shard_index()`][dist_ckpt.hf.index.make_shard_index].
        module: an ``nn.Module`` or a dict of tensors.
        safetensors: must be True (``.bin`` is refused).
        debug: log each file written at INFO instead of DEBUG.

    Example:

    ```python
    index = make_shard_index([stage.state_dict() for stage in stages])
    save_sharded_checkpoint("out", index, stages[rank])
    ```
    """
    refuse_bin(safetensors)
    index = validate_shard_index(shard_index, "given to save_sharded_checkpoint")
    state_dict = as_state_dict(module)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tied = {name for group in sharing_groups(index["metadata"]) for name in group[1:]}
    unknown = [n for n in state_dict if n not in index["weight_map"] and n not in tied]
    if unknown:
        raise CheckpointingException(
            f"tensors {format_keys(unknown)} are not in the shard index; build it from this state dict"
        )
    for file, names in _files_of(index["weight_map"]).items():
        present = [n for n in names if n in state_dict]
        if not present:
            continue
        if len(present) != len(names):
            absent = [n for n in names if n not in state_dict]
            raise CheckpointingException(
                f"{file!r} must hold {format_keys(names)}, but the state dict lacks {format_keys(absent)}: "
                f"a shard file is written whole, by the caller that holds all of its tensors"
            )
        size, _ = write_safetensors_file(out / file, [(n, state_dict[n]) for n in names], {"format": "pt"}, atomic=True)
        logger.log(
            logging.INFO if debug else logging.DEBUG, "wrote %s: %d tensors, %d bytes", out / file, len(names), size
        )


def _remove_stale(out: Path, keep: Set[str]) -> None:
    """Remove weight files of an earlier save that this one does not rewrite (a folder with both
    an index and ``model.safetensors``, or with extra shards, would be ambiguous)."""
    for path in sorted(out.iterdir()):
        name = path.name
        if name in keep or not path.is_file():
            continue
        if name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME) or is_shard_file_name(name):
            logger.info("removing %s, left by an earlier save", path)
            path.unlink()


def save_checkpoint(
    output_dir: Union[str, Path],
    module: StateDictLike,
    metadata: Optional[Dict[str, object]] = None,
    safetensors: bool = True,
    max_shard_size: int = 2**31,
    debug: bool = False,
    include_param_sharing: bool = True,
    param_sharing_metadata: Optional[SharingMetadataT] = None,
) -> None:
    """Save a module or state dict as a HuggingFace checkpoint in ``output_dir``.

    Steps: 1. take the state dict; 2. find tied parameters (given, or detected on a module when
    ``include_param_sharing``); 3. plan shards of at most ``max_shard_size`` bytes; 4. write
    ``model.safetensors`` if one shard suffices, else the shard files and then the index; 5.
    remove weight files an earlier save left behind.

    Args:
        output_dir: the folder (created if missing).
        module: an ``nn.Module`` or a dict of tensors.
        metadata: extra JSON-serializable entries of the index metadata.
        safetensors: must be True (``.bin`` is refused).
        max_shard_size: most bytes per file.
        debug: log each file written at INFO.
        include_param_sharing: detect tied parameters of a module (stored once, re-tied on load).
        param_sharing_metadata: tied groups to use instead of detecting them.

    Example:

    ```python
    save_checkpoint("out/my_model", model)                      # module mode
    save_checkpoint("out/agg", {"layer.weight": w}, max_shard_size=2**30)   # dict mode
    ```
    """
    refuse_bin(safetensors)
    state_dict = as_state_dict(module)
    sharing = param_sharing_metadata
    if sharing is None and include_param_sharing and isinstance(module, Module):
        sharing = create_sharing_metadata(module)
    for group in sharing or []:
        absent = [n for n in group if n not in state_dict]
        if absent:
            raise CheckpointingException(f"tied group {group} names {format_keys(absent)}, which the state dict lacks")
    index = make_shard_index([state_dict], dict(metadata or {}), True, max_shard_size, sharing)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(set(index["weight_map"].values()))
    if len(files) <= 1:
        names = list(index["weight_map"])
        header = {"format": "pt", INDEX_METADATA_KEY: json.dumps(index["metadata"])}
        write_safetensors_file(out / SAFE_WEIGHTS_NAME, [(n, state_dict[n]) for n in names], header, atomic=True)
        _remove_stale(out, {SAFE_WEIGHTS_NAME})
    else:
        save_sharded_checkpoint(out, index, state_dict, debug=debug)
        save_shard_index(index, out, SAFE_WEIGHTS_INDEX_NAME)
        _remove_stale(out, set(files) | {SAFE_WEIGHTS_INDEX_NAME})
    logger.log(
        logging.INFO if debug else logging.DEBUG,
        "saved %d tensors in %d files to %s",
        len(index["weight_map"]),
        max(1, len(files)),
        out,
    )


# --------------------------------------------------------------------------- load


def load_into_dict(
    folder: HFFolder, names: Iterable[str], device: Device, options: Optional[ReadOptions] = None
) -> Dict[str, Tensor]:
    """``{name: tensor}`` for ``names``, read from ``folder``; tied names share one tensor."""
    wanted = list(dict.fromkeys(names))
    index = folder.tensor_index(wanted)
    aliases = folder.aliases
    request = {}
    for name in wanted:
        stored = aliases.get(name, name)
        info = index.tensors[stored]
        if stored not in request:
            request[stored] = ShardedTensor.from_rank_offsets(
                stored, torch.empty(info.global_shape, dtype=info.dtype, device=device)
            )
    loaded = load_from_index(request, index, options or ReadOptions())
    return {name: loaded[aliases.get(name, name)] for name in wanted}


def load_into_module(
    folder: HFFolder,
    module: Module,
    device: Device,
    assign: bool,
    raise_missing: bool,
    raise_unexpected: bool,
    options: Optional[ReadOptions] = None,
) -> Tuple[Set[str], Set[str]]:
    """Load ``folder`` into ``module`` and re-tie; return ``(missing, unexpected)`` names.

    Without ``assign`` the values are read in place into the module's existing tensors (any
    device); with ``assign`` new tensors are made on ``device`` and assigned (for modules on the
    meta device). Key problems are checked before anything is read. Names are those of the
    unwrapped model (a DDP or ``torch.compile`` wrapper loads the same folder as the plain
    model); an FSDP1 model, whose ``state_dict()`` holds copies, gets them through its
    ``load_state_dict``.
    """
    targets, raw_names = canonical_state_dict(module, keep_vars=True)
    available = set(folder.weight_map) | set(folder.aliases)
    missing = {n for n in targets if n not in available}
    unexpected = {n for n in folder.weight_map if n not in targets}
    problems = []
    if raise_missing and missing:
        problems.append(f"the checkpoint lacks {format_keys(missing)}")
    if raise_unexpected and unexpected:
        problems.append(f"the model has no {format_keys(unexpected)}")
    if problems:
        raise KeyMismatchError(
            f"HuggingFace checkpoint {str(folder.directory)!r} does not match the model: "
            + "; ".join(problems)
            + " (pass strict=False to load the common part)",
            missing_keys=missing,
            unexpected_keys=unexpected,
        )
    names = [n for n in targets if n in available]
    if assign:
        loaded = load_into_dict(folder, names, device, options)
        module.load_state_dict({raw_names[n]: t for n, t in loaded.items()}, strict=False, assign=True)
    else:
        index = folder.tensor_index(names)
        aliases = folder.aliases
        request: Dict[str, ShardedTensor] = {}
        seen: Set[int] = set()
        for name in names:
            dest = targets[name].detach()
            if dest.device.type == "meta":
                raise LoadMismatchError(f"{name!r} is on the meta device: pass assign=True to load into new tensors")
            if id(targets[name]) in seen:  # a tied parameter reached under another name
                continue
            seen.add(id(targets[name]))
            stored = aliases.get(name, name)
            info = index.tensors[stored]
            if tuple(dest.shape) != info.global_shape:
                raise LoadMismatchError(
                    f"{name!r} is {tuple(dest.shape)} in the model and {info.global_shape} in {str(folder.directory)!r}"
                )
            request[name] = ShardedTensor.from_rank_offsets(stored, dest)
        load_from_index(request, index, options or ReadOptions())
        if has_fsdp1(module):  # the targets were copies
            module.load_state_dict({raw_names[n]: targets[n] for n in names}, strict=False)
    groups = [g for g in folder.sharing if all(n in targets for n in g)]
    retie_parameters(module, groups)
    return missing, unexpected


@overload
def load_sharded_checkpoint(
    model_dir: Union[str, Path],
    shard_index: ShardIndex,
    module: Module,
    device: Device = ...,
    safetensors: bool = ...,
    strict: bool = ...,
    assign: bool = ...,
    debug: bool = ...,
    keys: Optional[Set[str]] = ...,
) -> Set[str]: ...


@overload
def load_sharded_checkpoint(
    model_dir: Union[str, Path],
    shard_index: ShardIndex,
    module: None = ...,
    device: Device = ...,
    safetensors: bool = ...,
    strict: bool = ...,
    assign: bool = ...,
    debug: bool = ...,
    keys: Optional[Set[str]] = ...,
) -> Dict[str, Tensor]: ...


def load_sharded_checkpoint(
    model_dir: Union[str, Path],
    shard_index: ShardIndex,
    module: Optional[Module] = None,
    device: Device = "cpu",
    safetensors: bool = True,
    strict: bool = True,
    assign: bool = False,
    debug: bool = False,
    keys: Optional[Set[str]] = None,
) -> Union[Set[str], Dict[str, Tensor]]:
    """Load from the files of ``shard_index`` in ``model_dir``.

    Module mode (``module`` given): reads the module's tensors in place (or assigns new ones on
    ``device`` with ``assign``), re-ties tied parameters, and returns the names of the module
    that the index does not hold (another process may load them); with ``strict``, names in
    the index that the module lacks raise [`KeyMismatchError`][dist_ckpt.errors.KeyMismatchError] before anything is
    read. Dict mode (``module=None``): returns ``{name: tensor}`` on ``device`` for ``keys`` (default:
    every tensor of the index, tied names included).

    Example:

    ```python
    index = load_shard_index(model_dir, index_file_name(True))
    unloaded = load_sharded_checkpoint(model_dir, index, model_shard, device="cuda")
    tensors = load_sharded_checkpoint(model_dir, index, None, keys={"lm_head.weight"})
    ```
    """
    refuse_bin(safetensors)
    index = validate_shard_index(shard_index, "given to load_sharded_checkpoint")
    folder = HFFolder(Path(model_dir), dict(index["weight_map"]), dict(index["metadata"]), True)
    if module is None:
        result = load_into_dict(folder, folder.names() if keys is None else keys, device)
        logger.log(logging.INFO if debug else logging.DEBUG, "loaded %d tensors from %s", len(result), model_dir)
        return result
    missing, _ = load_into_module(folder, module, device, assign, raise_missing=False, raise_unexpected=strict)
    return missing


@overload
def load_checkpoint(
    model_dir: Union[str, Path],
    module: Module,
    device: Device = ...,
    strict: bool = ...,
    assign: bool = ...,
    keys: Optional[Set[str]] = ...,
    *,
    allow_dtype_cast: bool = ...,
) -> None: ...


@overload
def load_checkpoint(
    model_dir: Union[str, Path],
    module: None = ...,
    device: Device = ...,
    strict: bool = ...,
    assign: bool = ...,
    keys: Optional[Set[str]] = ...,
    *,
    allow_dtype_cast: bool = ...,
) -> Dict[str, Tensor]: ...


def load_checkpoint(
    model_dir: Union[str, Path],
    module: Optional[Module] = None,
    device: Device = "cpu",
    strict: bool = True,
    assign: bool = False,
    keys: Optional[Set[str]] = None,
    *,
    allow_dtype_cast: bool = True,
) -> Optional[Dict[str, Tensor]]:
    """Load a HuggingFace checkpoint folder (index + shards, or ``model.safetensors``).

    Module mode loads into ``module`` (in place, or assigned on ``device`` with ``assign``),
    re-ties tied parameters, and returns None; with ``strict`` any name missing on either side
    raises [`KeyMismatchError`][dist_ckpt.errors.KeyMismatchError] before anything is read. Parameters in another dtype
    than the stored one are filled converted, as ``Module.load_state_dict`` does
    (``allow_dtype_cast=False`` raises [`LoadMismatchError`][dist_ckpt.errors.LoadMismatchError] instead; see
    `dist_ckpt.model.dtype_cast`). Dict mode (``module=None``) returns ``{name: tensor}``
    on ``device`` in the stored dtypes, restricted to ``keys`` if given.

    Example:

    ```python
    load_checkpoint("out/my_model", model, device="cuda:0")
    subset = load_checkpoint("out/my_model", None, keys={"layer.weight", "layer.bias"})
    ```
    """
    folder = open_folder(model_dir)
    if module is None:
        return load_into_dict(folder, folder.names() if keys is None else keys, device)
    if keys is not None:
        raise CheckpointingException("keys= applies to dict mode (module=None) only")
    options = ReadOptions(allow_dtype_cast=allow_dtype_cast)
    load_into_module(folder, module, device, assign, raise_missing=strict, raise_unexpected=strict, options=options)
    return None
