"""crc32c checksums: the primitives, and their verification when safetensors loads read blocks.

Loads check every block they touch and read at most one block beyond each end of a contiguous
range; a damaged byte is reported by exactly the loads that read its block.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict

import google_crc32c
import numpy as np
import pytest
import torch

from dist_ckpt.backends.safetensors import io as safetensors_io
from dist_ckpt.backends.safetensors import read_threads
from dist_ckpt.backends.safetensors.blocks import ShardCheck
from dist_ckpt.backends.safetensors.index import INDEX_FILENAME, SAFETENSORS_DIR, read_index
from dist_ckpt.backends.safetensors.strategy import (
    SafetensorsLoadOptions,
    SafetensorsLoadShardedStrategy,
    SafetensorsSaveOptions,
    SafetensorsSaveShardedStrategy,
)
from dist_ckpt.errors import ChecksumMismatchError, CorruptCheckpointError, IncompatibleStrategyError
from dist_ckpt.integrity.checksums import (
    BlockChecksums,
    FileDigest,
    block_spans,
    check_file,
    crc32c,
    crc_from_hex,
    crc_to_hex,
    decode_block_crcs,
    encode_block_crcs,
    file_digest,
    file_problem,
    parse_manifest,
    read_manifest,
    write_manifest,
)
from dist_ckpt.model.sharded import ShardedTensor
from tests.unit.backends.safetensors.legacy_index import write_legacy_index

BLOCK = 4096


def save(sd, path, **options):
    SafetensorsSaveShardedStrategy(SafetensorsSaveOptions(**options)).save(sd, Path(path))


def load(sd, path, **options):
    return SafetensorsLoadShardedStrategy(SafetensorsLoadOptions(**options)).load(sd, Path(path))


def random_tensor(dtype, shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


# --------------------------------------------------------------------------- primitives


def test_crc32c_is_castagnoli_and_chains():
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    assert crc32c(b"hello world") == crc32c(b" world", crc32c(b"hello"))
    assert crc32c(memoryview(bytearray(b"abc"))) == crc32c(b"abc") == crc32c(np.frombuffer(b"abc", dtype=np.uint8))
    assert crc32c(b"") == 0


@pytest.mark.parametrize("seed", range(5))
def test_block_checksums_do_not_depend_on_how_the_stream_is_cut(seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, int(rng.integers(0, 5000)), dtype=np.uint8).tobytes()
    block = int(rng.integers(1, 700))
    blocks = BlockChecksums(block)
    pos = 0
    while pos < len(data):
        step = int(rng.integers(1, 900))
        blocks.update(data[pos : pos + step])
        pos += step
    expected = [google_crc32c.value(data[s : s + block]) for s in range(0, len(data), block)]
    assert blocks.finish() == expected


def test_block_spans_and_hex_encodings():
    assert block_spans(100, 110, 4) == [(100, 104), (104, 108), (108, 110)]
    assert block_spans(5, 5, 4) == []
    assert crc_to_hex(0x9A71BB4C) == "9a71bb4c" and crc_from_hex("9a71bb4c", "x") == 0x9A71BB4C
    assert decode_block_crcs(encode_block_crcs([1, 0xFFFFFFFF]), 2, "x") == (1, 0xFFFFFFFF)
    assert decode_block_crcs("", 0, "x") == ()


@pytest.mark.parametrize("bad", [None, 7, "00000001", "0000000100000002ff", "zz000001" + "0" * 8, ["00000001"]])
def test_malformed_block_crcs_name_the_place(bad):
    with pytest.raises(CorruptCheckpointError, match="index.json .tensor 'w'"):
        decode_block_crcs(bad, 2, "index.json (tensor 'w')")


@pytest.mark.parametrize("bad", [None, 12345678, "1234567", "123456789", "xyzxyzxy"])
def test_malformed_crc_hex(bad):
    with pytest.raises(CorruptCheckpointError, match="where"):
        crc_from_hex(bad, "where")


def test_manifest_round_trip_and_file_checks(tmp_path):
    (tmp_path / "a").write_bytes(b"abc")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").write_bytes(b"")
    files = {"a": file_digest(tmp_path / "a"), "d/b": file_digest(tmp_path / "d" / "b")}
    assert files["a"] == FileDigest(3, crc32c(b"abc"))
    write_manifest(tmp_path / "m.json", files)
    assert read_manifest(tmp_path / "m.json") == files
    assert read_manifest(tmp_path / "absent.json") is None
    assert file_problem(tmp_path / "a", files["a"]) is None
    (tmp_path / "a").write_bytes(b"abd")
    problem, mismatch = file_problem(tmp_path / "a", files["a"])
    assert mismatch and "differs" in problem
    with pytest.raises(ChecksumMismatchError, match="common state.*'.*a' crc32c"):
        check_file(tmp_path / "a", files["a"], "the common state")
    (tmp_path / "a").write_bytes(b"ab")
    with pytest.raises(CorruptCheckpointError, match="has 2 bytes, 3 were recorded"):
        check_file(tmp_path / "a", files["a"], "x")
    (tmp_path / "a").unlink()
    assert file_problem(tmp_path / "a", files["a"]) == ("missing", False)


@pytest.mark.parametrize(
    "doc, match",
    [
        ([], "must hold a JSON object"),
        ({"format": "x"}, "'format'"),
        ({"format": "dist_ckpt.checksums", "version": 1, "algorithm": "md5", "files": {}}, "'algorithm'"),
        ({"format": "dist_ckpt.checksums", "version": 1, "algorithm": "crc32c", "files": []}, "'files'"),
        (
            {"format": "dist_ckpt.checksums", "version": 1, "algorithm": "crc32c", "files": {"../x": {}}},
            "plain relative",
        ),
        ({"format": "dist_ckpt.checksums", "version": 1, "algorithm": "crc32c", "files": {"a": 3}}, "entry 'a'"),
        (
            {"format": "dist_ckpt.checksums", "version": 1, "algorithm": "crc32c", "files": {"a": {"size": "3"}}},
            "'size'",
        ),
        (
            {
                "format": "dist_ckpt.checksums",
                "version": 1,
                "algorithm": "crc32c",
                "files": {"a": {"size": 3, "crc32c": 5}},
            },
            "entry 'a' field 'crc32c'",
        ),
    ],
)
def test_malformed_manifests_name_file_and_entry(tmp_path, doc, match):
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        parse_manifest(doc, tmp_path / "m.json")
    assert "m.json" in str(info.value)


def test_newer_manifest_version_says_upgrade(tmp_path):
    (tmp_path / "m.json").write_text(json.dumps({"format": "dist_ckpt.checksums", "version": 9}))
    with pytest.raises(IncompatibleStrategyError, match="upgrade"):
        read_manifest(tmp_path / "m.json")
    (tmp_path / "m.json").write_bytes(b"\xff\x00")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        read_manifest(tmp_path / "m.json")


def test_shard_check_widens_to_blocks_and_refuses_partial_blocks(tmp_path):
    data = bytes(range(256)) * 40  # 10240 bytes stored at byte 100
    crcs = tuple(crc32c(data[s : s + 1000]) for s in range(0, len(data), 1000))
    check = ShardCheck(tmp_path / "f", "w", "w@0", 100, 100 + len(data), 1000, crcs)
    assert check.widen(100, 101) == (100, 1100)
    assert check.widen(1500, 3200) == (1100, 4100)
    assert check.widen(10200, 10340) == (10100, 10340)  # the last block is short
    assert check.widen(10000, 10340) == (9100, 10340)
    whole = memoryview(bytearray(data))
    check.after_read(1100, [whole[1000:1500], whole[1500:4000]])  # split anywhere
    with pytest.raises(Exception, match="whole"):
        check.after_read(1200, [whole[1100:2000]])
    damaged = bytearray(data)
    damaged[2500] ^= 1
    with pytest.raises(ChecksumMismatchError, match=r"bytes 2100:3100 .*block 2 of shard 'w@0'"):
        check.after_read(100, [memoryview(damaged)])


# --------------------------------------------------------------------------- safetensors loads


@pytest.fixture
def read_counter(monkeypatch):
    counts: Dict[str, int] = {"bytes": 0}
    original = safetensors_io.read_into

    def counting(fd, buffers, offset):
        n = original(fd, buffers, offset)
        counts["bytes"] += n
        return n

    monkeypatch.setattr(safetensors_io, "read_into", counting)
    return counts


def _flip(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x10
    path.write_bytes(bytes(data))


def test_index_records_a_crc_per_block(tmp_path):
    full = random_tensor(torch.float32, (64, 100), seed=1)  # 25600 bytes: 7 blocks of 4096
    save({"w": ShardedTensor.from_rank_offsets("w", full.clone())}, tmp_path, checksum_block_bytes=BLOCK)
    index = read_index(tmp_path)
    assert index.block_bytes == BLOCK
    (shard,) = index.tensors["w"].shards
    begin, end = shard.byte_range
    raw = (tmp_path / SAFETENSORS_DIR / shard.file).read_bytes()
    assert shard.crcs == tuple(crc32c(raw[s:e]) for s, e in block_spans(begin, end, BLOCK))
    assert len(shard.crcs) == 7
    assert index.header_crcs[shard.file] == crc32c(raw[:begin])


def test_damage_is_reported_by_the_loads_that_read_it(tmp_path):
    full = random_tensor(torch.float32, (64, 100), seed=2)
    save({"w": ShardedTensor.from_rank_offsets("w", full.clone())}, tmp_path, checksum_block_bytes=BLOCK)
    (shard,) = read_index(tmp_path).tensors["w"].shards
    path = tmp_path / SAFETENSORS_DIR / shard.file
    _flip(path, shard.byte_range[0] + 5 * BLOCK + 7)  # in block 5: rows 51.. (400 bytes a row)
    with pytest.raises(ChecksumMismatchError) as info:
        load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 100))}, tmp_path)
    message = str(info.value)
    assert "'w'" in message and shard.file in message and "block 5" in message and "[rank 0]" in message
    # rows 0..31 lie in blocks 0..3: they load, and are right
    out = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(32, 100), (0, 0, 2))}, tmp_path)
    assert torch.equal(bits(out["w"]), bits(full[:32]))
    with pytest.raises(ChecksumMismatchError):
        load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(32, 100), (0, 1, 2))}, tmp_path)
    # a column slice reads every row, so every block
    with pytest.raises(ChecksumMismatchError):
        load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 50), (1, 0, 2))}, tmp_path)
    # verification off: the damaged value loads as it is
    out = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 100))}, tmp_path, verify_checksums=False)
    assert int((bits(out["w"]) != bits(full)).sum()) == 1


@pytest.mark.parametrize("piece", [1, BLOCK, 3 * BLOCK, 3 * BLOCK + 100, 2**40])
def test_checked_reads_in_pieces_report_damage_in_any_piece(tmp_path, read_counter, piece):
    """Checked reads from a file go in pieces of whole blocks, each checked as it is read: every
    block is still checked, each byte is read once, and a damaged block in any piece is named."""
    full = random_tensor(torch.float32, (64, 1000), seed=7)  # 256000 bytes: 63 blocks, the last short
    save({"w": ShardedTensor.from_rank_offsets("w", full.clone())}, tmp_path, checksum_block_bytes=BLOCK)
    (shard,) = read_index(tmp_path).tensors["w"].shards
    begin, end = shard.byte_range
    read_counter.update(bytes=0)
    for paths in ({}, {"small_run_bytes": 2**20}):  # direct reads, and bounce reads (columns)
        out = load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 1000))}, tmp_path, checked_piece_bytes=piece
        )
        assert torch.equal(bits(out["w"]), bits(full))
        out = load(
            {"c": ShardedTensor.from_rank_offsets("w", torch.empty(64, 500), (1, 1, 2))},
            tmp_path,
            checked_piece_bytes=piece,
            **paths,
        )
        assert torch.equal(bits(out["c"]), bits(full[:, 500:]))
    path = tmp_path / SAFETENSORS_DIR / shard.file
    for block in (0, 31, 62):  # the first, a middle and the last (short) block
        _flip(path, begin + block * BLOCK + 3)
        stop = min(begin + (block + 1) * BLOCK, end)
        with pytest.raises(ChecksumMismatchError, match=rf"'w'.*bytes {begin + block * BLOCK}:{stop} .*block {block} "):
            load(
                {"w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 1000))}, tmp_path, checked_piece_bytes=piece
            )
        with pytest.raises(ChecksumMismatchError, match=rf"block {block} "):
            load(
                {"w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 1000))},
                tmp_path,
                checked_piece_bytes=piece,
                small_run_bytes=2**20,
                max_read_bytes=5 * BLOCK,
            )
        _flip(path, begin + block * BLOCK + 3)


def test_pieces_cut_buffers_at_every_step():
    data = memoryview(bytearray(range(100)))
    buffers = [data[0:0], data[0:7], data[7:8], data[8:30], data[30:0], data[30:31]]
    pieces = list(read_threads._pieces(buffers, 1000, 10))
    assert [offset for offset, _ in pieces] == [1000, 1010, 1020, 1030]
    assert [b"".join(bytes(v) for v in views) for _, views in pieces] == [
        bytes(range(a, min(a + 10, 31))) for a in (0, 10, 20, 30)
    ]
    assert all(len(v) for _, views in pieces for v in views)
    assert list(read_threads._pieces([data[0:0]], 0, 10)) == []


def test_row_slices_read_at_most_one_extra_block_per_end(tmp_path, read_counter):
    full = random_tensor(torch.float32, (640, 100), seed=3)  # 256000 bytes, 63 blocks
    save({"w": ShardedTensor.from_rank_offsets("w", full.clone())}, tmp_path, checksum_block_bytes=BLOCK)
    header = read_index(tmp_path).tensors["w"].shards[0].byte_range[0]
    for parts in (4, 5):
        for r in range(parts):
            rows = 640 // parts

            def request():
                return {"w": ShardedTensor.from_rank_offsets("w", torch.empty(rows, 100), (0, r, parts))}

            read_counter.update(bytes=0)
            out = load(request(), tmp_path)
            assert torch.equal(bits(out["w"]), bits(full[r * rows : (r + 1) * rows]))
            assert 0 <= read_counter["bytes"] - header - rows * 400 <= 2 * (BLOCK - 1)
            # a range read in several pieces (max_read_bytes): each piece widens at its ends
            read_counter.update(bytes=0)
            load(request(), tmp_path, max_read_bytes=10_000)
            pieces = -(-rows * 400 // 10_000)
            assert 0 <= read_counter["bytes"] - header - rows * 400 <= pieces * 2 * (BLOCK - 1)


def test_column_slices_read_each_byte_once(tmp_path, read_counter):
    full = random_tensor(torch.float32, (64, 256), seed=4)  # rows of 1 KiB: gaps inside blocks
    save({"w": ShardedTensor.from_rank_offsets("w", full.clone())}, tmp_path, checksum_block_bytes=BLOCK)
    header = read_index(tmp_path).tensors["w"].shards[0].byte_range[0]
    read_counter.update(bytes=0)
    out = load(
        {"c": ShardedTensor.from_rank_offsets("w", torch.empty(64, 128), (1, 1, 2))}, tmp_path, small_run_bytes=256
    )
    assert torch.equal(bits(out["c"]), bits(full[:, 128:]))
    assert read_counter["bytes"] - header == 64 * 256 * 4  # the span once, no block twice


def test_wide_gaps_read_only_the_blocks_touched(tmp_path, read_counter):
    full = random_tensor(torch.float32, (8, 8192), seed=5)  # rows of 32 KiB = 8 blocks
    save({"w": ShardedTensor.from_rank_offsets("w", full.clone())}, tmp_path, checksum_block_bytes=BLOCK)
    header = read_index(tmp_path).tensors["w"].shards[0].byte_range[0]
    read_counter.update(bytes=0)
    out = load({"c": ShardedTensor.from_rank_offsets("w", torch.empty(8, 1024), (1, 3, 8))}, tmp_path)
    assert torch.equal(bits(out["c"]), bits(full[:, 3072:4096]))
    assert read_counter["bytes"] - header == 8 * BLOCK  # one block of each row


@pytest.mark.parametrize("seed", range(6))
def test_random_requests_verify_and_load_exactly(tmp_path, seed):
    """Random shardings, dtypes, block sizes and read paths: every load equals the saved data."""
    rng = np.random.default_rng(seed)
    dtype = [torch.float32, torch.bfloat16, torch.int64, torch.complex128, torch.bool, torch.float8_e4m3fn][seed]
    shape = (int(rng.integers(1, 40)), int(rng.integers(1, 60)))
    full = random_tensor(dtype, shape, seed) if dtype != torch.bool else torch.rand(shape) > 0.5
    parts = int(rng.integers(1, min(4, shape[0]) + 1))
    rows = -(-shape[0] // parts)
    padded = torch.zeros((rows * parts, shape[1]), dtype=dtype)
    padded[: shape[0]] = full
    save(
        {
            f"p{r}": ShardedTensor.from_rank_offsets("w", padded[r * rows : (r + 1) * rows].clone(), (0, r, parts))
            for r in range(parts)
        },
        tmp_path,
        checksum_block_bytes=int(rng.integers(1, 300)),
    )
    for _ in range(4):
        cparts = int(rng.integers(1, 5))
        cols = -(-shape[1] // cparts)
        c = int(rng.integers(0, cparts))
        req = ShardedTensor.from_rank_offsets(
            "w", torch.empty(rows * parts, cols, dtype=dtype), (1, c, cparts), allow_shape_mismatch=True
        )
        opts = dict(
            small_run_bytes=int(rng.integers(0, 64)),
            bounce_buffer_bytes=int(rng.integers(16, 512)),
            max_read_bytes=int(rng.integers(8, 4096)),
            thread_count=int(rng.integers(1, 4)),
            checked_piece_bytes=int(rng.integers(1, 2048)),
        )
        out = load({"x": req}, tmp_path, **opts)["x"]
        expected = torch.zeros(rows * parts, cols, dtype=dtype)
        piece = padded[:, c * cols : (c + 1) * cols]
        expected[:, : piece.shape[1]] = piece
        assert torch.equal(bits(out), bits(expected))


def test_indexes_without_checksums_load_without_verification(tmp_path):
    full = random_tensor(torch.float32, (8, 6), seed=6)
    save({"w": ShardedTensor.from_rank_offsets("w", full.clone())}, tmp_path, checksum_block_bytes=None)
    doc = json.loads((tmp_path / SAFETENSORS_DIR / INDEX_FILENAME).read_text())
    assert doc["version"] == 3 and "checksum" not in doc and doc["shard_table"]["blocks"] == 0
    assert all("header_crc32c" not in f for f in doc["files"])
    assert read_index(tmp_path).block_bytes is None
    out = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 6))}, tmp_path)
    assert torch.equal(out["w"], full)
    legacy = write_legacy_index(tmp_path)  # the same checkpoint as dist_ckpt wrote it before index version 3
    assert legacy["version"] == 1 and all("crc32c" not in s for s in legacy["tensors"]["w"]["shards"])
    assert read_index(tmp_path).block_bytes is None
    out = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 6))}, tmp_path)
    assert torch.equal(out["w"], full)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.pop("checksum"), "'checksum' must be a JSON object"),
        (lambda d: d["checksum"].update(block_bytes=0), "'block_bytes'"),
        (lambda d: d["checksum"].update(algorithm="md5"), "'algorithm'"),
        (lambda d: d["tensors"]["w"]["shards"][0].pop("crc32c"), "tensor 'w', shard 'w@0.0'.*'crc32c'"),
        (lambda d: d["tensors"]["w"]["shards"][0].update(crc32c="00"), "tensor 'w', shard 'w@0.0'.*'crc32c'"),
        (lambda d: next(iter(d["files"].values())).update(header_crc32c=None), "header_crc32c"),
        (lambda d: d.update(version=4), "upgrade"),
    ],
)
def test_malformed_checksums_in_a_version_2_index(tmp_path, mutate, match):
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(8, 6))}, tmp_path)
    path = tmp_path / SAFETENSORS_DIR / INDEX_FILENAME
    doc = write_legacy_index(tmp_path)
    assert doc["version"] == 2
    mutate(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises((CorruptCheckpointError, IncompatibleStrategyError), match=match) as info:
        load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 6))}, tmp_path)
    assert "index.json" in str(info.value)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.update(checksum=[]), "'checksum' must be a JSON object"),
        (lambda d: d["checksum"].update(block_bytes=0), "'block_bytes'"),
        (lambda d: d["files"][0].pop("header_crc32c"), "header_crc32c"),
        (lambda d: d["tensors"]["w"].update(table_crc32c="0"), "table_crc32c"),
        (lambda d: d["tensors"]["w"].update(table_crc32c="00000000"), "recorded 00000000 .the table is damaged"),
        (lambda d: d["tensors"]["w"].update(blocks=[0, 1]), "(crc32c|block crcs)"),
        (lambda d: d["checksum"].update(block_bytes=d["checksum"]["block_bytes"] * 2), "block crcs"),
        (lambda d: d.update(version=4), "upgrade"),
    ],
)
def test_malformed_checksums_in_a_version_3_index(tmp_path, mutate, match):
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(8, 6))}, tmp_path, checksum_block_bytes=64)
    path = tmp_path / SAFETENSORS_DIR / INDEX_FILENAME
    doc = json.loads(path.read_text())
    assert doc["version"] == 3
    mutate(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises((CorruptCheckpointError, IncompatibleStrategyError), match=match) as info:
        load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 6))}, tmp_path)
    assert "index.json" in str(info.value)
