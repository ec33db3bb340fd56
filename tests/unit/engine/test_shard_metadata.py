"""Unit tests of dist_ckpt.engine.shard_metadata: the compact JSON encoding of exchanged shard metadata."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import torch

from dist_ckpt.engine.shard_metadata import (
    all_gather_metadata,
    decode_shard,
    dtype_from_token,
    dtype_token,
    encode_shard,
    gather_metadata,
)
from dist_ckpt.errors import CorruptCheckpointError
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor

SHARDS = [
    ShardedTensor.from_rank_offsets("w", torch.empty(2, 3), (0, 1, 2), replica_id=(0, 3)),
    ShardedTensor.from_rank_offsets(
        "p", torch.empty(2, 3, dtype=torch.bfloat16), (0, 2, 4), prepend_axis_num=1, allow_shape_mismatch=True
    ),
    ShardedTensor.from_rank_offsets_flat(
        "f", torch.empty(4), (3, 4), (0, 1, 2), flattened_range=slice(5, 9), replica_id=2
    ),
    ShardedTensor("nofrag", None, torch.float8_e4m3fn, (2,), (4,), (2,), None),
    ShardedTensor.from_rank_offsets("scalar", torch.empty(())),
    ShardedObject("o", None, (2, 3), (1, 2), replica_id=1),
    ShardedObject("o0", None, (), ()),
]


@pytest.mark.parametrize("shard", SHARDS, ids=lambda s: s.key)
def test_round_trip(shard):
    encoded = encode_shard(shard)
    text = json.dumps(encoded)
    decoded = decode_shard(json.loads(text))
    assert type(decoded) is type(shard)
    assert decoded.data is None
    for f in fields(shard):
        if f.name != "data":
            assert getattr(decoded, f.name) == getattr(shard, f.name), f.name
    assert len(text) < 200  # compact


def test_dtype_tokens():
    for dtype in (torch.float32, torch.bfloat16, torch.complex32, torch.quint8, torch.bool):
        assert dtype_from_token(dtype_token(dtype)) == dtype
    with pytest.raises(CorruptCheckpointError, match="'nonsense'"):
        dtype_from_token("nonsense")
    with pytest.raises(CorruptCheckpointError):
        dtype_from_token("Tensor")  # an attribute of torch that is not a dtype


def test_bad_records():
    with pytest.raises(CorruptCheckpointError):
        decode_shard(["X", "k"])
    with pytest.raises(TypeError):
        encode_shard(object())  # type: ignore[arg-type]


def test_gather_world_of_one():
    gathered = all_gather_metadata(SHARDS)
    assert len(gathered) == 1 and [s.key for s in gathered[0]] == [s.key for s in SHARDS]
    gathered = gather_metadata(SHARDS[:2])
    assert gathered is not None and gathered[0][1].prepend_axis_num == 1
