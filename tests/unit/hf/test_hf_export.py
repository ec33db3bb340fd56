"""Unit tests of dist_ckpt.hf.export and the ``dist-ckpt export-hf`` command."""

from __future__ import annotations

import argparse

import pytest
import torch
from safetensors.torch import load_file

import dist_ckpt as dc
from dist_ckpt import cli
from dist_ckpt.backends.safetensors.strategy import SafetensorsLoadShardedStrategy
from dist_ckpt.cli.common import size_arg
from dist_ckpt.errors import CheckpointExistsError
from dist_ckpt.hf import export, load_checkpoint, load_shard_index
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.testing.layouts import bitwise_equal, flat_shards, full_tensor, tp_shards

BACKENDS = [("safetensors", 1), ("zarr", 1)]


def saved(path, backend):
    """A checkpoint of 4 virtual ranks: TP splits, flattened ranges, stacked layers, bf16."""
    fulls = {
        "embedding.weight": full_tensor("embedding.weight", (64, 16), torch.bfloat16),
        "decoder.fc2.weight": full_tensor("decoder.fc2.weight", (16, 32)),
        "optimizer.exp_avg": full_tensor("optimizer.exp_avg", (24, 10)),
        "layers": full_tensor("layers", (4, 6), torch.int32),
    }
    sd = {}
    sd.update(tp_shards("embedding.weight", fulls["embedding.weight"], 0, 4, 0, 1))
    sd.update(tp_shards("decoder.fc2.weight", fulls["decoder.fc2.weight"], 1, 4, 0, 1))
    sd.update(flat_shards("optimizer.exp_avg", fulls["optimizer.exp_avg"], 0, 2, 2, 0, 1))
    for i in range(4):
        sd[f"L{i}"] = ShardedTensor.from_rank_offsets(
            "layers", fulls["layers"][i].clone(), (0, i, 4), prepend_axis_num=1
        )
    sd["step"] = 7
    dc.save(sd, path, sharded_strategy=backend)
    return fulls


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b[0])
def test_export_single_file(tmp_path, backend):
    fulls = saved(tmp_path / "ckpt", backend)
    result = export(tmp_path / "ckpt", tmp_path / "hf", include=["*"])
    assert result.files == ("model.safetensors",) and result.index is None and result.tensors == 4
    assert result.total_bytes == sum(t.numel() * t.element_size() for t in fulls.values())
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert stored.keys() == fulls.keys() and all(bitwise_equal(stored[k], fulls[k]) for k in fulls)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b[0])
def test_export_sharded(tmp_path, backend):
    fulls = saved(tmp_path / "ckpt", backend)
    result = export(
        tmp_path / "ckpt", tmp_path / "hf", include=["*"], max_shard_size=2100, metadata={"iteration": 1000}
    )
    assert len(result.files) > 1 and result.index == "model.safetensors.index.json"
    index = load_shard_index(tmp_path / "hf", result.index)
    assert index["metadata"] == {"total_size": result.total_bytes, "iteration": 1000}
    stored = {}
    for file in result.files:
        stored.update(load_file(str(tmp_path / "hf" / file)))
    assert stored.keys() == fulls.keys() and all(bitwise_equal(stored[k], fulls[k]) for k in fulls)
    # the folder is readable by our HF loader and by dist_ckpt.load
    assert bitwise_equal(load_checkpoint(tmp_path / "hf", None)["layers"], fulls["layers"])


def test_export_assembles_one_tensor_at_a_time(tmp_path, monkeypatch):
    saved(tmp_path / "ckpt", ("safetensors", 1))
    calls = []
    original = SafetensorsLoadShardedStrategy.load

    def spy(self, sd, checkpoint_dir):
        calls.append(sorted(sd))
        return original(self, sd, checkpoint_dir)

    monkeypatch.setattr(SafetensorsLoadShardedStrategy, "load", spy)
    export(tmp_path / "ckpt", tmp_path / "hf", include=["*"], max_shard_size=2100)
    assert calls == [[k] for k in sorted(["embedding.weight", "decoder.fc2.weight", "optimizer.exp_avg", "layers"])]


def test_export_refuses_a_folder_with_weights(tmp_path):
    saved(tmp_path / "ckpt", ("safetensors", 1))
    export(tmp_path / "ckpt", tmp_path / "hf", include=["*"])
    with pytest.raises(CheckpointExistsError, match="already holds"):
        export(tmp_path / "ckpt", tmp_path / "hf", include=["*"])


def test_export_complex128_as_float64_pairs(tmp_path, caplog):
    value = torch.randn(3, dtype=torch.complex128)
    dc.save({"c": ShardedTensor.from_rank_offsets("c", value)}, tmp_path / "ckpt")
    export(tmp_path / "ckpt", tmp_path / "hf", include=["*"])
    stored = load_file(str(tmp_path / "hf" / "model.safetensors"))["c"]
    assert torch.equal(torch.view_as_complex(stored), value)
    assert "complex128" in caplog.text


# --------------------------------------------------------------------------- the command


def test_cli_export_hf(tmp_path, capsys):
    fulls = saved(tmp_path / "ckpt", ("zarr", 1))
    status = cli.main(
        ["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--max-shard-size", "2.1KB", "--include", "*"]
    )
    out = capsys.readouterr().out
    assert status == 0 and "4 tensors" in out and "model.safetensors.index.json" in out
    stored = {}
    for file in (tmp_path / "hf").glob("model-*.safetensors"):
        stored.update(load_file(str(file)))
    assert all(bitwise_equal(stored[k], fulls[k]) for k in fulls)


def test_cli_export_hf_errors(tmp_path, capsys):
    assert cli.main(["export-hf", str(tmp_path / "absent"), str(tmp_path / "hf")]) == 2  # a bad path
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["export-hf", str(tmp_path), str(tmp_path / "hf"), "--max-shard-size", "lots"])
    assert info.value.code == 2


@pytest.mark.parametrize(
    "text,value", [("5GB", 5 * 10**9), ("2GiB", 2**31), ("1000", 1000), ("1.5 MB", 1_500_000), ("512kib", 512 * 1024)]
)
def test_size_argument(text, value):
    assert size_arg(text) == value


@pytest.mark.parametrize("text", ["", "GB", "5XB", "0", "-1MB"])
def test_bad_size_argument(text):
    with pytest.raises(argparse.ArgumentTypeError):
        size_arg(text)
