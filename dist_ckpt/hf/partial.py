"""Partial loads of HuggingFace checkpoints: each process loads only the keys (or transformer
blocks) it owns.

A pipeline- or block-sharded job builds only its part of a model (the other blocks absent or
on the meta device), asks for exactly those keys, and reads only the files and byte ranges that
hold them: nothing else is read, and no process holds the whole model.

Example:

```python
owned = {k for k in model_shard.state_dict() if k.startswith(("model.layers.4.", "model.layers.5."))}
state = load_sharded_state_dict("Llama-3-8B", keys_to_load=owned)
load_state_dict_to_shards(model_shard, state)
save_sharded_model(model_shard, out_dir / f"model-rank{rank}.safetensors")
```
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, Optional, Union

import torch
from torch import Tensor
from torch.nn import Module

from dist_ckpt.backends.safetensors import write_safetensors_file
from dist_ckpt.errors import CheckpointingException, KeyMismatchError, LoadMismatchError, format_keys
from dist_ckpt.hf.folder import has_hf_weights, open_folder
from dist_ckpt.hf.io import as_state_dict, load_into_dict, load_into_module
from dist_ckpt.model.module_names import ModuleNames, canonical_state_dict

__all__ = [
    "is_in_safetensors_format",
    "load_sharded_state_dict",
    "load_state_dict_to_shards",
    "save_sharded_model",
    "set_submodule",
]


def is_in_safetensors_format(checkpoint_dir: Union[str, Path]) -> bool:
    """Whether ``checkpoint_dir`` holds HuggingFace safetensors weights (a single file or an index).

    Example:

    ```python
    if is_in_safetensors_format(path):
        state = load_sharded_state_dict(path, keys_to_load=my_keys)
    ```
    """
    return has_hf_weights(checkpoint_dir)


def load_sharded_state_dict(
    model_name_or_path: Union[str, Path],
    keys_to_load: Optional[Iterable[str]] = None,
    device: Union[torch.device, str] = "cpu",
) -> Dict[str, Tensor]:
    """``{key: tensor}`` of ``keys_to_load`` (default: the whole state dict), on ``device``.

    Only the files holding the keys are opened, and only the keys' bytes are read. Tied keys
    recorded in the checkpoint resolve to their stored tensor.

    Raises:
        KeyMismatchError: a key is not in the checkpoint (before anything is read).

    Example:

    ```python
    block3 = load_sharded_state_dict(path, [k for k in all_keys if k.startswith("model.layers.3.")])
    ```
    """
    folder = open_folder(model_name_or_path)
    return load_into_dict(folder, folder.names() if keys_to_load is None else keys_to_load, device)


def load_state_dict_to_shards(
    model_shard: Module,
    loaded_state_dict: Optional[Dict[str, Tensor]] = None,
    checkpoint_dir: Optional[Union[str, Path]] = None,
) -> None:
    """Load the model shard's own tensors, from ``loaded_state_dict`` or from ``checkpoint_dir``.

    Every key of ``model_shard.state_dict()`` must be provided; extra keys (other processes'
    blocks) are ignored. Values are copied in place into the shard's tensors (assigned instead
    when they are on the meta device), with shapes and dtypes checked first. With
    ``checkpoint_dir`` instead of a dict, exactly the shard's keys are read from the folder.

    Example:

    ```python
    load_state_dict_to_shards(model_shard, load_sharded_state_dict(path, model_shard.state_dict().keys()))
    load_state_dict_to_shards(model_shard, checkpoint_dir=path)   # the same, in one call
    ```
    """
    if loaded_state_dict is None:
        if checkpoint_dir is None:
            raise CheckpointingException("load_state_dict_to_shards needs loaded_state_dict or checkpoint_dir")
        meta = any(t.device.type == "meta" for t in model_shard.state_dict().values())
        load_into_module(
            open_folder(checkpoint_dir), model_shard, "cpu", meta, raise_missing=True, raise_unexpected=False
        )
        return
    own, raw_names = canonical_state_dict(model_shard, keep_vars=True)
    absent = [k for k in own if k not in loaded_state_dict]
    if absent:
        raise KeyMismatchError(
            f"the loaded state dict lacks the model shard's {format_keys(absent)}", missing_keys=absent
        )
    for key, target in own.items():
        value = loaded_state_dict[key]
        if tuple(value.shape) != tuple(target.shape) or value.dtype != target.dtype:
            raise LoadMismatchError(
                f"{key!r}: the model shard has {target.dtype} {tuple(target.shape)}, the state dict {value.dtype} "
                f"{tuple(value.shape)}"
            )
    assign = any(t.device.type == "meta" for t in own.values())
    model_shard.load_state_dict({raw_names[k]: loaded_state_dict[k] for k in own}, strict=True, assign=assign)


def save_sharded_model(model_shard: Union[Module, Dict[str, Tensor]], out_path: Union[str, Path]) -> None:
    """Write the model shard's tensors as one safetensors file at ``out_path``, atomically.

    ``out_path`` is usually ``<checkpoint>/model.safetensors``; when several processes each save
    their shard, give each its own file name and write an index with
    [`make_shard_index()`][dist_ckpt.hf.index.make_shard_index] /
    [`save_shard_index()`][dist_ckpt.hf.index.save_shard_index].

    Example:

    ```python
    save_sharded_model(model_shard, out_dir / "model.safetensors")
    ```
    """
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = as_state_dict(model_shard)
    write_safetensors_file(path, list(state.items()), {"format": "pt"}, atomic=True)


def set_submodule(model: Module, module_name: str, new_submodule: Module) -> None:
    """Replace (or add) the submodule at dotted path ``module_name``, e.g. ``"model.layers.3"``.

    Example:

    ```python
    set_submodule(model, "model.layers.3", DecoderLayer(config))   # materialize an owned block
    ```
    """
    if not module_name:
        raise CheckpointingException("set_submodule needs a non-empty dotted module name")
    parent_name, _, attr = module_name.rpartition(".")
    try:
        parent = ModuleNames(model).submodule(parent_name)  # a wrapped model's names work too
    except AttributeError as e:
        raise CheckpointingException(f"cannot set {module_name!r}: the model has no submodule {parent_name!r}") from e
    if not isinstance(new_submodule, Module):
        raise CheckpointingException(f"set_submodule expects an nn.Module, got {type(new_submodule).__name__}")
    setattr(parent, attr, new_submodule)
