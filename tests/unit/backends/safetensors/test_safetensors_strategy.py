"""Unit tests of the safetensors backend (dist_ckpt.backends.safetensors.strategy), in one process.

One process may hold several ShardedTensors of the same key under different state-dict keys
("virtual ranks"): that is a valid sharding, so resharding is tested without process groups.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from safetensors import safe_open

import dist_ckpt as dc
from dist_ckpt.backends.registry import StrategyAction, get_default_strategy
from dist_ckpt.backends.safetensors import io as safetensors_io
from dist_ckpt.backends.safetensors.index import INDEX_FILENAME, INDEX_VERSION, SAFETENSORS_DIR, read_index
from dist_ckpt.backends.safetensors.strategy import (
    SafetensorsLoadOptions,
    SafetensorsLoadShardedStrategy,
    SafetensorsSaveOptions,
    SafetensorsSaveShardedStrategy,
    assign_writers,
    stored_bytes,
)
from dist_ckpt.errors import (
    CheckpointingException,
    ChecksumMismatchError,
    CorruptCheckpointError,
    IncompatibleStrategyError,
    KeyMismatchError,
    LoadMismatchError,
)
from dist_ckpt.model.dtypes import SUPPORTED_DTYPE_NAMES
from dist_ckpt.model.sharded import ShardedTensor

from .legacy_index import write_legacy_index


def save(sd, path, **options):
    SafetensorsSaveShardedStrategy(SafetensorsSaveOptions(**options)).save(sd, Path(path))


def load(sd, path, **options):
    return SafetensorsLoadShardedStrategy(SafetensorsLoadOptions(**options)).load(sd, Path(path))


def random_tensor(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` with random bit patterns (NaN payloads included)."""
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool().reshape(shape)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


def split_state(key, full, axis, parts, **kw) -> Dict[str, ShardedTensor]:
    """``parts`` virtual ranks, each holding one chunk of ``full`` along ``axis``."""
    chunks = full.chunk(parts, axis)
    return {
        f"{key}/rank{r}": ShardedTensor.from_rank_offsets(key, chunks[r].clone(), (axis, r, parts), **kw)
        for r in range(parts)
    }


def flat_pieces(key, local, boundaries, *rank_offsets, **kw) -> List[ShardedTensor]:
    flat = local.flatten()
    return [
        ShardedTensor.from_rank_offsets_flat(
            key, flat[a:b].clone(), local.shape, *rank_offsets, flattened_range=slice(a, b), **kw
        )
        for a, b in zip(boundaries[:-1], boundaries[1:])
    ]


def data_files(path: Path) -> List[Path]:
    return sorted((path / SAFETENSORS_DIR).glob("*.safetensors"))


def index_doc(path: Path) -> dict:
    return json.loads((path / SAFETENSORS_DIR / INDEX_FILENAME).read_text())


# --------------------------------------------------------------------------- dtypes and format


@pytest.mark.parametrize("name", SUPPORTED_DTYPE_NAMES)
def test_every_dtype_round_trips_bit_exactly(tmp_path, name):
    dtype = getattr(torch, name)
    full = random_tensor(dtype, (4, 6), seed=len(name))
    save(split_state("t", full, 0, 2), tmp_path)
    whole = ShardedTensor.from_rank_offsets("t", torch.empty(4, 6, dtype=dtype))
    assert_bits_equal(load({"w": whole}, tmp_path)["w"], full)
    parts = load(
        {f"p{r}": ShardedTensor.from_rank_offsets("t", torch.empty(4, 2, dtype=dtype), (1, r, 3)) for r in range(3)},
        tmp_path,
    )
    assert_bits_equal(torch.cat([parts[f"p{r}"] for r in range(3)], dim=1), full)
    assert index_doc(tmp_path)["tensors"]["t"]["dtype"] == name


@pytest.mark.parametrize("name", SUPPORTED_DTYPE_NAMES)
def test_every_dtype_round_trips_flattened(tmp_path, name):
    dtype = getattr(torch, name)
    full = random_tensor(dtype, (3, 5), seed=3)
    save({f"f{i}": sh for i, sh in enumerate(flat_pieces("t", full, [0, 4, 15]))}, tmp_path)
    out = load({"w": ShardedTensor.from_rank_offsets("t", torch.empty(3, 5, dtype=dtype))}, tmp_path)["w"]
    assert_bits_equal(out, full)


