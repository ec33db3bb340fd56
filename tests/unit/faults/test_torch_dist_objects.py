"""``load_sharded_objects`` sees a torch_dist checkpoint's ShardedObjects, as ``load`` and
``load_sharded_metadata`` do: the torch_dist backend stores them inside DCP's files, not under
``objects/`` where the common backend keeps those of the other backends."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor

from .scenario import state, strategy


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("objects") / "ckpt"
    dc.save(state(2.0), path, sharded_strategy=strategy("torch_dist"))
    return path


def test_load_sharded_objects_reads_the_objects_stored_in_dcp(saved):
    assert "o/shard_0_1" in dc.load_sharded_metadata(saved)
    untouched = ShardedTensor.from_rank_offsets("w", torch.zeros(16, 16))
    request = {"x": [ShardedObject("o", None, (1,), (0,)), 5], "w": untouched}
    out = dc.load_sharded_objects(request, saved)
    assert out["x"] == [{"v": 2.0}, 5]
    assert out["w"] is untouched  # only ShardedObjects are replaced


def test_an_absent_object_is_a_key_mismatch(saved):
    with pytest.raises(dc.KeyMismatchError, match="'nope'"):
        dc.load_sharded_objects({"x": ShardedObject("nope", None, (1,), (0,))}, saved)
