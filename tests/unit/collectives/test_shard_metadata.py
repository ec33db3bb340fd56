"""Unit tests of dist_ckpt.model.shard_table and shard_metadata: the compact binary exchange of shard metadata."""

from __future__ import annotations

import json
from dataclasses import fields

import numpy as np
import pytest
import torch

from dist_ckpt.collectives.shard_metadata import (
    all_gather_metadata,
    decode_tables,
    dtype_from_token,
    dtype_token,
    gather_metadata,
)
from dist_ckpt.errors import CorruptCheckpointError
from dist_ckpt.model.columns import narrowest, pack_columns, unpack_columns
from dist_ckpt.model.shard_table import ShardTable, concat_tables, decode_table, encode_table
from dist_ckpt.model.sharded import LocalNonPersistentObject, ShardedObject, ShardedTensor

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
    ShardedTensor("empty-replica", None, torch.int64, (4,), (4,), (0,), None, ()),
]


def same_metadata(a, b):
    assert type(a) is type(b) and b.data is None
    for f in fields(a):
        if f.name != "data":
            assert getattr(b, f.name) == getattr(a, f.name), (a.key, f.name)


def test_round_trip_through_bytes():
    blob = encode_table(ShardTable.from_shards(SHARDS, rank=0))
    (decoded,) = decode_table(blob, 0, "rank 0").to_shards(1)
    assert len(decoded) == len(SHARDS)
    for a, b in zip(SHARDS, decoded):
        same_metadata(a, b)


def test_compact():
    """A rank of a tensor-parallel model: a few bytes per shard (no JSON object per shard)."""
    shards = [
        ShardedTensor(
            f"decoder.layers.{i // 8}.mlp.fc{i % 8}.weight",
            None,
            torch.bfloat16,
            (512, 1024),
            (4096, 1024),
            (1024, 0),
            (8, 1),
            (0, 2, 5),
        )
        for i in range(1000)
    ]
    blob = encode_table(ShardTable.from_shards(shards, rank=3))
    assert len(blob) < 10 * len(shards)


def test_many_ranks_concatenate_in_rank_order():
    per_rank = [SHARDS[r:] for r in range(3)]
    blobs = [encode_table(ShardTable.from_shards(s, r)) for r, s in enumerate(per_rank)]
    table = decode_tables(blobs)
    assert len(table) == sum(len(s) for s in per_rank) and sorted(table.keys) == sorted({s.key for s in SHARDS})
    back = table.to_shards(3)
    for expected, got in zip(per_rank, back):
        for a, b in zip(expected, got):
            same_metadata(a, b)
    assert table.rank.tolist() == [r for r, s in enumerate(per_rank) for _ in s]


def test_equal_key_tables_are_decoded_once():
    blobs = [encode_table(ShardTable.from_shards(SHARDS, r)) for r in range(4)]
    cache = {}
    tables = [decode_table(b, r, f"rank {r}", cache) for r, b in enumerate(blobs)]
    assert all(t.keys is tables[0].keys for t in tables)  # one list for every rank
    assert len(concat_tables(tables).keys) == len({s.key for s in SHARDS})


def test_dtype_tokens():
    for dtype in (torch.float32, torch.bfloat16, torch.complex32, torch.quint8, torch.bool):
        assert dtype_from_token(dtype_token(dtype)) == dtype
    with pytest.raises(CorruptCheckpointError, match="'nonsense'"):
        dtype_from_token("nonsense")
    with pytest.raises(CorruptCheckpointError):
        dtype_from_token("Tensor")  # an attribute of torch that is not a dtype


def test_damaged_bytes_are_reported():
    blob = encode_table(ShardTable.from_shards(SHARDS, 0))
    flipped = blob[:-1] + bytes([blob[-1] ^ 1])  # zlib's own checksum catches a flipped bit
    for bad in (b"", b"JSON", blob[:20], blob[:-3], blob[:9] + b"x" + blob[10:], flipped):
        with pytest.raises(CorruptCheckpointError, match="rank 7"):
            decode_table(bad, 7, "shard metadata from rank 7")
    other = pack_columns({"key": np.zeros(1, np.int64)}, {"keys": ["k"]}, {"format": "else"})
    with pytest.raises(CorruptCheckpointError, match="not shard metadata"):
        decode_table(other, 0, "x")
    with pytest.raises(TypeError, match="cannot describe"):
        ShardTable.from_shards([SHARDS[0], LocalNonPersistentObject(1)])  # type: ignore[list-item]


def test_columns_are_narrowed_and_strings_survive():
    assert narrowest(np.array([-1, 100])).dtype == np.int8
    assert narrowest(np.array([0, 70000])).dtype == np.int32
    assert narrowest(np.array([-(2**40)])).dtype == np.int64
    strings = ["a\nb", "é", ""]  # a newline forces the JSON encoding
    blob = pack_columns({"x": np.arange(6).reshape(2, 3)}, {"s": strings, "t": ["p", "q"]}, {"m": [1]})
    out = unpack_columns(blob, "test")
    assert out.strings == {"s": strings, "t": ["p", "q"]} and out.meta == {"m": [1]}
    assert out.columns["x"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert json.loads(blob[8 : 8 + int.from_bytes(blob[4:8], "little")])["version"] == 1


def test_gather_world_of_one():
    gathered = all_gather_metadata(SHARDS)
    assert len(gathered) == 1 and [s.key for s in gathered[0]] == [s.key for s in SHARDS]
    gathered = gather_metadata(SHARDS[:2])
    assert gathered is not None and gathered[0][1].prepend_axis_num == 1
