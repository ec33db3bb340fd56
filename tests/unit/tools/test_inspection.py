"""Unit tests of dist_ckpt.tools.inspection: what a checkpoint holds, from its metadata alone."""

from __future__ import annotations

import json

import pytest

import dist_ckpt as dc
from dist_ckpt.hf import export
from dist_ckpt.tools.inspection import describe_value
from tests.sample_checkpoints import save_sample

BACKENDS = [("safetensors", 1), ("zarr", 1)]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b[0])
def test_inspect_a_sharded_checkpoint(tmp_path, backend):
    fulls = save_sample(tmp_path / "ckpt", backend)
    info = dc.inspect_checkpoint(tmp_path / "ckpt")
    assert info.kind == "dist_ckpt" and info.sharded_backend == f"{backend[0]}:1" and info.common_backend == "torch:1"
    assert info.world_size == 1 and info.library_version == dc.__version__
    tensors = {t.key: t for t in info.tensors}
    assert tensors.keys() == fulls.keys()
    for key, full in fulls.items():
        t = tensors[key]
        assert t.global_shape == tuple(full.shape) and t.nbytes == full.numel() * full.element_size()
    assert tensors["embedding.weight"].dtype == "bfloat16"
    assert tensors["embedding.weight"].layout == "4 chunks of [16, 16]"
    assert tensors["bits"].layout == "whole"
    assert tensors["optimizer.exp_avg"].layout.startswith("4 flattened ranges")
    assert tensors["layers"].num_shards == 4 and tensors["empty"].layout == "no stored bytes"
    stored = sum(s.nbytes for t in info.tensors for s in t.shards or ())
    assert stored == info.nbytes
    assert info.common_keys == {"step": "int = 1000", "config/hidden": "int = 16", "config/name": "str = 'tiny'"}
    assert info.sharded_objects == ("rng_state/shard_0_2", "rng_state/shard_1_2")
    assert info.files and info.file_bytes and info.file_bytes > info.nbytes


def test_every_stored_piece_is_listed_with_its_file(tmp_path):
    save_sample(tmp_path / "ckpt")
    info = dc.inspect_checkpoint(tmp_path / "ckpt")
    exp_avg = next(t for t in info.tensors if t.key == "optimizer.exp_avg")
    assert exp_avg.shards is not None
    ranges = sorted(s.flat_range for s in exp_avg.shards if s.flat_range is not None)
    assert len(ranges) == 4 and all((tmp_path / "ckpt" / f).is_file() for f in exp_avg.files or [])
    # the flattened ranges of each chunk partition it
    for box in {(s.global_offset, s.shape) for s in exp_avg.shards}:
        parts = sorted(s.flat_range for s in exp_avg.shards if (s.global_offset, s.shape) == box)
        assert parts[0][0] == 0 and all(a[1] == b[0] for a, b in zip(parts, parts[1:]))


def test_inspect_a_huggingface_folder(tmp_path):
    fulls = save_sample(tmp_path / "ckpt")
    export(tmp_path / "ckpt", tmp_path / "hf", max_shard_size=2000, include=["*"])
    info = dc.inspect_checkpoint(tmp_path / "hf")
    assert info.kind == "hf" and info.sharded_backend == "hf:1" and info.world_size is None
    assert {t.key for t in info.tensors} == set(fulls)
    assert all(t.layout in ("whole", "no stored bytes") for t in info.tensors)
    assert info.common_keys == {} and info.sharded_objects == ()


def test_json_is_serializable_and_complete(tmp_path):
    save_sample(tmp_path / "ckpt", ("zarr", 1))
    doc = json.loads(json.dumps(dc.inspect_checkpoint(tmp_path / "ckpt").to_json(with_shards=True)))
    assert doc["num_tensors"] == len(doc["tensors"]) == 6
    assert all("shards" in t and "global_shape" in t for t in doc["tensors"])


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(dc.NotACheckpointError, match="does not exist"):
        dc.inspect_checkpoint(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(dc.NotACheckpointError):
        dc.inspect_checkpoint(tmp_path / "empty")


def test_inspect_on_an_object_store(tmp_path, s3_url):
    fulls = save_sample(s3_url, ("safetensors", 1))
    info = dc.inspect_checkpoint(s3_url)
    assert info.path == s3_url and {t.key for t in info.tensors} == set(fulls)
    assert info.files and info.sharded_objects == ("rng_state/shard_0_2", "rng_state/shard_1_2")


def test_describe_value():
    import torch

    assert describe_value(3) == "int = 3"
    assert describe_value(torch.zeros(2, 3, dtype=torch.bfloat16)) == "tensor [2, 3] bfloat16"
    assert describe_value([1, 2]) == "list of 2"
    assert describe_value("x" * 100).endswith("...")
