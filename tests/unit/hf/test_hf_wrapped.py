"""dist_ckpt.hf with wrapped modules: a HuggingFace folder holds the unwrapped model's names.

torch.compile and DataParallel (``module.``, as DDP) wrappers, at the top and around one
block: saving writes plain names (tied weights too), loading, assigning onto the meta device,
partial loads and ``set_submodule`` accept the wrapped model. FSDP1 needs a process group:
tests/distributed/test_wrapped_models.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from dist_ckpt.hf import (
    create_sharing_metadata,
    load_checkpoint,
    load_state_dict_to_shards,
    save_checkpoint,
    save_sharded_model,
    set_submodule,
)
from tests.unit.hf.test_hf_io import Model, same_values


def _compiled(model: nn.Module) -> nn.Module:
    return torch.compile(model, backend="eager")  # type: ignore[return-value]


def _compiled_layer(model: nn.Module) -> nn.Module:
    model.layers[1] = _compiled(model.layers[1])  # type: ignore[index]
    return model


WRAPPERS: Dict[str, Callable[[nn.Module], nn.Module]] = {
    "compile": _compiled,
    "data_parallel": nn.DataParallel,
    "data_parallel+compile": lambda m: nn.DataParallel(_compiled(m)),
    "compiled_layer": _compiled_layer,
}


def _plain(model: nn.Module) -> Model:
    """The Model inside the wrappers, with its layer unwrapped, for comparisons."""
    while not isinstance(model, Model):
        model = model.module if isinstance(model, nn.DataParallel) else model._orig_mod  # type: ignore[assignment]
    layer = model.layers[1]
    if not isinstance(layer, nn.Linear):
        model.layers[1] = layer._orig_mod
    return model


@pytest.mark.parametrize("wrap", sorted(WRAPPERS))
def test_a_wrapped_model_saves_plain_names_and_loads_them_back(wrap: str, tmp_path: Path) -> None:
    model = WRAPPERS[wrap](Model())
    assert create_sharing_metadata(model) == [["embed.weight", "head.weight"]]
    save_checkpoint(tmp_path / "hf", model)
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(stored) == sorted(k for k in Model().state_dict() if k != "head.weight")  # tied: once
    # into the plain model
    plain = Model()
    load_checkpoint(tmp_path / "hf", plain)
    assert same_values(plain, _plain(model)) and plain.head.weight is plain.embed.weight
    # into a wrapped model, untied and with other values: loaded in place and re-tied
    fresh = WRAPPERS[wrap](Model(tie=False))
    load_checkpoint(tmp_path / "hf", fresh)
    fresh_plain = _plain(fresh)
    assert same_values(fresh_plain, plain) and fresh_plain.head.weight is fresh_plain.embed.weight


@pytest.mark.parametrize("wrap", ["compile", "compiled_layer"])
def test_a_plain_folder_assigns_onto_a_wrapped_meta_model(wrap: str, tmp_path: Path) -> None:
    model = Model()
    save_checkpoint(tmp_path, model, max_shard_size=2000)
    with torch.device("meta"):
        fresh = WRAPPERS[wrap](Model())
    load_checkpoint(tmp_path, fresh, assign=True)
    fresh_plain = _plain(fresh)
    assert same_values(fresh_plain, model) and fresh_plain.head.weight is fresh_plain.embed.weight


def test_partial_loads_and_set_submodule_take_plain_names_on_a_wrapped_model(tmp_path: Path) -> None:
    model = Model()
    save_checkpoint(tmp_path / "hf", model)
    shard = nn.DataParallel(Model())
    load_state_dict_to_shards(shard, checkpoint_dir=tmp_path / "hf")
    assert same_values(shard.module, model)
    other = _compiled_layer(Model())
    load_state_dict_to_shards(other, dict(model.state_dict()))
    assert same_values(_plain(other), model)
    new_layer = nn.Linear(16, 16)
    set_submodule(shard, "layers.2", new_layer)  # the name it has in the plain model
    assert shard.module.layers[2] is new_layer
    save_sharded_model(shard, tmp_path / "part.safetensors")
    assert sorted(load_file(str(tmp_path / "part.safetensors"))) == sorted(shard.module.state_dict())
