"""Unit tests of dist_ckpt.tools.unshard: full tensors from any backend, one process, no process group."""

from __future__ import annotations

import types

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.registry import StrategyAction, get_default_strategy
from dist_ckpt.errors import KeyMismatchError, NotACheckpointError
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.testing.layouts import bitwise_equal, flat_shards, full_tensor, tp_shards

BACKENDS = [("safetensors", 1), ("zarr", 1)]


def _state():
    """Three tensors saved by 4 virtual ranks: TP rows, TP columns (bf16), flattened optimizer
    ranges, plus stacked layers with a prepended axis."""
    fulls = {
        "rows": full_tensor("rows", (8, 6)),
        "cols": full_tensor("cols", (6, 8), torch.bfloat16),
        "opt": full_tensor("opt", (12, 5)),
        "layers": full_tensor("layers", (4, 3, 2), torch.int64),
    }
    sd = {}
    sd.update(tp_shards("rows", fulls["rows"], 0, 4, 0, 1))
    sd.update(tp_shards("cols", fulls["cols"], 1, 4, 0, 1))
    sd.update(flat_shards("opt", fulls["opt"], 0, 2, 2, 0, 1))
    for layer in range(4):
        sd[f"L{layer}"] = ShardedTensor.from_rank_offsets(
            "layers", fulls["layers"][layer].clone(), (0, layer, 4), prepend_axis_num=1
        )
    return sd, fulls


@pytest.fixture(params=BACKENDS, ids=lambda b: b[0])
def checkpoint(request, tmp_path):
    sd, fulls = _state()
    dc.save(sd, tmp_path / "ckpt", sharded_strategy=request.param)
    return tmp_path / "ckpt", fulls


def test_unshard_everything(checkpoint):
    path, fulls = checkpoint
    out = dc.unshard(path)
    assert list(out) == sorted(fulls)
    assert all(bitwise_equal(out[k], fulls[k]) for k in fulls)


def test_unshard_some_keys_in_the_given_order(checkpoint):
    path, fulls = checkpoint
    out = dc.unshard(path, keys=["opt", "cols"])
    assert list(out) == ["opt", "cols"]
    assert bitwise_equal(out["opt"], fulls["opt"]) and bitwise_equal(out["cols"], fulls["cols"])


def test_unknown_key_is_reported_before_reading(checkpoint):
    path, _ = checkpoint
    with pytest.raises(KeyMismatchError, match="'nope'") as info:
        dc.unshard(path, keys=["rows", "nope"])
    assert str(path) in str(info.value)


def test_iter_unsharded_reads_one_tensor_at_a_time(checkpoint, monkeypatch):
    path, fulls = checkpoint
    backend = "safetensors" if (path / "safetensors").is_dir() else "zarr"
    strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, backend, 1)
    calls = []
    original = strategy.load

    def counting(self, sd, checkpoint_dir):
        calls.append(list(sd))
        return original(sd, checkpoint_dir)

    strategy.load = types.MethodType(counting, strategy)
    it = dc.iter_unsharded(path, sharded_strategy=strategy)
    key, tensor = next(it)
    assert calls == [[key]] and bitwise_equal(tensor, fulls[key])  # nothing else was read yet
    rest = dict(it)
    assert [c for (c,) in calls] == sorted(fulls) and set(rest) == set(fulls) - {key}


def test_load_plain_tensors_for_every_backend(checkpoint):
    """As in Megatron-Core: every tensor whole, the one saved as flattened ranges flat (1-D);
    unshard (above) gives it its shape."""
    path, fulls = checkpoint
    out = dc.load_plain_tensors(path)
    expected = dict(fulls, opt=fulls["opt"].flatten())
    assert set(out) == set(fulls) and all(bitwise_equal(out[k], expected[k]) for k in fulls)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(NotACheckpointError, match="metadata.json"):
        dc.unshard(tmp_path)
