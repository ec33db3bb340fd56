"""dist_ckpt.load of HuggingFace folders (the ("hf", 1) strategies), in one process.

Several ShardedTensors of one key in one process stand for several ranks ("virtual ranks").
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import dist_ckpt as dc
from dist_ckpt.errors import CorruptCheckpointError, KeyMismatchError, LoadMismatchError
from dist_ckpt.hf import HFLoadShardedStrategy, save_checkpoint
from dist_ckpt.record.commit import HF_CONFIG, detect_config
from dist_ckpt.testing.layouts import bitwise_equal, expected_data, flat_shards, tp_shards

FULL = {
    "model.embed_tokens.weight": torch.randn(32, 8),
    "model.layers.0.mlp.down_proj.weight": torch.randn(8, 24).to(torch.bfloat16),
    "model.norm.weight": torch.randn(8),
}


def write_hf(path, with_tie_metadata: bool = True) -> None:
    """index + two shard files written by the safetensors library; lm_head tied to the embedding."""
    save_file(
        {"model.embed_tokens.weight": FULL["model.embed_tokens.weight"]}, str(path / "model-00001-of-00002.safetensors")
    )
    save_file(
        {k: FULL[k] for k in ("model.layers.0.mlp.down_proj.weight", "model.norm.weight")},
        str(path / "model-00002-of-00002.safetensors"),
    )
    metadata = {"total_size": 0}
    if with_tie_metadata:
        metadata["param_sharing_metadata"] = [["model.embed_tokens.weight", "lm_head.weight"]]
    weight_map = {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "model.layers.0.mlp.down_proj.weight": "model-00002-of-00002.safetensors",
        "model.norm.weight": "model-00002-of-00002.safetensors",
    }
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": metadata, "weight_map": weight_map}))


def request(tp: int, with_head: bool = True):
    sd = {}
    sd.update(tp_shards("model.embed_tokens.weight", FULL["model.embed_tokens.weight"], 0, tp, 0, 1, empty=True))
    sd.update(
        tp_shards(
            "model.layers.0.mlp.down_proj.weight", FULL["model.layers.0.mlp.down_proj.weight"], 1, tp, 0, 1, empty=True
        )
    )
    sd.update(tp_shards("model.norm.weight", FULL["model.norm.weight"], 0, 1, 0, 1, empty=True))
    if with_head:
        sd.update(
            {
                f"head{k}": v
                for k, v in tp_shards(
                    "lm_head.weight", FULL["model.embed_tokens.weight"], 0, tp, 0, 1, empty=True
                ).items()
            }
        )
    return sd


def full_of(key):
    return FULL["model.embed_tokens.weight"] if key == "lm_head.weight" else FULL[key]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_dist_ckpt_load_reads_an_hf_folder_in_any_tp_split(tmp_path, tp):
    write_hf(tmp_path)
    sd = request(tp)
    loaded = dc.load(sd, tmp_path)
    for k, sh in sd.items():
        assert loaded[k] is sh.data and bitwise_equal(loaded[k], expected_data(sh, full_of(sh.key))), k


def test_flattened_ranges(tmp_path):
    write_hf(tmp_path)
    full = FULL["model.layers.0.mlp.down_proj.weight"]
    sd = flat_shards("model.layers.0.mlp.down_proj.weight", full, 1, 2, 3, 0, 1, empty=True)
    loaded = dc.load(sd, tmp_path)
    assert all(bitwise_equal(loaded[k], expected_data(sh, full)) for k, sh in sd.items())


def test_tie_given_to_the_strategy(tmp_path):
    write_hf(tmp_path, with_tie_metadata=False)
    with pytest.raises(KeyMismatchError, match="'lm_head.weight'"):
        dc.load(request(2), tmp_path)
    strategy = HFLoadShardedStrategy(aliases={"lm_head.weight": "model.embed_tokens.weight"})
    sd = request(2)
    loaded = dc.load(sd, tmp_path, sharded_strategy=strategy)
    assert bitwise_equal(loaded["headlm_head.weight@tp1dp0"], FULL["model.embed_tokens.weight"][16:])


def test_config_detection(tmp_path):
    write_hf(tmp_path)
    assert detect_config(tmp_path) == HF_CONFIG
    assert not dc.check_is_distributed_checkpoint(tmp_path)  # not a committed dist_ckpt checkpoint
    ckpt = tmp_path / "ckpt"
    dc.save({"w": dc.ShardedTensor.from_rank_offsets("w", torch.ones(2))}, ckpt, sharded_strategy=("safetensors", 1))
    save_checkpoint(ckpt, {"other": torch.zeros(1)})  # HF files next to metadata.json: metadata.json wins
    assert detect_config(ckpt).sharded_backend == "safetensors"


def test_metadata_unshard_and_plain_tensors(tmp_path):
    write_hf(tmp_path)
    meta = dc.load_tensors_metadata(tmp_path)
    assert set(meta) == set(FULL) | {"lm_head.weight"}
    assert meta["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    plain = dc.load_plain_tensors(tmp_path)
    assert all(bitwise_equal(plain[k], full_of(k)) for k in meta)
    assert bitwise_equal(
        dc.unshard(tmp_path, keys=["lm_head.weight"])["lm_head.weight"], FULL["model.embed_tokens.weight"]
    )


def test_strict_modes_and_common_state(tmp_path):
    write_hf(tmp_path)
    sd = request(2, with_head=False)
    sd["step"] = 5  # a common value: an HF folder has none, load leaves it out
    loaded, missing, unexpected = dc.load(sd, tmp_path, strict=dc.StrictHandling.RETURN_ALL)
    assert missing == {"lm_head.weight"} and unexpected == set() and "step" not in loaded


def test_sharded_objects_are_refused(tmp_path):
    write_hf(tmp_path)
    with pytest.raises(KeyMismatchError, match="holds tensors only"):
        dc.load({"o": dc.ShardedObject("rng", None, (1,), (0,))}, tmp_path)


def test_wrong_dtype_or_shape(tmp_path):
    write_hf(tmp_path)
    sd = {"x": dc.ShardedTensor.from_rank_offsets("model.norm.weight", torch.empty(8, dtype=torch.float16))}
    with pytest.raises(LoadMismatchError, match="'model.norm.weight'"):
        dc.load(sd, tmp_path, allow_dtype_cast=False)
    assert torch.equal(dc.load(sd, tmp_path)["x"], FULL["model.norm.weight"].to(torch.float16))
    sd = {"x": dc.ShardedTensor.from_rank_offsets("model.norm.weight", torch.empty(9))}
    with pytest.raises(LoadMismatchError, match="allow_shape_mismatch"):
        dc.load(sd, tmp_path)


def test_damaged_file(tmp_path):
    write_hf(tmp_path)
    victim = tmp_path / "model-00002-of-00002.safetensors"
    victim.write_bytes(victim.read_bytes()[:-1])
    with pytest.raises(CorruptCheckpointError) as info:
        dc.load(request(2), tmp_path)
    assert str(victim) in str(info.value)