@pytest.mark.parametrize("name", [n for n in SUPPORTED_DTYPE_NAMES if n != "complex128"])
def test_files_are_plain_safetensors(tmp_path, name):
    """Every data file opens with safetensors.safe_open and holds the saved shards' bytes."""
    dtype = getattr(torch, name)
    full = random_tensor(dtype, (4, 6), seed=1)
    sd = split_state("layer.w", full, 1, 3)
    save(sd, tmp_path)
    found = {}
    for path in data_files(tmp_path):
        with safe_open(str(path), framework="pt") as f:
            assert f.metadata()["format"] == "pt"
            for name_in_file in f.keys():
                found[name_in_file] = f.get_tensor(name_in_file)
    assert sorted(found) == ["layer.w@0.0", "layer.w@0.2", "layer.w@0.4"]
    for r in range(3):
        assert_bits_equal(found[f"layer.w@0.{2 * r}"], sd[f"layer.w/rank{r}"].data)


def test_complex128_is_stored_as_float64_pairs(tmp_path):
    """safetensors has no complex128: the file holds its exact bytes as F64 (..., 2)."""
    full = torch.randn(3, 2, dtype=torch.complex128)
    save({"c": ShardedTensor.from_rank_offsets("c", full)}, tmp_path)
    (path,) = data_files(tmp_path)
    with safe_open(str(path), framework="pt") as f:
        stored = f.get_tensor("c@0.0")
    assert stored.dtype == torch.float64 and stored.shape == (3, 2, 2)
    assert torch.equal(torch.view_as_complex(stored), full)


def test_index_format(tmp_path):
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    save(split_state("w", full, 0, 2), tmp_path)
    doc = index_doc(tmp_path)
    assert doc["format"] == "dist_ckpt.safetensors" and doc["version"] == INDEX_VERSION == 3
    entry = doc["tensors"]["w"]
    assert entry["dtype"] == "float32" and entry["global_shape"] == [4, 6]
    assert entry["rows"] == [0, 2] and entry["blocks"] == [0, 2] and len(entry["table_crc32c"]) == 8
    table = doc["shard_table"]
    assert table["rows"] == 2 and table["ndim"] == 2 and table["blocks"] == 2
    assert table["size"] == os.path.getsize(tmp_path / SAFETENSORS_DIR / table["file"]) == 2 * 9 * 8 + 2 * 4
    assert [f["name"] for f in doc["files"]] == ["rank00000_0.safetensors", "rank00000_1.safetensors"]
    shards = sorted(read_index(tmp_path).tensors["w"].shards, key=lambda s: s.global_offset)
    assert [s.global_offset for s in shards] == [(0, 0), (2, 0)]
    for shard in shards:
        assert (
            shard.chunk_shape == (2, 6) and shard.flat_range is None and shard.name == f"w@{shard.global_offset[0]}.0"
        )
        begin, end = shard.byte_range
        assert end - begin == 2 * 6 * 4
        file_entry = next(f for f in doc["files"] if f["name"] == shard.file)
        assert file_entry["size"] == os.path.getsize(tmp_path / SAFETENSORS_DIR / shard.file)
    # nothing but JSON, safetensors files and the table of little-endian ints: no pickle
    assert {p.suffix for p in (tmp_path / SAFETENSORS_DIR).iterdir()} == {".json", ".safetensors", ".bin"}


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_files_per_rank_is_the_thread_count(tmp_path, threads):
    sd = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.randn(5 + i, 3)) for i in range(7)}
    save(sd, tmp_path, thread_count=threads)
    assert [p.name for p in data_files(tmp_path)] == [f"rank00000_{i}.safetensors" for i in range(threads)]
    out = load({k: ShardedTensor.from_rank_offsets(f"t{i}", torch.empty(5 + i, 3)) for i, k in enumerate(sd)}, tmp_path)
    assert all(torch.equal(out[k], sd[k].data) for k in sd)


def test_fewer_files_than_threads_when_few_shards(tmp_path):
    save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(3))}, tmp_path, thread_count=4)
    assert len(data_files(tmp_path)) == 1


def test_early_writeback_does_not_change_the_files(tmp_path):
    sd = split_state("w", random_tensor(torch.float32, (64, 33), seed=2), 0, 4)
    save(sd, tmp_path / "on", early_writeback=True)
    save(sd, tmp_path / "off", early_writeback=False)
    for a, b in zip(data_files(tmp_path / "on"), data_files(tmp_path / "off")):
        assert a.read_bytes() == b.read_bytes()


