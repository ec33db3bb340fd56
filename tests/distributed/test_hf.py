"""HuggingFace interoperability across ranks: export a multi-rank checkpoint, and load an HF
folder straight into a tensor-parallel sharded state dict, each rank reading only its slices."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import dist_ckpt as dc
from dist_ckpt.backends.safetensors import io as safetensors_io
from dist_ckpt.hf import export
from dist_ckpt.testing.layouts import bitwise_equal, expected_data, flat_shards, full_tensor, tp_shards

from .helpers import assert_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)

BACKENDS = [("safetensors", 1), ("zarr", 1)]


def _state_of_4_participants() -> Dict[str, torch.Tensor]:
    """Full tensors; shards of them held by 4 participants (4 ranks, or 2 ranks x 2)."""
    return {
        "embedding.word_embeddings.weight": full_tensor("embedding.word_embeddings.weight", (64, 32), torch.bfloat16),
        "decoder.layers.mlp.linear_fc2.weight": full_tensor("decoder.layers.mlp.linear_fc2.weight", (32, 128)),
        "decoder.final_layernorm.weight": full_tensor("decoder.final_layernorm.weight", (32,)),
        "optimizer.state.exp_avg.embedding": full_tensor("optimizer.state.exp_avg.embedding", (64, 32)),
    }


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: f"{b[0]}-v{b[1]}")
def test_saved_by_4_exported_to_hf_equals_full_tensors(backend, shared_tmp_path: Path) -> None:
    fulls = _state_of_4_participants()
    sd: Dict[str, dc.ShardedTensor] = {}
    sd.update(
        tp_shards(
            "embedding.word_embeddings.weight", fulls["embedding.word_embeddings.weight"], 0, 4, rank(), world(), dp=1
        )
    )
    sd.update(
        tp_shards(
            "decoder.layers.mlp.linear_fc2.weight",
            fulls["decoder.layers.mlp.linear_fc2.weight"],
            1,
            4,
            rank(),
            world(),
            dp=1,
        )
    )
    sd.update(
        tp_shards(
            "decoder.final_layernorm.weight", fulls["decoder.final_layernorm.weight"], 0, 1, rank(), world(), dp=4
        )
    )
    sd.update(
        flat_shards(
            "optimizer.state.exp_avg.embedding", fulls["optimizer.state.exp_avg.embedding"], 0, 2, 2, rank(), world()
        )
    )
    dc.save(sd, shared_tmp_path / "ckpt", sharded_strategy=backend)
    ok, detail = True, ""
    if rank() == 0:  # one process, no collective: the export is a single-process tool
        result = export(shared_tmp_path / "ckpt", shared_tmp_path / "hf", max_shard_size=9000, include=["*"])
        stored: Dict[str, torch.Tensor] = {}
        for file in result.files:
            stored.update(load_file(str(shared_tmp_path / "hf" / file)))
        ok = (
            len(result.files) > 1
            and stored.keys() == fulls.keys()
            and all(bitwise_equal(stored[k], fulls[k]) for k in fulls)
        )
        detail = f"files {result.files}, keys {sorted(stored)}"
    assert_on_all_ranks(ok, f"exported tensors differ from the saved ones: {detail}")


# --------------------------------------------------------------------------- HF folder -> TP shards

HF_FULL = {
    "model.embed_tokens.weight": full_tensor("model.embed_tokens.weight", (1024, 512), torch.bfloat16),
    "model.layers.0.mlp.up_proj.weight": full_tensor("model.layers.0.mlp.up_proj.weight", (2048, 512), torch.bfloat16),
    # row parallel: split along columns; fp32 rows of 4096 keep each rank's runs >= 4 KiB at TP=4
    "model.layers.0.mlp.down_proj.weight": full_tensor("model.layers.0.mlp.down_proj.weight", (256, 4096)),
    "model.layers.0.self_attn.q_proj.weight": full_tensor("model.layers.0.self_attn.q_proj.weight", (512, 512)),
    "model.norm.weight": full_tensor("model.norm.weight", (512,)),
}
FILES = {
    "model-00001-of-00003.safetensors": ["model.embed_tokens.weight"],
    "model-00002-of-00003.safetensors": ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"],
    "model-00003-of-00003.safetensors": ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"],
}


def _write_hf_folder(path: Path) -> None:
    """What a transformers model with tied embeddings looks like on disk, written with the
    safetensors library: three shard files and an index; lm_head.weight is not stored."""
    path.mkdir(parents=True, exist_ok=True)
    for file, keys in FILES.items():
        save_file({k: HF_FULL[k] for k in keys}, str(path / file), metadata={"format": "pt"})
    weight_map = {k: file for file, keys in FILES.items() for k in keys}
    metadata = {
        "total_size": sum(t.numel() * t.element_size() for t in HF_FULL.values()),
        "param_sharing_metadata": [["model.embed_tokens.weight", "lm_head.weight"]],
    }
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": metadata, "weight_map": weight_map}))


def _full(key: str) -> torch.Tensor:
    return HF_FULL["model.embed_tokens.weight"] if key == "lm_head.weight" else HF_FULL[key]


def _tp_request(tp: int) -> Dict[str, dc.ShardedTensor]:
    """This rank's Megatron-style slices: vocab-parallel embedding and (tied) output layer,
    column- and row-parallel MLP, a replicated norm, and distributed-optimizer-style flattened
    ranges of q_proj (uneven cuts over the ranks)."""
    sd: Dict[str, dc.ShardedTensor] = {}
    sd.update(
        tp_shards("model.embed_tokens.weight", _full("model.embed_tokens.weight"), 0, tp, rank(), world(), empty=True)
    )
    sd.update(
        {
            f"out/{k}": v
            for k, v in tp_shards("lm_head.weight", _full("lm_head.weight"), 0, tp, rank(), world(), empty=True).items()
        }
    )
    sd.update(
        tp_shards(
            "model.layers.0.mlp.up_proj.weight",
            _full("model.layers.0.mlp.up_proj.weight"),
            0,
            tp,
            rank(),
            world(),
            empty=True,
        )
    )
    sd.update(
        tp_shards(
            "model.layers.0.mlp.down_proj.weight",
            _full("model.layers.0.mlp.down_proj.weight"),
            1,
            tp,
            rank(),
            world(),
            empty=True,
        )
    )
    sd.update(tp_shards("model.norm.weight", _full("model.norm.weight"), 0, 1, rank(), world(), empty=True))
    sd.update(
        flat_shards(
            "model.layers.0.self_attn.q_proj.weight",
            _full("model.layers.0.self_attn.q_proj.weight"),
            0,
            1,
            world(),
            rank(),
            world(),
            empty=True,
        )
    )
    return sd


def test_hf_folder_loads_into_tp_shards_reading_only_each_ranks_slices(
    shared_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = shared_tmp_path / "Llama-tiny"
    if rank() == 0:
        _write_hf_folder(folder)
    dist.barrier()
    read = {"bytes": 0}
    original = safetensors_io.read_into

    def counting(fd, buffers, offset):  # every byte dist_ckpt reads from a safetensors file
        n = original(fd, buffers, offset)
        read["bytes"] += n
        return n

    monkeypatch.setattr(safetensors_io, "read_into", counting)
    request = _tp_request(world())
    loaded = dc.load(request, folder)  # the same call as for any checkpoint
    bad = [k for k, sh in request.items() if not bitwise_equal(loaded[k], expected_data(sh, _full(sh.key)))]
    assert_on_all_ranks(not bad, f"slices differ: {bad}")
    in_place = all(loaded[k] is sh.data for k, sh in request.items())
    assert_on_all_ranks(in_place, "not loaded in place")
    slice_bytes = sum(sh.data.numel() * sh.data.element_size() for sh in request.values())
    ok = slice_bytes <= read["bytes"] <= 1.10 * slice_bytes
    assert_on_all_ranks(ok, f"read {read['bytes']} bytes for {slice_bytes} bytes of slices")


def test_hf_folder_loads_into_another_dtype_reading_each_stored_byte_once(
    shared_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fp32 / bf16 folder loaded into the other dtype (fp32 master weights into a bf16 model
    and back), as TP shards and flattened ranges: ``stored.to(requested)``, each rank reading
    about its slices' stored bytes (the casts go through the bounce buffers, not whole copies)."""
    folder = shared_tmp_path / "Llama-tiny"
    if rank() == 0:
        _write_hf_folder(folder)
    dist.barrier()
    read = {"bytes": 0}
    original = safetensors_io.read_into

    def counting(fd, buffers, offset):
        n = original(fd, buffers, offset)
        read["bytes"] += n
        return n

    monkeypatch.setattr(safetensors_io, "read_into", counting)
    other = {torch.float32: torch.bfloat16, torch.bfloat16: torch.float32}
    request = {}
    for k, sh in _tp_request(world()).items():
        dtype = other[sh.dtype]
        request[k] = dataclasses.replace(sh, dtype=dtype, data=torch.zeros_like(sh.data, dtype=dtype))
    loaded = dc.load(request, folder)
    bad = [
        k for k, sh in request.items() if not bitwise_equal(loaded[k], expected_data(sh, _full(sh.key).to(sh.dtype)))
    ]
    assert_on_all_ranks(not bad, f"cast slices differ: {bad}")
    assert_on_all_ranks(all(loaded[k] is sh.data for k, sh in request.items()), "not loaded in place")
    stored_bytes = sum(sh.data.numel() * _full(sh.key).element_size() for sh in request.values())
    ok = stored_bytes <= read["bytes"] <= 1.10 * stored_bytes
    assert_on_all_ranks(ok, f"read {read['bytes']} bytes for {stored_bytes} stored bytes of slices")
