"""Unit tests of dist_ckpt.hf.partial: processes that load only the keys or blocks they own."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from dist_ckpt.backends.safetensors import io as safetensors_io
from dist_ckpt.errors import CheckpointingException, KeyMismatchError, LoadMismatchError
from dist_ckpt.hf import (
    index_file_name,
    is_in_safetensors_format,
    load_shard_index,
    load_sharded_state_dict,
    load_state_dict_to_shards,
    save_checkpoint,
    save_sharded_model,
    set_submodule,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(32, 32)
        self.mlp = nn.Linear(32, 32)


class Model(nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList([Block() for _ in range(blocks)])
        self.head = nn.Linear(32, 50, bias=False)
        self.head.weight = self.embed.weight


class Stage(nn.Module):
    """A pipeline stage that owns blocks 2 and 3 only (same names as in the full model)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"2": Block(), "3": Block()})


@pytest.fixture
def folder(tmp_path):
    model = Model()
    save_checkpoint(tmp_path, model, max_shard_size=10_000)  # several files
    return tmp_path, model


@pytest.fixture
def opened_files(monkeypatch):
    """File descriptors -> names of files whose bytes were read."""
    read = set()
    original = safetensors_io.read_into

    def spy(fd, buffers, offset):
        read.add(os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1])
        return original(fd, buffers, offset)

    monkeypatch.setattr(safetensors_io, "read_into", spy)
    return read


def test_is_in_safetensors_format(folder, tmp_path_factory):
    path, _ = folder
    assert is_in_safetensors_format(path)
    empty = tmp_path_factory.mktemp("empty")
    assert not is_in_safetensors_format(empty)
    save_sharded_model({"a": torch.zeros(1)}, empty / "model.safetensors")
    assert is_in_safetensors_format(empty)


def test_load_sharded_state_dict_reads_only_the_owned_files(folder, opened_files):
    path, model = folder
    index = load_shard_index(path, index_file_name())
    owned = [k for k in model.state_dict() if k.startswith("layers.3.")]
    state = load_sharded_state_dict(path, keys_to_load=owned)
    assert sorted(state) == sorted(owned)
    assert all(torch.equal(state[k], model.state_dict()[k]) for k in owned)
    assert opened_files == {index["weight_map"][k] for k in owned}
    assert len(set(index["weight_map"].values())) > len(opened_files)


def test_load_sharded_state_dict_everything_and_ties(folder):
    path, model = folder
    state = load_sharded_state_dict(path, device="cpu")
    assert set(state) == set(model.state_dict()) and state["head.weight"] is state["embed.weight"]
    with pytest.raises(KeyMismatchError, match="'layers.9.mlp.bias'"):
        load_sharded_state_dict(path, ["layers.9.mlp.bias"])


def test_load_state_dict_to_shards_from_a_dict(folder):
    path, model = folder
    stage = Stage()
    state = load_sharded_state_dict(path, stage.state_dict().keys())
    state["layers.0.attn.bias"] = torch.zeros(32)  # another stage's key: ignored
    load_state_dict_to_shards(stage, state)
    assert torch.equal(stage.layers["3"].mlp.weight, model.layers[3].mlp.weight)
    del state["layers.2.attn.weight"]
    with pytest.raises(KeyMismatchError, match="'layers.2.attn.weight'"):
        load_state_dict_to_shards(stage, state)
    state["layers.2.attn.weight"] = torch.zeros(32, 31)
    with pytest.raises(LoadMismatchError, match="'layers.2.attn.weight'"):
        load_state_dict_to_shards(stage, state)


def test_load_state_dict_to_shards_from_the_folder(folder, opened_files):
    path, model = folder
    stage = Stage()
    load_state_dict_to_shards(stage, checkpoint_dir=path)
    assert torch.equal(stage.layers["2"].attn.bias, model.layers[2].attn.bias)
    index = load_shard_index(path, index_file_name())
    assert opened_files == {index["weight_map"][k] for k in stage.state_dict()}
    with torch.device("meta"):
        meta_stage = Stage()
    load_state_dict_to_shards(meta_stage, checkpoint_dir=path)
    assert torch.equal(meta_stage.layers["3"].mlp.bias, model.layers[3].mlp.bias)
    with pytest.raises(CheckpointingException, match="loaded_state_dict or checkpoint_dir"):
        load_state_dict_to_shards(stage)


def test_load_state_dict_to_meta_shard_from_a_dict(folder):
    path, model = folder
    with torch.device("meta"):
        stage = Stage()
    load_state_dict_to_shards(stage, load_sharded_state_dict(path, stage.state_dict().keys()))
    assert stage.layers["2"].mlp.weight.device.type == "cpu"
    assert torch.equal(stage.layers["2"].mlp.weight, model.layers[2].mlp.weight)


def test_save_sharded_model(tmp_path):
    stage = Stage()
    save_sharded_model(stage, tmp_path / "out" / "model.safetensors")
    stored = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert stored.keys() == stage.state_dict().keys()
    assert all(torch.equal(stored[k], v) for k, v in stage.state_dict().items())
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]


def test_set_submodule():
    model = Model()
    block = Block()
    set_submodule(model, "layers.1", block)
    assert model.layers[1] is block
    linear = nn.Linear(32, 32)
    set_submodule(model, "layers.0.mlp", linear)
    assert model.layers[0].mlp is linear
    set_submodule(model, "extra", nn.Identity())
    assert isinstance(model.extra, nn.Identity)
    with pytest.raises(CheckpointingException, match="no submodule 'nope'"):
        set_submodule(model, "nope.x", linear)
    with pytest.raises(CheckpointingException, match="non-empty"):
        set_submodule(model, "", linear)
    with pytest.raises(CheckpointingException, match="nn.Module"):
        set_submodule(model, "layers.1", torch.zeros(1))  # type: ignore[arg-type]