def test_assign_writers_balances_bytes_and_keeps_order():
    shards = [ShardedTensor.from_rank_offsets(f"t{i}", torch.empty(n)) for i, n in enumerate([10, 1, 7, 2, 6, 4])]
    groups = assign_writers(shards, 2)
    sizes = [sum(sh.data.numel() for sh in g) for g in groups]
    assert sorted(sizes) == [15, 15]
    for g in groups:  # original order within each file
        assert [shards.index(sh) for sh in g] == sorted(shards.index(sh) for sh in g)
    assert assign_writers(shards, 2) == groups  # deterministic
    assert len(assign_writers(shards[:1], 4)) == 1


def test_options_are_validated():
    with pytest.raises(CheckpointingException, match="thread_count"):
        SafetensorsSaveOptions(thread_count=0)
    with pytest.raises(CheckpointingException, match="bounce_buffer_bytes"):
        SafetensorsLoadOptions(bounce_buffer_bytes=0)
    with pytest.raises(CheckpointingException, match="small_run_bytes"):
        SafetensorsLoadOptions(small_run_bytes=-1)
    with pytest.raises(CheckpointingException, match="checked_piece_bytes"):
        SafetensorsLoadOptions(checked_piece_bytes=0)


def test_registered_and_used_by_dist_ckpt_save(tmp_path):
    assert isinstance(
        get_default_strategy(StrategyAction.SAVE_SHARDED, "safetensors", 1), SafetensorsSaveShardedStrategy
    )
    assert isinstance(
        get_default_strategy(StrategyAction.LOAD_SHARDED, "safetensors", 1), SafetensorsLoadShardedStrategy
    )
    full = torch.randn(4, 4)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", full), "step": 3}, tmp_path, sharded_strategy=("safetensors", 1))
    config = json.loads((tmp_path / "metadata.json").read_text())
    assert (config["sharded_backend"], config["sharded_backend_version"]) == ("safetensors", 1)
    out = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 4))}, tmp_path)
    assert torch.equal(out["w"], full) and out["step"] == 3
    assert stored_bytes(tmp_path) == full.numel() * 4


# --------------------------------------------------------------------------- resharding


