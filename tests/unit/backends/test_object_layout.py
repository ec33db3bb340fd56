"""A ShardedObject asked for in another layout than it was saved in (issue 39 item 5): an RNG
state saved per tensor-parallel rank and loaded at another TP size is a
ShardedObjectLayoutError (the checkpoint is fine; objects are not resharded), naming the stored
shards and what to do; a shard missing from the saved layout itself stays damage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.request_checks import object_layout_error
from dist_ckpt.errors import CorruptCheckpointError, LoadMismatchError, ShardedObjectLayoutError
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor
from tests.unit.faults.scenario import strategy


def _rng_saved_at_tp2(path: Path, backend: str) -> None:
    dc.save(
        {
            "w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0)),
            "rng0": ShardedObject("rng_state", {"seed": 0}, (1, 2), (0, 0)),
            "rng1": ShardedObject("rng_state", {"seed": 1}, (1, 2), (0, 1)),
        },
        path,
        sharded_strategy=strategy(backend),
    )


@pytest.mark.parametrize("backend", ["safetensors", "zarr", "torch_dist"])
def test_an_rng_state_loaded_at_another_tp_size(tmp_path, backend):
    ckpt = tmp_path / "ckpt"
    _rng_saved_at_tp2(ckpt, backend)
    request = {"rng": ShardedObject("rng_state", None, (1, 1), (0, 0))}  # TP=1 now
    with pytest.raises(ShardedObjectLayoutError) as caught:
        dc.load(request, ckpt)
    error = caught.value
    assert isinstance(error, LoadMismatchError) and isinstance(error, ValueError)
    assert not isinstance(error, CorruptCheckpointError)
    text = str(error)
    assert text.startswith("[rank 0] ShardedObject 'rng_state'") and str(ckpt) in text
    assert "grid of shape (1, 2)" in text and "['shard_0.0_1.2', 'shard_0.1_1.2']" in text
    assert "rng_state/shard_0.0_1.1" in text and "not resharded" in text and "Drop this key" in text
    same = dc.load({"rng": ShardedObject("rng_state", None, (1, 2), (0, 1))}, ckpt, validate_access_integrity=False)
    assert same["rng"] == {"seed": 1}  # the saved layout loads


def test_a_shard_missing_from_the_saved_layout_is_still_damage():
    requested = ShardedObject("obj", None, (2,), (1,))
    assert object_layout_error(requested, ["shard_0_2"], "'ckpt'") is None  # same grid: a shard is gone
    assert object_layout_error(requested, [], "'ckpt'") is None
    assert object_layout_error(requested, ["key.txt"], "'ckpt'") is None  # not a shard name
    other = object_layout_error(requested, ["obj/shard_0_4", "obj/shard_1_4"], "'ckpt'")
    assert isinstance(other, ShardedObjectLayoutError) and "grid of shape (4,)" in str(other)
