"""Unit tests of dist_ckpt.hf.io: whole HuggingFace checkpoints from modules and dicts."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dist_ckpt.errors import (
    CheckpointingException,
    CorruptCheckpointError,
    KeyMismatchError,
    LoadMismatchError,
    NotACheckpointError,
)
from dist_ckpt.hf import (
    index_file_name,
    load_checkpoint,
    load_shard_index,
    load_sharded_checkpoint,
    make_shard_index,
    save_checkpoint,
    save_shard_index,
    save_sharded_checkpoint,
)


class Model(nn.Module):
    def __init__(self, tie: bool = True, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(layers)])
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 64, bias=False)
        if tie:
            self.head.weight = self.embed.weight


def same_values(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def weight_files(path):
    return sorted(p.name for p in path.iterdir())


# --------------------------------------------------------------------------- save


def test_single_file_when_it_fits(tmp_path):
    model = Model()
    save_checkpoint(tmp_path, model)
    assert weight_files(tmp_path) == ["model.safetensors"]
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "head.weight" not in stored and torch.equal(stored["embed.weight"], model.embed.weight)  # tied: once


def test_sharded_with_index(tmp_path):
    model = Model()
    save_checkpoint(tmp_path, model, max_shard_size=2000, metadata={"run": "abc"})
    index = load_shard_index(tmp_path, index_file_name())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and weight_files(tmp_path) == files + ["model.safetensors.index.json"]
    assert index["metadata"]["run"] == "abc" and index["metadata"]["param_sharing_metadata"] == [
        ["embed.weight", "head.weight"]
    ]
    total = 0
    for file in files:  # every shard is a plain safetensors file
        stored = load_file(str(tmp_path / file))
        total += sum(t.numel() * t.element_size() for t in stored.values())
        assert all(index["weight_map"][k] == file for k in stored)
    assert total == index["metadata"]["total_size"]


def test_resave_removes_stale_weight_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    save_checkpoint(tmp_path, Model(), max_shard_size=2000)
    save_checkpoint(tmp_path, Model())
    assert weight_files(tmp_path) == ["config.json", "model.safetensors"]
    save_checkpoint(tmp_path, Model(), max_shard_size=3000)
    assert "model.safetensors" not in weight_files(tmp_path) and "config.json" in weight_files(tmp_path)


def test_dict_mode_and_explicit_sharing(tmp_path):
    w = torch.randn(4, 4)
    save_checkpoint(tmp_path, {"a": w, "b": w, "c": torch.arange(3)}, param_sharing_metadata=[["a", "b"]])
    out = load_checkpoint(tmp_path, None)
    assert set(out) == {"a", "b", "c"} and out["a"] is out["b"] and torch.equal(out["a"], w)
    with pytest.raises(CheckpointingException, match="lacks"):
        save_checkpoint(tmp_path, {"a": w}, param_sharing_metadata=[["a", "zz"]])


def test_include_param_sharing_off_stores_both(tmp_path):
    save_checkpoint(tmp_path, Model(), include_param_sharing=False)
    assert "head.weight" in load_file(str(tmp_path / "model.safetensors"))


def test_bin_is_refused(tmp_path):
    with pytest.raises(CheckpointingException, match="pickle"):
        save_checkpoint(tmp_path, Model(), safetensors=False)
    torch.save({"w": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointingException, match="safetensors format only"):
        load_checkpoint(tmp_path, None)


def test_save_sharded_checkpoint_by_several_owners(tmp_path):
    stages = [{"s0.a": torch.randn(8), "s0.b": torch.randn(8)}, {"s1.a": torch.randn(8)}]
    index = make_shard_index(stages, max_shard_size=10**6)
    for stage in stages:  # e.g. one per pipeline rank
        save_sharded_checkpoint(tmp_path, index, stage)
    save_shard_index(index, tmp_path, index_file_name())
    out = load_checkpoint(tmp_path, None)
    assert all(torch.equal(out[k], v) for stage in stages for k, v in stage.items())


def test_save_sharded_checkpoint_refuses_partial_files_and_unknown_names(tmp_path):
    sd = {"a": torch.zeros(2), "b": torch.zeros(2)}
    index = make_shard_index([sd])
    with pytest.raises(CheckpointingException, match="lacks \\['b'\\]"):
        save_sharded_checkpoint(tmp_path, index, {"a": sd["a"]})
    with pytest.raises(CheckpointingException, match="not in the shard index"):
        save_sharded_checkpoint(tmp_path, index, {**sd, "c": torch.zeros(1)})


# --------------------------------------------------------------------------- load


@pytest.mark.parametrize("max_shard_size", [2**31, 2000])
def test_module_round_trip_reties(tmp_path, max_shard_size):
    model = Model()
    save_checkpoint(tmp_path, model, max_shard_size=max_shard_size)
    fresh = Model()
    fresh.head.weight = nn.Parameter(torch.zeros(64, 16))  # untied, wrong values
    params = {n: p for n, p in fresh.named_parameters()}
    load_checkpoint(tmp_path, fresh)
    assert fresh.head.weight is fresh.embed.weight and same_values(fresh, model)
    assert fresh.layers[0].weight is params["layers.0.weight"]  # loaded in place


def test_assign_loads_a_meta_model(tmp_path):
    model = Model()
    save_checkpoint(tmp_path, model, max_shard_size=2000)
    with torch.device("meta"):
        fresh = Model()
    with pytest.raises(LoadMismatchError, match="assign=True"):
        load_checkpoint(tmp_path, fresh)
    load_checkpoint(tmp_path, fresh, assign=True)
    assert fresh.head.weight is fresh.embed.weight and same_values(fresh, model)


def test_strict_checks_happen_before_reading(tmp_path):
    save_checkpoint(tmp_path, Model(layers=3))
    smaller, larger = Model(layers=2), Model(layers=4)
    before = {k: v.clone() for k, v in smaller.state_dict().items()}
    with pytest.raises(KeyMismatchError, match="the model has no") as info:
        load_checkpoint(tmp_path, smaller)
    assert "layers.2.weight" in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in smaller.state_dict().items())  # nothing loaded
    with pytest.raises(KeyMismatchError, match="the checkpoint lacks"):
        load_checkpoint(tmp_path, larger)
    load_checkpoint(tmp_path, larger, strict=False)  # the common part


def test_shape_and_dtype_mismatches(tmp_path):
    saved = Model()
    save_checkpoint(tmp_path, saved)
    other = Model()
    other.norm.weight = nn.Parameter(torch.ones(17))
    with pytest.raises(LoadMismatchError, match="'norm.weight'"):
        load_checkpoint(tmp_path, other)
    other = Model().to(torch.float64)  # cast, as torch's load_state_dict does
    load_checkpoint(tmp_path, other)
    assert torch.equal(other.layers[0].weight, saved.layers[0].weight.to(torch.float64))
    with pytest.raises(LoadMismatchError, match="float64"):
        load_checkpoint(tmp_path, Model().to(torch.float64), allow_dtype_cast=False)


def test_dict_mode_keys(tmp_path):
    model = Model()
    save_checkpoint(tmp_path, model, max_shard_size=2000)
    out = load_checkpoint(tmp_path, None, keys={"norm.bias", "head.weight"})
    assert set(out) == {"norm.bias", "head.weight"} and torch.equal(out["head.weight"], model.embed.weight)
    with pytest.raises(KeyMismatchError, match="'nope'"):
        load_checkpoint(tmp_path, None, keys={"nope"})
    with pytest.raises(CheckpointingException, match="dict mode"):
        load_checkpoint(tmp_path, model, keys={"norm.bias"})


def test_load_sharded_checkpoint_modes(tmp_path):
    model = Model()
    save_checkpoint(tmp_path, model, max_shard_size=2000)
    index = load_shard_index(tmp_path, index_file_name(True))
    # a model that has more than the index: the rest is reported as unloaded
    part = {k: v for k, v in index["weight_map"].items() if k.startswith("layers.")}
    bigger = Model()
    unloaded = load_sharded_checkpoint(tmp_path, {"metadata": index["metadata"], "weight_map": part}, bigger)
    assert unloaded == {"embed.weight", "head.weight", "norm.weight", "norm.bias"}
    assert torch.equal(bigger.layers[1].bias, model.layers[1].bias)
    # dict mode
    out = load_sharded_checkpoint(tmp_path, index, None, device="cpu", keys={"layers.0.bias"})
    assert list(out) == ["layers.0.bias"]
    # strict: index names the model lacks
    with pytest.raises(KeyMismatchError, match="layers.2"):
        load_sharded_checkpoint(tmp_path, index, Model(layers=2))


def test_reads_checkpoints_written_by_safetensors(tmp_path):
    """A folder written by the safetensors library itself (bf16, fp8, int, index + 2 shards)."""
    tensors = {
        "a": torch.randn(5, 3).to(torch.bfloat16),
        "b": torch.randn(7).to(torch.float8_e4m3fn),
        "c": torch.arange(12, dtype=torch.int32).reshape(3, 4),
    }
    save_file({"a": tensors["a"]}, str(tmp_path / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file({"b": tensors["b"], "c": tensors["c"]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {
        "metadata": {"total_size": 0},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        },
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    out = load_checkpoint(tmp_path, None)
    for k, v in tensors.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k].view(torch.uint8), v.view(torch.uint8))


# --------------------------------------------------------------------------- damaged folders


def test_index_naming_a_missing_file(tmp_path):
    save_checkpoint(tmp_path, Model(), max_shard_size=2000)
    index = load_shard_index(tmp_path, index_file_name())
    victim = index["weight_map"]["layers.1.weight"]
    os.unlink(tmp_path / victim)
    with pytest.raises(CorruptCheckpointError, match="is missing") as info:
        load_checkpoint(tmp_path, None)
    assert victim in str(info.value) and "'layers.1.weight'" in str(info.value)


def test_truncated_shard(tmp_path):
    save_checkpoint(tmp_path, Model(), max_shard_size=2000)
    index = load_shard_index(tmp_path, index_file_name())
    victim = tmp_path / index["weight_map"]["norm.weight"]
    victim.write_bytes(victim.read_bytes()[:-3])
    with pytest.raises(CorruptCheckpointError, match="truncated") as info:
        load_checkpoint(tmp_path, None, keys={"norm.weight"})
    assert str(victim) in str(info.value)


def test_index_and_file_disagree(tmp_path):
    save_checkpoint(tmp_path, Model(), max_shard_size=2000)
    index = load_shard_index(tmp_path, index_file_name())
    files = sorted(set(index["weight_map"].values()))
    index["weight_map"]["norm.weight"] = next(f for f in files if f != index["weight_map"]["norm.weight"])
    save_shard_index(index, tmp_path, index_file_name())
    with pytest.raises(CorruptCheckpointError, match="does not list it") as info:
        load_checkpoint(tmp_path, None, keys={"norm.weight"})
    assert "'norm.weight'" in str(info.value)


def test_empty_folder(tmp_path):
    with pytest.raises(NotACheckpointError, match="no HuggingFace weights"):
        load_checkpoint(tmp_path, None)
    with pytest.raises(NotACheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "absent", None)