@pytest.mark.parametrize("axis", [0, 1])
def test_reshard_4_2_1(tmp_path, axis):
    full = torch.randn(8, 12, dtype=torch.float64)
    save(split_state("w", full, axis, 4), tmp_path)
    for parts in (2, 1, 4):
        out = load(
            {
                f"r{r}": ShardedTensor.from_rank_offsets(
                    "w",
                    torch.empty(
                        *(s // parts if a == axis else s for a, s in enumerate(full.shape)), dtype=torch.float64
                    ),
                    (axis, r, parts),
                )
                for r in range(parts)
            },
            tmp_path,
        )
        assert torch.equal(torch.cat([out[f"r{r}"] for r in range(parts)], dim=axis), full)


def test_reshard_grid_to_other_axis(tmp_path):
    full = torch.randn(4, 6)
    sd = {}
    for i in range(2):
        for j in range(3):
            sd[f"{i}{j}"] = ShardedTensor.from_rank_offsets(
                "g", full[2 * i : 2 * i + 2, 2 * j : 2 * j + 2].clone(), (0, i, 2), (1, j, 3)
            )
    save(sd, tmp_path)
    out = load(
        {f"c{j}": ShardedTensor.from_rank_offsets("g", torch.empty(4, 3), (1, j, 2)) for j in range(2)}, tmp_path
    )
    assert torch.equal(torch.cat([out["c0"], out["c1"]], 1), full)


def test_replicas_are_not_saved(tmp_path):
    full = torch.randn(4, 4)
    sd = {
        "main": ShardedTensor.from_rank_offsets("w", full),
        "replica": ShardedTensor.from_rank_offsets("w", torch.full((4, 4), -1.0), replica_id=1),
    }
    save(sd, tmp_path)
    assert stored_bytes(tmp_path) == 64
    assert torch.equal(load({"x": ShardedTensor.from_rank_offsets("w", torch.empty(4, 4))}, tmp_path)["x"], full)


def test_prepend_axis_num(tmp_path):
    layers = torch.randn(4, 6, 2)
    sd = {
        f"l{i}": ShardedTensor.from_rank_offsets("layers", layers[i].clone(), (0, i, 4), prepend_axis_num=1)
        for i in range(4)
    }
    save(sd, tmp_path)
    # each file entry holds the whole box, prepended axis included
    (path,) = data_files(tmp_path)[:1]
    with safe_open(str(path), framework="pt") as f:
        assert all(tuple(f.get_slice(k).get_shape()) == (1, 6, 2) for k in f.keys())
    out = load({"all": ShardedTensor.from_rank_offsets("layers", torch.empty(4, 6, 2))}, tmp_path)["all"]
    assert torch.equal(out, layers)
    two = load(
        {
            f"s{s}": ShardedTensor.from_rank_offsets("layers", torch.empty(2, 3, 2), (0, s, 2), (1, 1, 2))
            for s in range(2)
        },
        tmp_path,
    )
    assert torch.equal(two["s1"], layers[2:, 3:])


def test_flattened_uneven_pieces_reloaded_with_other_cuts(tmp_path):
    full = torch.randn(5, 7)
    save({f"p{i}": sh for i, sh in enumerate(flat_pieces("o", full, [0, 3, 20, 35]))}, tmp_path)
    out = load({f"q{i}": sh for i, sh in enumerate(flat_pieces("o", torch.zeros(5, 7), [0, 11, 12, 35]))}, tmp_path)
    assert torch.equal(torch.cat([out["q0"], out["q1"], out["q2"]]), full.flatten())
    whole = load({"w": ShardedTensor.from_rank_offsets("o", torch.empty(5, 7))}, tmp_path)["w"]
    assert torch.equal(whole, full)


def test_flattened_with_prepend_and_tp(tmp_path):
    full = torch.randn(2, 4, 6)
    sd = {}
    for layer in range(2):
        for t in range(2):
            local = full[layer, :, 3 * t : 3 * t + 3]
            for i, sh in enumerate(flat_pieces("m", local, [0, 5, 12], (0, layer, 2), (2, t, 2), prepend_axis_num=1)):
                sd[f"{layer}{t}{i}"] = sh
    save(sd, tmp_path)
    out = load({"all": ShardedTensor.from_rank_offsets("m", torch.empty(2, 4, 6))}, tmp_path)["all"]
    assert torch.equal(out, full)


def test_zero_d_and_empty_tensors(tmp_path):
    save(
        {
            "s": ShardedTensor.from_rank_offsets("scalar", torch.tensor(3.5)),
            "e": ShardedTensor.from_rank_offsets("empty", torch.zeros(0, 3)),
            "z": ShardedTensor.from_rank_offsets_flat("zf", torch.zeros(0), (2, 2), flattened_range=slice(0, 0)),
            "z2": ShardedTensor.from_rank_offsets_flat(
                "zf", torch.ones(4), (2, 2), flattened_range=slice(0, 4), replica_id=0
            ),
        },
        tmp_path,
    )
    out = load(
        {
            "s": ShardedTensor.from_rank_offsets("scalar", torch.tensor(0.0)),
            "e": ShardedTensor.from_rank_offsets("empty", torch.zeros(0, 3)),
            "z": ShardedTensor.from_rank_offsets("zf", torch.zeros(2, 2)),
        },
        tmp_path,
    )
    assert out["s"].item() == 3.5 and out["e"].shape == (0, 3) and torch.equal(out["z"], torch.ones(2, 2))
    assert "empty" in index_doc(tmp_path)["tensors"]


class TestShapeMismatch:
    @pytest.fixture
    def stored(self, tmp_path):
        full = torch.arange(1, 25, dtype=torch.float32).reshape(4, 6)
        save(split_state("emb", full, 0, 2), tmp_path)
        return full

    def test_pad(self, tmp_path, stored):
        sh = ShardedTensor.from_rank_offsets("emb", torch.full((6, 8), 7.0), allow_shape_mismatch=True)
        out = load({"x": sh}, tmp_path)["x"]
        expected = torch.zeros(6, 8)
        expected[:4, :6] = stored
        assert torch.equal(out, expected)

    def test_crop(self, tmp_path, stored):
        sh = ShardedTensor.from_rank_offsets("emb", torch.empty(2, 3), allow_shape_mismatch=True)
        assert torch.equal(load({"x": sh}, tmp_path)["x"], stored[:2, :3])

    def test_flattened_pad(self, tmp_path, stored):
        sh = ShardedTensor.from_rank_offsets_flat(
            "emb", torch.full((20,), 7.0), (5, 6), flattened_range=slice(10, 30), allow_shape_mismatch=True
        )
        expected = torch.zeros(5, 6)
        expected[:4] = stored
        assert torch.equal(load({"x": sh}, tmp_path)["x"], expected.flatten()[10:30])

    def test_without_flag(self, tmp_path, stored):
        with pytest.raises(LoadMismatchError, match="'emb'") as info:
            load({"x": ShardedTensor.from_rank_offsets("emb", torch.empty(6, 8))}, tmp_path)
        assert "(4, 6)" in str(info.value) and "allow_shape_mismatch" in str(info.value)

    def test_dtype_mismatch_casts_unless_refused(self, tmp_path, stored):
        out = load({"x": ShardedTensor.from_rank_offsets("emb", torch.empty(4, 6, dtype=torch.bfloat16))}, tmp_path)
        assert torch.equal(out["x"], stored.to(torch.bfloat16))
        with pytest.raises(LoadMismatchError, match="'emb'") as info:
            load(
                {"x": ShardedTensor.from_rank_offsets("emb", torch.empty(4, 6, dtype=torch.bfloat16))},
                tmp_path,
                allow_dtype_cast=False,
            )
        assert "bfloat16" in str(info.value) and "float32" in str(info.value)


# --------------------------------------------------------------------------- in place, bounce buffers


class TestInPlace:
    def test_out_is_t(self, tmp_path):
        full = torch.randn(4, 6)
        save(split_state("w", full, 0, 2), tmp_path)
        t = torch.empty(4, 6)
        out = load({"x": ShardedTensor.from_rank_offsets("w", t)}, tmp_path)["x"]
        assert out is t and torch.equal(t, full)

    def test_flattened_in_place(self, tmp_path):
        full = torch.randn(4, 6)
        save(split_state("w", full, 1, 2), tmp_path)
        t = torch.empty(10)
        out = load({"x": ShardedTensor.from_rank_offsets_flat("w", t, (4, 6), flattened_range=slice(7, 17))}, tmp_path)[
            "x"
        ]
        assert out is t and torch.equal(t, full.flatten()[7:17])

    @pytest.mark.parametrize("bounce", [16, 1 << 20])
    def test_non_contiguous_destination(self, tmp_path, bounce):
        full = torch.randn(8, 3)
        save(split_state("w", full, 1, 3), tmp_path)
        base = torch.zeros(8, 6)
        t = base[:, ::2]
        out = load({"x": ShardedTensor.from_rank_offsets("w", t)}, tmp_path, bounce_buffer_bytes=bounce)["x"]
        assert out is t and torch.equal(base[:, ::2], full) and torch.equal(base[:, 1::2], torch.zeros(8, 3))

    def test_missing_data_gets_new_tensor(self, tmp_path):
        full = torch.randn(4, 6)
        save(split_state("w", full, 0, 2), tmp_path)
        meta = ShardedTensor.from_rank_offsets("w", torch.empty(4, 6, device="meta"))
        none = ShardedTensor.from_rank_offsets("w", torch.empty(4, 6)).without_data()
        out = load({"m": meta, "n": none}, tmp_path)
        assert out["m"].device.type == "cpu" and torch.equal(out["m"], full) and torch.equal(out["n"], full)

    @pytest.mark.parametrize("small,bounce", [(0, 1 << 20), (1 << 20, 1 << 20), (1 << 20, 64), (1 << 20, 8)])
    def test_read_paths_agree(self, tmp_path, small, bounce):
        """Direct reads and bounce reads (with slabs down to single rows) give the same bytes."""
        full = random_tensor(torch.float32, (6, 10, 8), seed=5)
        save(split_state("w", full, 2, 2), tmp_path)
        req = {f"r{r}": ShardedTensor.from_rank_offsets("w", torch.empty(3, 10, 8), (0, r, 2)) for r in range(2)}
        out = load(req, tmp_path, small_run_bytes=small, bounce_buffer_bytes=bounce, thread_count=2)
        assert_bits_equal(torch.cat([out["r0"], out["r1"]]), full)


# --------------------------------------------------------------------------- partial reads


@pytest.fixture
def read_counter(monkeypatch):
    """Count every byte read through the module's reader function, per file descriptor."""
    counts: Dict[str, int] = {"bytes": 0, "calls": 0}
    original = safetensors_io.read_into

    def counting(fd, buffers, offset):
        n = original(fd, buffers, offset)
        counts["bytes"] += n
        counts["calls"] += 1
        return n

    monkeypatch.setattr(safetensors_io, "read_into", counting)
    return counts


def _header_bytes(path: Path) -> int:
    total = 0
    for p in data_files(path):
        with open(p, "rb") as f:
            total += 8 + int.from_bytes(f.read(8), "little")
    return total


def test_load_reads_only_overlapping_bytes(tmp_path, read_counter):
    full = random_tensor(torch.float32, (64, 256), seed=9)
    save(split_state("w", full, 0, 4), tmp_path, thread_count=1)
    read_counter.update(bytes=0, calls=0)
    # (without checksum verification, which reads whole blocks: see test_checksums.py)
    out = load(
        {"q": ShardedTensor.from_rank_offsets("w", torch.empty(16, 256), (0, 2, 4))}, tmp_path, verify_checksums=False
    )
    assert_bits_equal(out["q"], full[32:48])
    assert read_counter["bytes"] == 16 * 256 * 4 + _header_bytes(tmp_path)
    # a column slice of row shards: only the columns are read (runs of 512 bytes >= small_run_bytes)
    read_counter.update(bytes=0, calls=0)
    out = load(
        {"c": ShardedTensor.from_rank_offsets("w", torch.empty(64, 128), (1, 1, 2))},
        tmp_path,
        small_run_bytes=512,
        verify_checksums=False,
    )
    assert_bits_equal(out["c"], full[:, 128:])
    assert read_counter["bytes"] == 64 * 128 * 4 + _header_bytes(tmp_path)


def test_short_runs_are_read_through_but_wide_gaps_are_not(tmp_path, read_counter):
    full = random_tensor(torch.float32, (64, 256), seed=9)
    save({"w": ShardedTensor.from_rank_offsets("w", full.clone())}, tmp_path)
    header = _header_bytes(tmp_path)
    # columns 0..7 of each row: 32-byte runs, 992-byte gaps -> one read through the span
    read_counter.update(bytes=0, calls=0)
    out = load(
        {"c": ShardedTensor.from_rank_offsets("w", torch.empty(64, 8), (1, 0, 32))}, tmp_path, verify_checksums=False
    )
    assert_bits_equal(out["c"], full[:, :8])
    assert read_counter["bytes"] - header == (63 * 256 + 8) * 4
    # with gaps wider than small_run_bytes, only the runs are read, one call each
    read_counter.update(bytes=0, calls=0)
    load(
        {"c": ShardedTensor.from_rank_offsets("w", torch.empty(64, 8), (1, 0, 32))},
        tmp_path,
        small_run_bytes=256,
        verify_checksums=False,
    )
    assert read_counter["bytes"] - header == 64 * 8 * 4


# --------------------------------------------------------------------------- damaged checkpoints


@pytest.fixture
def saved(tmp_path) -> Tuple[Path, torch.Tensor]:
    full = random_tensor(torch.float32, (8, 6), seed=4)
    save(split_state("layer.w", full, 0, 2), tmp_path, thread_count=1)
    return tmp_path, full


def _request(shape=(8, 6), dtype=torch.float32):
    return {"x": ShardedTensor.from_rank_offsets("layer.w", torch.empty(*shape, dtype=dtype))}


def test_truncated_file(saved):
    path, _ = saved
    (data,) = data_files(path)
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(CorruptCheckpointError) as info:
        load(_request(), path)
    assert str(data) in str(info.value) and "truncated" in str(info.value)


def test_file_cut_inside_the_header(saved):
    path, _ = saved
    (data,) = data_files(path)
    data.write_bytes(data.read_bytes()[:20])
    with pytest.raises(CorruptCheckpointError, match="header") as info:
        load(_request(), path)
    assert str(data) in str(info.value)


def test_garbage_header(saved):
    path, _ = saved
    (data,) = data_files(path)
    raw = bytearray(data.read_bytes())
    raw[8:12] = b"\xff\xfe{x"
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="not valid JSON") as info:
        load(_request(), path)
    assert str(data) in str(info.value)


