"""``remove_sharded_tensors(checkpoint_dir, key_prefix)`` on torch_dist checkpoints: every stored key with the
prefix goes (tensors and ShardedObjects, wherever they lie), files left without an item are deleted, and the
result still loads -- checksums verified, in DCP itself, and with megatron-core 0.15's flattened tensors
still reformulated."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dist_ckpt as dc
from dist_ckpt.backends.torch_dist.save import TorchDistSaveShardedStrategy
from dist_ckpt.errors import CorruptCheckpointError, KeyMismatchError
from tests.golden.torch_dist import expected as E
from tests.torch_dist_golden import fixture_dir

pytestmark = pytest.mark.filterwarnings("ignore")


def _save(path: Path) -> None:
    state = {
        "model.w": dc.ShardedTensor.from_rank_offsets("model.w", torch.arange(12.0).reshape(3, 4)),
        "optimizer.m": dc.ShardedTensor.from_rank_offsets("optimizer.m", torch.ones(64)),
        "optimizer.v": dc.ShardedTensor.from_rank_offsets("optimizer.v", torch.full((64,), 2.0)),
        "optimizer.groups": dc.ShardedObject("optimizer.groups", {"lr": 0.1}, (1,), (0,)),
        "step": 3,
    }
    dc.save(state, path, sharded_strategy=TorchDistSaveShardedStrategy(thread_count=4))


def test_removed_keys_are_gone_and_the_rest_still_loads_verified(tmp_path: Path) -> None:
    _save(tmp_path)
    files_before = sorted(p.name for p in tmp_path.glob("*.distcp"))
    dc.remove_sharded_tensors(tmp_path, "optimizer.")

    assert set(dc.load_tensors_metadata(tmp_path)) == {"model.w"}
    assert sorted(dc.load_sharded_metadata(tmp_path)) == ["model.w"]
    files_after = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert len(files_after) < len(files_before)  # files holding only optimizer items were deleted
    loaded = dc.load({"w": dc.ShardedTensor.from_rank_offsets("model.w", torch.zeros(3, 4))}, tmp_path)
    assert torch.equal(loaded["w"], torch.arange(12.0).reshape(3, 4)) and loaded["step"] == 3
    assert dc.verify_checkpoint(tmp_path).ok
    with pytest.raises(KeyMismatchError, match="optimizer.m"):
        dc.load({"m": dc.ShardedTensor.from_rank_offsets("optimizer.m", torch.zeros(64))}, tmp_path)

    plain = {"model.w": torch.zeros(3, 4)}  # DCP itself reads the rewritten .metadata
    dcp.load(plain, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(plain["model.w"], torch.arange(12.0).reshape(3, 4))


def test_a_damaged_checkpoint_is_refused_before_any_change(tmp_path: Path) -> None:
    _save(tmp_path)
    metadata = tmp_path / ".metadata"
    raw = bytearray(metadata.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    metadata.write_bytes(bytes(raw))
    files = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CorruptCheckpointError):
        dc.remove_sharded_tensors(tmp_path, "optimizer.")
    assert sorted(p.name for p in tmp_path.iterdir()) == files and metadata.read_bytes() == bytes(raw)


def test_megatron_0_15_flattened_tensors_keep_their_reformulation(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fixture_dir("flat_legacy_mcore015"), ckpt)
    dc.remove_sharded_tensors(ckpt, "optimizer.state.fp32_param.")
    key = "optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight"
    stored = dc.load_tensors_metadata(ckpt)
    assert key in stored and not any(k.startswith("optimizer.state.fp32_param.") for k in stored)
    request = dc.ShardedTensor.from_rank_offsets_flat(
        key, torch.zeros(30), (8, 8), (0, 1, 2), flattened_range=slice(10, 40)
    )
    loaded = dc.load({"m": request}, ckpt, validate_access_integrity=False)
    assert torch.equal(loaded["m"], E.full_tensor(key, (16, 8), torch.float32)[8:].flatten()[10:40])
