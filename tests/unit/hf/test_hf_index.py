"""Unit tests of dist_ckpt.hf.index: shard indexes and tied parameters."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError
from dist_ckpt.hf import (
    create_sharing_metadata,
    index_file_name,
    load_shard_index,
    make_shard_index,
    retie_parameters,
    save_shard_index,
)
from dist_ckpt.hf.index import PARAM_SHARING_KEY, plan_shards, shard_file_name


def test_index_file_name_and_bin_refusal():
    assert index_file_name() == index_file_name(True) == "model.safetensors.index.json"
    with pytest.raises(CheckpointingException, match="pickle"):
        index_file_name(False)


def test_plan_shards():
    assert plan_shards([("a", 6), ("b", 6), ("c", 2)], 10) == [["a"], ["b", "c"]]
    assert plan_shards([("big", 50), ("s", 1)], 10) == [["big"], ["s"]]
    assert plan_shards([], 10) == []
    with pytest.raises(CheckpointingException, match="max_shard_size"):
        plan_shards([("a", 1)], 0)


def test_make_shard_index_sizes_and_names():
    sd = {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(5, dtype=torch.float64)}  # 40, 40, 40 bytes
    index = make_shard_index([sd], max_shard_size=80, metadata={"note": "x"})
    assert index["metadata"] == {"total_size": 120, "note": "x"}
    assert index["weight_map"] == {"a": shard_file_name(0, 2), "b": shard_file_name(0, 2), "c": shard_file_name(1, 2)}
    assert shard_file_name(0, 2) == "model-00001-of-00002.safetensors"


def test_each_state_dict_gets_its_own_files_and_meta_tensors_work():
    stages = [{"s0.w": torch.empty(4, device="meta")}, {"s1.w": torch.empty(4, device="meta")}]
    index = make_shard_index(stages, max_shard_size=10**6)
    assert index["weight_map"]["s0.w"] != index["weight_map"]["s1.w"]
    with pytest.raises(CheckpointingException, match="'s0.w' is in state dicts 0 and 1"):
        make_shard_index([stages[0], stages[0]])


def test_tied_parameters_are_stored_once():
    w = torch.zeros(3, 4)
    index = make_shard_index([{"embed": w, "head": w, "b": torch.zeros(2)}], param_sharing_metadata=[["embed", "head"]])
    assert set(index["weight_map"]) == {"embed", "b"}
    assert index["metadata"][PARAM_SHARING_KEY] == [["embed", "head"]]
    assert index["metadata"]["total_size"] == 48 + 8


def test_non_tensor_values_and_bin_are_refused():
    with pytest.raises(CheckpointingException, match="'extra' is a dict, not a tensor"):
        make_shard_index([{"extra": {}}])
    with pytest.raises(CheckpointingException, match="pickle"):
        make_shard_index([{"a": torch.zeros(1)}], safetensors=False)


def test_save_and_load_shard_index(tmp_path):
    index = make_shard_index([{"b": torch.zeros(2), "a": torch.zeros(3)}], metadata={"k": [1, 2]})
    save_shard_index(index, tmp_path / "out", index_file_name())
    raw = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert list(raw["weight_map"]) == ["a", "b"]  # sorted, like transformers writes it
    assert load_shard_index(tmp_path / "out", index_file_name()) == {
        "metadata": index["metadata"],
        "weight_map": index["weight_map"],
    }
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["model.safetensors.index.json"]  # no temporary left


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "is missing"),
        ("{nope", "not valid JSON"),
        ('{"metadata": {}}', "'weight_map'"),
        ('{"weight_map": {"a": "../outside.safetensors"}}', "not a plain file name"),
        ('{"weight_map": {"a": 3}}', "not a plain file name"),
        ('{"weight_map": {}, "metadata": []}', "'metadata' must be an object"),
        ('{"weight_map": {}, "metadata": {"param_sharing_metadata": "a"}}', "lists of names"),
    ],
)
def test_bad_index_files(tmp_path, content, message):
    if content is not None:
        (tmp_path / "model.safetensors.index.json").write_text(content)
    with pytest.raises(CorruptCheckpointError, match=message) as info:
        load_shard_index(tmp_path, "model.safetensors.index.json")
    assert "model.safetensors.index.json" in str(info.value)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(4))


def test_create_sharing_metadata():
    model = Tied()
    assert create_sharing_metadata(model) == [["embed.weight", "head.weight"]]
    model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    assert create_sharing_metadata(model) == []
    # two parameters viewing the same memory with the same shape count as tied
    model.head.weight = nn.Parameter(model.embed.weight.data)
    assert create_sharing_metadata(model) == [["embed.weight", "head.weight"]]


def test_create_sharing_metadata_on_meta_device():
    with torch.device("meta"):
        model = Tied()
    assert create_sharing_metadata(model) == [["embed.weight", "head.weight"]]


def test_retie_parameters():
    model = Tied()
    model.head.weight = nn.Parameter(torch.zeros(10, 4))
    retie_parameters(model, [["embed.weight", "head.weight"]])
    assert model.head.weight is model.embed.weight
    model.register_buffer("scale2", torch.zeros(4))
    retie_parameters(model, [["scale", "scale2"]])
    assert model.scale2 is model.scale
    with pytest.raises(CheckpointingException, match="no submodule 'nope'"):
        retie_parameters(model, [["embed.weight", "nope.weight"]])
    with pytest.raises(CheckpointingException, match="no parameter or buffer 'embed.missing'"):
        retie_parameters(model, [["embed.missing", "head.weight"]])