def test_header_disagrees_with_index(saved):
    path, _ = saved
    (data,) = data_files(path)
    data.write_bytes(data.read_bytes().replace(b'"F32"', b'"I32"', 1))
    # the header's checksum catches it first ...
    with pytest.raises(ChecksumMismatchError) as info:
        load(_request(), path)
    assert "'layer.w'" in str(info.value) and str(data) in str(info.value) and "header" in str(info.value)
    # ... and without checksums, the comparison of the header with the index
    with pytest.raises(CorruptCheckpointError) as info:
        load(_request(), path, verify_checksums=False)
    assert "'layer.w'" in str(info.value) and str(data) in str(info.value) and "the index says F32" in str(info.value)


def test_index_names_a_missing_file(saved):
    path, _ = saved
    (data,) = data_files(path)
    data.unlink()
    with pytest.raises(CorruptCheckpointError, match="is missing") as info:
        load(_request(), path)
    assert data.name in str(info.value) and "'layer.w'" in str(info.value)


def test_index_lists_an_unknown_file(saved):
    path, _ = saved
    doc = write_legacy_index(path)
    doc["tensors"]["layer.w"]["shards"][0]["file"] = "nope.safetensors"
    (path / SAFETENSORS_DIR / INDEX_FILENAME).write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="nope.safetensors") as info:
        load(_request(), path)
    assert "'layer.w'" in str(info.value) and INDEX_FILENAME in str(info.value)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("byte_range", [0, 10**9], "outside"),
        ("byte_range", [0, 4], "expected 96"),
        ("global_offset", [0], "global_offset"),
        ("chunk_shape", [-1, 6], "chunk_shape"),
        ("flat_range", [5, 1000], "flat_range"),
    ],
)
def test_malformed_shard_entry(saved, field, value, message):
    path, _ = saved
    doc = write_legacy_index(path)
    doc["tensors"]["layer.w"]["shards"][0][field] = value
    (path / SAFETENSORS_DIR / INDEX_FILENAME).write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match=message) as info:
        load(_request(), path)
    assert "'layer.w'" in str(info.value)


def test_missing_shard_is_reported_not_read_as_zeros(saved):
    path, _ = saved
    doc = write_legacy_index(path)
    doc["tensors"]["layer.w"]["shards"].pop()
    (path / SAFETENSORS_DIR / INDEX_FILENAME).write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="cover 24 of the 48"):
        load(_request(), path)


def test_index_missing_or_not_json(saved):
    path, _ = saved
    index = path / SAFETENSORS_DIR / INDEX_FILENAME
    index.write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        load(_request(), path)
    index.unlink()
    with pytest.raises(CorruptCheckpointError, match="is missing"):
        load(_request(), path)


def test_index_of_a_newer_version(saved):
    path, _ = saved
    doc = index_doc(path)
    doc["version"] = INDEX_VERSION + 1
    (path / SAFETENSORS_DIR / INDEX_FILENAME).write_text(json.dumps(doc))
    with pytest.raises(IncompatibleStrategyError, match="upgrade dist_ckpt"):
        load(_request(), path)


def test_unknown_fields_are_ignored(saved):
    path, full = saved
    doc = index_doc(path)  # version 3
    doc["future"] = 1
    doc["tensors"]["layer.w"]["future"] = [1, 2]
    doc["files"][0]["future"] = "x"
    (path / SAFETENSORS_DIR / INDEX_FILENAME).write_text(json.dumps(doc))
    assert torch.equal(load(_request(), path)["x"], full)
    doc = write_legacy_index(path)
    doc["future"] = 1
    for shard in doc["tensors"]["layer.w"]["shards"]:
        shard["future_checksum"] = 1234  # ("crc32c" is a field of version 2)
    (path / SAFETENSORS_DIR / INDEX_FILENAME).write_text(json.dumps(doc))
    assert torch.equal(load(_request(), path)["x"], full)


def test_absent_key_and_metadata(saved):
    path, full = saved
    with pytest.raises(KeyMismatchError, match="'nope'"):
        load({"x": ShardedTensor.from_rank_offsets("nope", torch.empty(2))}, path)
    meta = SafetensorsLoadShardedStrategy().load_tensors_metadata(path)
    assert list(meta) == ["layer.w"]
    assert meta["layer.w"].global_shape == (8, 6) and meta["layer.w"].dtype == torch.float32


def test_no_error_is_a_raw_library_error(saved):
    """Random damage anywhere in a file gives a CheckpointingException: with checksums every
    flipped byte is reported; without them, damage in the header is, and damaged data loads as
    it is (exactly one byte differs)."""
    path, full = saved
    (data,) = data_files(path)
    original = data.read_bytes()
    header_len = 8 + int.from_bytes(original[:8], "little")
    gen = torch.Generator().manual_seed(0)
    positions = list(range(header_len)) + torch.randint(header_len, len(original), (20,), generator=gen).tolist()
    for position in positions:
        damaged = bytearray(original)
        damaged[position] ^= 0xFF
        data.write_bytes(bytes(damaged))
        with pytest.raises(CheckpointingException):
            load(_request(), path)
        try:
            out = load(_request(), path, verify_checksums=False)["x"]
        except CheckpointingException:
            assert position < header_len, f"damage in the data section at byte {position} was reported"
            continue
        assert position >= header_len, f"damage in the header at byte {position} went unnoticed"
        assert int((bits(out) != bits(full)).sum()) == 1


# --------------------------------------------------------------------------- the checkpoint directory


def test_files_of_an_unknown_writer_are_not_cleared(tmp_path):
    """Files under safetensors/ with no record of the save that wrote them are not proven ours:
    the save refuses and leaves them (an interrupted save's record lets the next save clear its
    files: test_save_claim.py)."""
    stale = tmp_path / SAFETENSORS_DIR / "rank00000_0.safetensors"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"half a file")
    with pytest.raises(dc.SaveConflictError, match="safetensors"):
        dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.randn(4, 4))}, tmp_path)
    assert stale.read_bytes() == b"half a file"


@pytest.mark.parametrize("legacy", [False, True], ids=["index_v3", "index_v2"])
def test_remove_sharded_tensors(tmp_path, legacy):
    sd = {
        "aw": ShardedTensor.from_rank_offsets("a.w", torch.ones(2)),
        "ab": ShardedTensor.from_rank_offsets("a.b", torch.ones(300)),
        "bw": ShardedTensor.from_rank_offsets("b.w", torch.full((2,), 5.0)),
        "ax": ShardedTensor.from_rank_offsets("ax", torch.ones(1)),
    }
    dc.save(sd, tmp_path, sharded_strategy=SafetensorsSaveShardedStrategy(SafetensorsSaveOptions(thread_count=2)))
    files_before = data_files(tmp_path)
    assert len(files_before) == 2  # "a.b" alone in one file (largest first), the rest in the other
    if legacy:
        write_legacy_index(tmp_path)
    dc.remove_sharded_tensors(tmp_path, "a.")
    assert set(dc.load_tensors_metadata(tmp_path)) == {"b.w", "ax"}
    files = index_doc(tmp_path)["files"]
    listed = set(files) if legacy else {f["name"] for f in files}
    assert len(data_files(tmp_path)) == 1 and listed == {data_files(tmp_path)[0].name}
    tables = sorted(p.name for p in (tmp_path / SAFETENSORS_DIR).glob("index.*.bin"))
    assert tables == ([] if legacy else [index_doc(tmp_path)["shard_table"]["file"]])  # the old table is gone
    assert dc.verify_checkpoint(tmp_path).ok
    out = dc.load({"b": ShardedTensor.from_rank_offsets("b.w", torch.empty(2))}, tmp_path)
    assert torch.equal(out["b"], torch.full((2,), 5.0))
    with pytest.raises(KeyMismatchError, match="'a.w'"):
        dc.load({"a": ShardedTensor.from_rank_offsets("a.w", torch.empty(2))}, tmp_path)


@pytest.mark.parametrize("files", [2, 4])
def test_a_load_reads_in_file_order_whatever_the_order_of_the_state_dict(tmp_path, monkeypatch, files):
    """A cold read is sequential only if the reads follow the files: the tensors of each file are
    read in the order of their bytes, not in the order the state dict lists them; two files are
    read one after the other (one stream), four in two streams that take turns."""
    tensors = {f"t{i}": random_tensor(torch.float32, (64, 64), seed=i) for i in range(16)}
    save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, tmp_path, thread_count=files)
    reads: List[Tuple[int, int]] = []
    original = safetensors_io.read_into

    def recording(fd, buffers, offset):
        reads.append((int(fd), offset))
        return original(fd, buffers, offset)

    monkeypatch.setattr(safetensors_io, "read_into", recording)
    keys = sorted(tensors, reverse=True)
    gen = torch.Generator().manual_seed(0)
    keys = [keys[i] for i in torch.randperm(len(keys), generator=gen).tolist()]  # neither sorted nor saved order
    out = load({k: ShardedTensor.from_rank_offsets(k, torch.empty(64, 64)) for k in keys}, tmp_path, thread_count=1)
    for k in keys:
        assert_bits_equal(out[k], tensors[k])
    data_reads = [r for r in reads if r[1] > 8]  # not the headers (length at 0, JSON at 8)
    order = [fd for fd, _ in data_reads]
    assert len(set(order)) == files
    for fd in set(order):  # each file from start to end
        offsets = [off for f, off in data_reads if f == fd]
        assert offsets == sorted(offsets) and len(offsets) >= 3
    switches = sum(a != b for a, b in zip(order, order[1:]))
    if files == 2:
        assert switches == 1  # one file, then the other
    else:
        assert switches >= len(order) // 2  # two streams taking turns
