"""Unit tests of the Zarr backend (dist_ckpt.backends.zarr.zarr_python), in one process.

One process may hold several ShardedTensors of the same key under different state-dict keys
("virtual ranks"): that is a valid sharding, so resharding is tested without process groups.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import zarr
import zarr.storage

import dist_ckpt as dc
from dist_ckpt.backends.zarr import direct as zarr_direct
from dist_ckpt.backends.zarr import layout as zarr_layout
from dist_ckpt.backends.zarr.layout import ZARR_DIR
from dist_ckpt.backends.zarr.zarr_python import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy
from dist_ckpt.errors import CorruptCheckpointError, KeyMismatchError, LoadMismatchError
from dist_ckpt.model.dtypes import SUPPORTED_DTYPE_NAMES
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.storage import encode_key
from dist_ckpt.testing.layouts import bits
from dist_ckpt.testing.layouts import random_bits_tensor as random_tensor


def save(sd, path):
    ZarrSaveShardedStrategy().save(sd, Path(path))


def load(sd, path):
    return ZarrLoadShardedStrategy().load(sd, Path(path))


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


def split_state(key, full, axis, parts, **kw):
    """``parts`` virtual ranks, each holding one chunk of ``full`` along ``axis``."""
    chunks = full.chunk(parts, axis)
    return {
        f"{key}/rank{r}": ShardedTensor.from_rank_offsets(key, chunks[r].clone(), (axis, r, parts), **kw)
        for r in range(parts)
    }


def empty_split(key, full_shape, dtype, axis, parts, fill=float("nan")):
    shape = list(full_shape)
    shape[axis] //= parts
    return {
        f"rank{r}": ShardedTensor.from_rank_offsets(
            key,
            torch.full(shape, fill).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype),
            (axis, r, parts),
        )
        for r in range(parts)
    }


def flat_pieces(key, local, boundaries, *rank_offsets, **kw):
    """The flattened ``local`` cut at ``boundaries`` into ShardedTensors with flattened_range."""
    flat = local.flatten()
    out = []
    for start, stop in zip(boundaries[:-1], boundaries[1:]):
        out.append(
            ShardedTensor.from_rank_offsets_flat(
                key, flat[start:stop].clone(), local.shape, *rank_offsets, flattened_range=slice(start, stop), **kw
            )
        )
    return out


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("name", SUPPORTED_DTYPE_NAMES)
def test_every_dtype_round_trips_bit_exactly(tmp_path, name):
    dtype = getattr(torch, name)
    full = random_tensor(dtype, (4, 6), seed=len(name))
    save(split_state("t", full, 0, 2), tmp_path)
    whole = ShardedTensor.from_rank_offsets("t", torch.empty(4, 6, dtype=dtype))
    assert_bits_equal(load({"w": whole}, tmp_path)["w"], full)
    # resharded along the other axis
    parts = load(
        {f"p{r}": ShardedTensor.from_rank_offsets("t", torch.empty(4, 2, dtype=dtype), (1, r, 3)) for r in range(3)},
        tmp_path,
    )
    assert_bits_equal(torch.cat([parts[f"p{r}"] for r in range(3)], dim=1), full)
    # the stored zarr array holds the dtype under its stable name
    meta = json.loads((tmp_path / ZARR_DIR / "t" / "zarr.json").read_text())
    assert meta["attributes"]["dist_ckpt"]["dtype"] == name


@pytest.mark.parametrize("name", SUPPORTED_DTYPE_NAMES)
def test_every_dtype_round_trips_flattened(tmp_path, name):
    dtype = getattr(torch, name)
    full = random_tensor(dtype, (3, 5), seed=3)
    save({f"f{i}": sh for i, sh in enumerate(flat_pieces("t", full, [0, 4, 15]))}, tmp_path)
    out = load({"w": ShardedTensor.from_rank_offsets("t", torch.empty(3, 5, dtype=dtype))}, tmp_path)["w"]
    assert_bits_equal(out, full)


def test_stored_array_is_plain_zarr_v3(tmp_path):
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    save(split_state("layer.w", full, 0, 4), tmp_path)
    arr = zarr.open_array(store=str(tmp_path / ZARR_DIR / "layer.w"), mode="r")
    assert arr.shape == (4, 6) and arr.chunks == (1, 6)
    assert (arr[:] == full.numpy()).all()


# --------------------------------------------------------------------------- resharding


@pytest.mark.parametrize("axis", [0, 1])
def test_reshard_4_2_1(tmp_path, axis):
    full = torch.randn(8, 12, dtype=torch.float64)
    save(split_state("w", full, axis, 4), tmp_path / "four")
    two = load(empty_split("w", full.shape, full.dtype, axis, 2), tmp_path / "four")
    assert torch.equal(torch.cat([two["rank0"], two["rank1"]], dim=axis), full)
    save(
        {f"r{r}": ShardedTensor.from_rank_offsets("w", two[f"rank{r}"], (axis, r, 2)) for r in range(2)},
        tmp_path / "two",
    )
    (one,) = load(empty_split("w", full.shape, full.dtype, axis, 1), tmp_path / "two").values()
    assert torch.equal(one, full)


def test_reshard_grid(tmp_path):
    full = torch.randn(4, 6)
    sd = {}
    for i in range(2):
        for j in range(2):
            sd[f"{i}{j}"] = ShardedTensor.from_rank_offsets(
                "w", full[2 * i : 2 * i + 2, 3 * j : 3 * j + 3].clone(), (0, i, 2), (1, j, 2)
            )
    save(sd, tmp_path)
    req = {
        f"{i}{j}": ShardedTensor.from_rank_offsets("w", torch.empty(1, 2), (0, i, 4), (1, j, 3))
        for i in range(4)
        for j in range(3)
    }
    out = load(req, tmp_path)
    for i in range(4):
        for j in range(3):
            assert torch.equal(out[f"{i}{j}"], full[i : i + 1, 2 * j : 2 * j + 2])


def test_replicas_are_not_saved(tmp_path):
    main = torch.ones(2, 3)
    sd = {
        "main": ShardedTensor.from_rank_offsets("w", main),
        "replica": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), replica_id=1),
    }
    save(sd, tmp_path)
    assert torch.equal(load({"x": ShardedTensor.from_rank_offsets("w", torch.empty(2, 3))}, tmp_path)["x"], main)


def test_prepend_axis_num(tmp_path):
    stacked = torch.randn(3, 4, 6)  # 3 layers, one per pipeline stage
    sd = {
        f"stage{s}": ShardedTensor.from_rank_offsets("layers.w", stacked[s].clone(), (0, s, 3), prepend_axis_num=1)
        for s in range(3)
    }
    save(sd, tmp_path)
    whole = load({"x": ShardedTensor.from_rank_offsets("layers.w", torch.empty(3, 4, 6))}, tmp_path)["x"]
    assert torch.equal(whole, stacked)
    # another layout: per layer, split in two along the layer's axis 1
    req = {
        f"{s}.{j}": ShardedTensor.from_rank_offsets(
            "layers.w", torch.empty(4, 3), (0, s, 3), (2, j, 2), prepend_axis_num=1
        )
        for s in range(3)
        for j in range(2)
    }
    out = load(req, tmp_path)
    for s in range(3):
        for j in range(2):
            assert torch.equal(out[f"{s}.{j}"], stacked[s, :, 3 * j : 3 * j + 3])


# --------------------------------------------------------------------------- flattened ranges


def test_flattened_uneven_pieces(tmp_path):
    full = torch.randn(8, 6)
    sd = {}
    for tp in range(2):  # two tensor-parallel "ranks", each with 3 uneven optimizer pieces
        local = full[4 * tp : 4 * tp + 4]
        for i, sh in enumerate(flat_pieces("opt.w", local, [0, 5, 17, 24], (0, tp, 2))):
            sd[f"tp{tp}.dp{i}"] = sh
    save(sd, tmp_path)
    # other uneven pieces
    req = {}
    for tp in range(2):
        for i, (a, b) in enumerate([(0, 11), (11, 13), (13, 24)]):
            req[f"{tp}.{i}"] = ShardedTensor.from_rank_offsets_flat(
                "opt.w", torch.full((b - a,), float("nan")), (4, 6), (0, tp, 2), flattened_range=slice(a, b)
            )
    out = load(req, tmp_path)
    for tp in range(2):
        got = torch.cat([out[f"{tp}.{i}"] for i in range(3)])
        assert torch.equal(got, full[4 * tp : 4 * tp + 4].flatten())
    # non-flattened: the whole tensor, and another split
    whole = load({"x": ShardedTensor.from_rank_offsets("opt.w", torch.empty(8, 6))}, tmp_path)["x"]
    assert torch.equal(whole, full)
    cols = load(
        {f"c{j}": ShardedTensor.from_rank_offsets("opt.w", torch.empty(8, 2), (1, j, 3)) for j in range(3)}, tmp_path
    )
    assert torch.equal(torch.cat([cols[f"c{j}"] for j in range(3)], dim=1), full)


def test_flattened_fragments_in_several_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(zarr_layout, "FRAGMENT_CHUNK_ELEMENTS", 4)
    full = torch.arange(30, dtype=torch.int32).reshape(5, 6)
    save({f"p{i}": sh for i, sh in enumerate(flat_pieces("f", full, [0, 13, 30]))}, tmp_path)
    req = {
        f"q{i}": ShardedTensor.from_rank_offsets_flat(
            "f", torch.zeros(b - a, dtype=torch.int32), (5, 6), flattened_range=slice(a, b)
        )
        for i, (a, b) in enumerate([(0, 3), (3, 22), (22, 30)])
    }
    out = load(req, tmp_path)
    assert torch.equal(torch.cat([out[f"q{i}"] for i in range(3)]), full.flatten())
    whole = load({"x": ShardedTensor.from_rank_offsets("f", torch.empty(5, 6, dtype=torch.int32))}, tmp_path)["x"]
    assert torch.equal(whole, full)


def test_flattened_with_prepend(tmp_path):
    stacked = torch.randn(2, 3, 4)
    sd = {}
    for s in range(2):
        for i, sh in enumerate(flat_pieces("st", stacked[s], [0, 7, 12], (0, s, 2), prepend_axis_num=1)):
            sd[f"{s}.{i}"] = sh
    save(sd, tmp_path)
    assert torch.equal(load({"x": ShardedTensor.from_rank_offsets("st", torch.empty(2, 3, 4))}, tmp_path)["x"], stacked)


def test_flattened_empty_piece(tmp_path):
    full = torch.randn(2, 3)
    pieces = flat_pieces("f", full, [0, 0, 6])
    save({"a": pieces[0], "b": pieces[1]}, tmp_path)
    assert torch.equal(load({"x": ShardedTensor.from_rank_offsets("f", torch.empty(2, 3))}, tmp_path)["x"], full)


# --------------------------------------------------------------------------- shape mismatch, 0-d, empty


class TestShapeMismatch:
    @pytest.fixture
    def stored(self, tmp_path):
        full = torch.arange(1, 25, dtype=torch.float32).reshape(4, 6)
        save(split_state("emb", full, 0, 2), tmp_path)
        return full

    def test_pad(self, tmp_path, stored):
        dest = torch.full((6, 8), 7.0)  # garbage that must be overwritten with zeros
        sh = ShardedTensor.from_rank_offsets("emb", dest, allow_shape_mismatch=True)
        out = load({"x": sh}, tmp_path)["x"]
        assert torch.equal(out[:4, :6], stored)
        padded = out.clone()
        padded[:4, :6] = 0
        assert torch.equal(padded, torch.zeros(6, 8))

    def test_crop(self, tmp_path, stored):
        sh = ShardedTensor.from_rank_offsets("emb", torch.empty(2, 3), allow_shape_mismatch=True)
        assert torch.equal(load({"x": sh}, tmp_path)["x"], stored[:2, :3])

    def test_sharded_pad(self, tmp_path, stored):
        req = {
            f"r{r}": ShardedTensor.from_rank_offsets(
                "emb", torch.full((3, 6), 7.0), (0, r, 2), allow_shape_mismatch=True
            )
            for r in range(2)
        }
        out = load(req, tmp_path)
        assert torch.equal(out["r0"], stored[:3])
        assert torch.equal(out["r1"][0], stored[3])
        assert torch.equal(out["r1"][1:], torch.zeros(2, 6))

    def test_flattened_pad(self, tmp_path, stored):
        sh = ShardedTensor.from_rank_offsets_flat(
            "emb", torch.full((20,), 7.0), (5, 6), flattened_range=slice(10, 30), allow_shape_mismatch=True
        )
        out = load({"x": sh}, tmp_path)["x"]
        expected = torch.zeros(5, 6)
        expected[:4] = stored
        assert torch.equal(out, expected.flatten()[10:30])

    def test_without_flag(self, tmp_path, stored):
        sh = ShardedTensor.from_rank_offsets("emb", torch.empty(6, 8))
        with pytest.raises(LoadMismatchError, match="'emb'") as info:
            load({"x": sh}, tmp_path)
        assert "(4, 6)" in str(info.value) and "(6, 8)" in str(info.value)
        assert "allow_shape_mismatch" in str(info.value)

    def test_ndim_mismatch_even_with_flag(self, tmp_path, stored):
        sh = ShardedTensor.from_rank_offsets("emb", torch.empty(24), allow_shape_mismatch=True)
        with pytest.raises(LoadMismatchError, match="'emb'"):
            load({"x": sh}, tmp_path)

    def test_dtype_mismatch_casts_unless_refused(self, tmp_path, stored):
        sh = ShardedTensor.from_rank_offsets("emb", torch.empty(4, 6, dtype=torch.bfloat16))
        assert torch.equal(load({"x": sh}, tmp_path)["x"], stored.to(torch.bfloat16))
        with pytest.raises(LoadMismatchError, match="'emb'") as info:
            ZarrLoadShardedStrategy(allow_dtype_cast=False).load({"x": sh}, tmp_path)
        assert "bfloat16" in str(info.value) and "float32" in str(info.value)


def test_zero_d(tmp_path):
    save(
        {
            "s": ShardedTensor.from_rank_offsets("scalar", torch.tensor(3.5)),
            "i": ShardedTensor.from_rank_offsets("int_scalar", torch.tensor(-7, dtype=torch.int64)),
        },
        tmp_path,
    )
    dest = torch.tensor(0.0)
    out = load(
        {
            "s": ShardedTensor.from_rank_offsets("scalar", dest),
            "i": ShardedTensor.from_rank_offsets("int_scalar", torch.tensor(0, dtype=torch.int64)),
        },
        tmp_path,
    )
    assert out["s"].shape == () and out["s"].item() == 3.5 and out["s"] is dest
    assert out["i"].item() == -7


def test_zero_d_flattened(tmp_path):
    sh = ShardedTensor.from_rank_offsets_flat("scalar", torch.tensor([2.5]), (), flattened_range=slice(0, 1))
    save({"s": sh}, tmp_path)
    out = load({"s": ShardedTensor.from_rank_offsets("scalar", torch.tensor(0.0))}, tmp_path)["s"]
    assert out.shape == () and out.item() == 2.5
    back = load(
        {"s": ShardedTensor.from_rank_offsets_flat("scalar", torch.zeros(1), (), flattened_range=slice(0, 1))}, tmp_path
    )["s"]
    assert back.tolist() == [2.5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_all_zero_chunks_round_trip(tmp_path, dtype):
    """A chunk equal to the fill value (all zeros) must still be written and read back."""
    full = torch.zeros(4, 6, dtype=dtype)
    full[2:] = 1  # chunk 1 is non-zero, chunk 0 is all zeros
    save(split_state("z", full, 0, 2), tmp_path)
    assert (tmp_path / ZARR_DIR / "z" / "c.0.0").is_file()
    out = load({"x": ShardedTensor.from_rank_offsets("z", torch.ones(4, 6, dtype=dtype))}, tmp_path)["x"]
    assert torch.equal(out, full)


def test_empty_tensor(tmp_path):
    save({"e": ShardedTensor.from_rank_offsets("empty", torch.zeros(0, 3))}, tmp_path)
    out = load({"e": ShardedTensor.from_rank_offsets("empty", torch.zeros(0, 3))}, tmp_path)["e"]
    assert out.shape == (0, 3)


# --------------------------------------------------------------------------- in place


class TestInPlace:
    def test_out_is_t(self, tmp_path):
        full = torch.randn(4, 6)
        save(split_state("w", full, 0, 2), tmp_path)
        t = torch.empty(4, 6)
        out = load({"x": ShardedTensor.from_rank_offsets("w", t)}, tmp_path)["x"]
        assert out is t and torch.equal(t, full)

    def test_flattened_in_place(self, tmp_path):
        full = torch.randn(4, 6)
        save(split_state("w", full, 0, 2), tmp_path)
        t = torch.empty(10)
        out = load({"x": ShardedTensor.from_rank_offsets_flat("w", t, (4, 6), flattened_range=slice(7, 17))}, tmp_path)[
            "x"
        ]
        assert out is t and torch.equal(t, full.flatten()[7:17])

    def test_non_contiguous_destination(self, tmp_path):
        full = torch.randn(4, 3)
        save(split_state("w", full, 1, 3), tmp_path)
        base = torch.zeros(4, 6)
        t = base[:, ::2]
        out = load({"x": ShardedTensor.from_rank_offsets("w", t)}, tmp_path)["x"]
        assert out is t
        assert torch.equal(base[:, ::2], full) and torch.equal(base[:, 1::2], torch.zeros(4, 3))

    def test_meta_or_missing_data_gets_new_tensor(self, tmp_path):
        full = torch.randn(4, 6)
        save(split_state("w", full, 0, 2), tmp_path)
        meta = ShardedTensor.from_rank_offsets("w", torch.empty(4, 6, device="meta"))
        none = ShardedTensor.from_rank_offsets("w", torch.empty(4, 6)).without_data()
        out = load({"m": meta, "n": none}, tmp_path)
        assert out["m"].device.type == "cpu" and torch.equal(out["m"], full)
        assert torch.equal(out["n"], full)


# --------------------------------------------------------------------------- partial reads


@pytest.fixture
def read_log(monkeypatch):
    """Record every key read through zarr's LocalStore, or read directly as a whole chunk
    (`zarr.direct`), as (store root, key)."""
    log = []
    original = zarr.storage.LocalStore.get

    async def get(self, key, *args, **kwargs):
        log.append((Path(str(self.root)), key))
        return await original(self, key, *args, **kwargs)

    direct = zarr_direct.read_chunk_into

    def read_chunk_into(array_dir, chunk, *args, **kwargs):
        log.append((array_dir.local_path(), chunk))
        return direct(array_dir, chunk, *args, **kwargs)

    monkeypatch.setattr(zarr.storage.LocalStore, "get", get)
    monkeypatch.setattr(zarr_direct, "read_chunk_into", read_chunk_into)
    return log


def _chunk_reads(log):
    """Chunk files read, as (tensor directory, path inside it), however zarr opened the store."""
    meta = ("zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata")
    out = []
    for root, key in log:
        if key.endswith(meta):
            continue
        full = root / key
        zarr_root = next(p for p in full.parents if p.name == ZARR_DIR)
        tensor, _, rest = str(full.relative_to(zarr_root)).partition("/")
        out.append((tensor, rest))
    return sorted(out)


def test_load_reads_only_needed_chunk(tmp_path, read_log):
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    save(split_state("w", full, 0, 4), tmp_path)
    chunk_files = sorted(p.name for p in (tmp_path / ZARR_DIR / "w").iterdir() if p.name != "zarr.json")
    assert chunk_files == [f"c.{i}.0" for i in range(4)]  # beside zarr.json: no directories (layout.CHUNK_SEPARATOR)
    read_log.clear()
    out = load({"q": ShardedTensor.from_rank_offsets("w", torch.empty(2, 4), (0, 2, 4))}, tmp_path)
    assert torch.equal(out["q"], full[4:6])
    assert _chunk_reads(read_log) == [("w", "c.2.0")]
    read_log.clear()
    load({"q": ShardedTensor.from_rank_offsets("w", torch.empty(4, 4), (0, 0, 2))}, tmp_path)
    assert _chunk_reads(read_log) == [("w", "c.0.0"), ("w", "c.1.0")]


def test_flattened_load_reads_only_needed_fragment_chunks(tmp_path, read_log, monkeypatch):
    monkeypatch.setattr(zarr_layout, "FRAGMENT_CHUNK_ELEMENTS", 4)
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    save({f"p{i}": sh for i, sh in enumerate(flat_pieces("f", full, [0, 12, 24]))}, tmp_path)
    read_log.clear()
    out = load(
        {"q": ShardedTensor.from_rank_offsets_flat("f", torch.empty(2), (4, 6), flattened_range=slice(13, 15))},
        tmp_path,
    )
    assert torch.equal(out["q"], full.flatten()[13:15])
    reads = _chunk_reads(read_log)
    # only the fragment holding [12, 24), and at most the chunks of the row holding [13, 15)
    assert ("f", "0.0_12/c.0") in reads
    assert set(reads) <= {("f", "0.0_12/c.0"), ("f", "0.0_12/c.1")}


# --------------------------------------------------------------------------- damage


class TestDamage:
    @pytest.fixture
    def stored(self, tmp_path):
        full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
        save(split_state("dmg.w", full, 0, 4), tmp_path)
        return full

    def request(self):
        return {f"r{r}": ShardedTensor.from_rank_offsets("dmg.w", torch.empty(2, 4), (0, r, 4)) for r in range(4)}

    def test_deleted_chunk(self, tmp_path, stored):
        chunk = tmp_path / ZARR_DIR / "dmg.w" / "c.1.0"
        chunk.unlink()
        with pytest.raises(CorruptCheckpointError) as info:
            load(self.request(), tmp_path)
        assert "'dmg.w'" in str(info.value) and str(chunk) in str(info.value)

    @pytest.mark.parametrize("size", [0, 10, 16])
    def test_truncated_chunk(self, tmp_path, stored, size):
        chunk = tmp_path / ZARR_DIR / "dmg.w" / "c.2.0"
        with open(chunk, "r+b") as f:
            f.truncate(size)
        with pytest.raises(CorruptCheckpointError) as info:
            load(self.request(), tmp_path)
        assert "'dmg.w'" in str(info.value)
        assert str(chunk) in str(info.value)  # names the damaged file

    def test_oversized_chunk(self, tmp_path, stored):
        chunk = tmp_path / ZARR_DIR / "dmg.w" / "c.2.0"
        with open(chunk, "ab") as f:
            f.write(b"\0" * 8)
        with pytest.raises(CorruptCheckpointError, match="'dmg.w'"):
            load(self.request(), tmp_path)

    def test_undamaged_chunks_still_load(self, tmp_path, stored):
        (tmp_path / ZARR_DIR / "dmg.w" / "c.3.0").unlink()
        out = load({"q": ShardedTensor.from_rank_offsets("dmg.w", torch.empty(2, 4), (0, 0, 4))}, tmp_path)
        assert torch.equal(out["q"], stored[:2])

    @pytest.mark.parametrize("payload", [b"\x00\x01garbage", b"{}", b'{"zarr_format": 3, "node_type": "array"}'])
    def test_corrupt_array_metadata(self, tmp_path, unindexed_zarr, stored, payload):
        """Read from its own file (a checkpoint without the root's index): see test_zarr_metadata_index."""
        path = tmp_path / ZARR_DIR / "dmg.w" / "zarr.json"
        path.write_bytes(payload)
        with pytest.raises(CorruptCheckpointError) as info:
            load(self.request(), tmp_path)
        assert str(path.parent) in str(info.value)

    def test_missing_attributes(self, tmp_path, unindexed_zarr, stored):
        path = tmp_path / ZARR_DIR / "dmg.w" / "zarr.json"
        meta = json.loads(path.read_text())
        meta["attributes"] = {}
        path.write_text(json.dumps(meta))
        with pytest.raises(CorruptCheckpointError, match=r"dmg\.w/zarr\.json"):
            load(self.request(), tmp_path)

    def test_deleted_fragment(self, tmp_path):
        full = torch.randn(3, 4)
        save({f"p{i}": sh for i, sh in enumerate(flat_pieces("frag", full, [0, 5, 12]))}, tmp_path)
        fragments = sorted(p.name for p in (tmp_path / ZARR_DIR / "frag").iterdir() if p.is_dir())
        assert fragments == ["0.0_0", "0.0_5"]
        import shutil

        shutil.rmtree(tmp_path / ZARR_DIR / "frag" / "0.0_5")
        with pytest.raises(CorruptCheckpointError, match="'frag'"):
            load({"x": ShardedTensor.from_rank_offsets("frag", torch.empty(3, 4))}, tmp_path)

    def test_deleted_fragment_chunk(self, tmp_path):
        full = torch.randn(3, 4)
        save({f"p{i}": sh for i, sh in enumerate(flat_pieces("frag", full, [0, 5, 12]))}, tmp_path)
        (chunk,) = [
            p for p in (tmp_path / ZARR_DIR / "frag" / "0.0_5").rglob("*") if p.is_file() and p.name != "zarr.json"
        ]
        chunk.unlink()
        with pytest.raises(CorruptCheckpointError) as info:
            load({"x": ShardedTensor.from_rank_offsets("frag", torch.empty(3, 4))}, tmp_path)
        assert "'frag'" in str(info.value) and str(chunk) in str(info.value)


# --------------------------------------------------------------------------- keys, metadata, removal


def test_absent_key(tmp_path):
    save(split_state("present", torch.ones(2, 2), 0, 1), tmp_path)
    with pytest.raises(KeyMismatchError, match="'absent.key'") as info:
        load({"x": ShardedTensor.from_rank_offsets("absent.key", torch.empty(2))}, tmp_path)
    assert info.value.unexpected_keys == ["absent.key"]


def test_awkward_keys(tmp_path):
    keys = ["a b/c%d", "ünï/键", ".hidden", "x" * 300]
    sd = {k: ShardedTensor.from_rank_offsets(k, torch.full((2,), float(i + 1))) for i, k in enumerate(keys)}
    save(sd, tmp_path)
    for p in tmp_path.rglob("*"):
        assert tmp_path in p.resolve().parents
    names = sorted(os.listdir(tmp_path / ZARR_DIR))
    assert set(encode_key(k) for k in keys) <= set(names)
    out = load({k: ShardedTensor.from_rank_offsets(k, torch.empty(2)) for k in keys}, tmp_path)
    for i, k in enumerate(keys):
        assert torch.equal(out[k], torch.full((2,), float(i + 1)))
    meta = ZarrLoadShardedStrategy().load_tensors_metadata(tmp_path)
    assert set(meta) == set(keys)


def test_load_tensors_metadata(tmp_path):
    save(
        {
            **split_state("a", torch.ones(4, 6, dtype=torch.bfloat16), 0, 2),
            **{f"f{i}": sh for i, sh in enumerate(flat_pieces("b", torch.ones(3, 5), [0, 7, 15]))},
        },
        tmp_path,
    )
    meta = ZarrLoadShardedStrategy().load_tensors_metadata(tmp_path)
    assert set(meta) == {"a", "b"}
    assert meta["a"].global_shape == (4, 6) and meta["a"].dtype == torch.bfloat16
    assert meta["b"].global_shape == (3, 5) and meta["b"].dtype == torch.float32
    for sh in meta.values():
        assert sh.global_offset == (0,) * len(sh.global_shape) and sh.local_shape == sh.global_shape
    assert ZarrLoadShardedStrategy().load_sharded_metadata(tmp_path).keys() == meta.keys()


def test_load_tensors_metadata_without_zarr_dir(tmp_path):
    with pytest.raises(CorruptCheckpointError, match="zarr"):
        ZarrLoadShardedStrategy().load_tensors_metadata(tmp_path)


def test_remove_sharded_tensors(tmp_path):
    sd = {
        "aw": ShardedTensor.from_rank_offsets("a.w", torch.ones(2)),
        "ab": ShardedTensor.from_rank_offsets("a.b", torch.ones(3)),
        "along": ShardedTensor.from_rank_offsets("a." + "z" * 300, torch.ones(1)),
        "bw": ShardedTensor.from_rank_offsets("b.w", torch.full((2,), 5.0)),
        "ax": ShardedTensor.from_rank_offsets("ax", torch.ones(1)),
    }
    dc.save(sd, tmp_path / "c", sharded_strategy=("zarr", 1))
    dc.remove_sharded_tensors(tmp_path / "c", "a.")
    meta = dc.load_tensors_metadata(tmp_path / "c")
    assert set(meta) == {"b.w", "ax"}
    assert not any(name.startswith(".") for name in os.listdir(tmp_path / "c" / ZARR_DIR))  # no trash left
    out = dc.load({"b": ShardedTensor.from_rank_offsets("b.w", torch.empty(2))}, tmp_path / "c")
    assert torch.equal(out["b"], torch.full((2,), 5.0))
    with pytest.raises(KeyMismatchError, match="'a.w'"):
        dc.load({"a": ShardedTensor.from_rank_offsets("a.w", torch.empty(2))}, tmp_path / "c")


def test_strategy_identity():
    s = ZarrSaveShardedStrategy()
    assert (s.backend, s.version) == ("zarr", 1) and s.owned_paths == (ZARR_DIR, ".partial-zarr")
    assert ZarrLoadShardedStrategy.supported_backends == ("zarr",)
    assert ZarrLoadShardedStrategy.supported_versions == (1,)


def test_flattened_pieces_in_any_order(tmp_path):
    """The piece at the tensor's origin may come last in the state dict."""
    full = torch.randn(4, 6)
    pieces = []
    for tp in range(2):
        pieces += flat_pieces("w", full[2 * tp : 2 * tp + 2], [0, 5, 12], (0, tp, 2))
    save({f"p{i}": sh for i, sh in enumerate(reversed(pieces))}, tmp_path)
    assert torch.equal(load({"x": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6))}, tmp_path)["x"], full)


def test_flattened_stored_cropped_load(tmp_path):
    full = torch.randn(3, 5)
    save({f"p{i}": sh for i, sh in enumerate(flat_pieces("w", full, [0, 6, 15]))}, tmp_path)
    sh = ShardedTensor.from_rank_offsets("w", torch.empty(2, 3), allow_shape_mismatch=True)
    assert torch.equal(load({"x": sh}, tmp_path)["x"], full[:2, :3])


def test_non_contiguous_source(tmp_path):
    base = torch.randn(6, 4)
    sd = {f"r{r}": ShardedTensor.from_rank_offsets("t", base.t()[2 * r : 2 * r + 2], (0, r, 2)) for r in range(2)}
    assert not sd["r0"].data.is_contiguous()
    save(sd, tmp_path)
    assert torch.equal(load({"x": ShardedTensor.from_rank_offsets("t", torch.empty(4, 6))}, tmp_path)["x"], base.t())


@pytest.mark.parametrize("key", ["zarr.json", "c", "zarr"])
def test_keys_that_look_like_zarr_files(tmp_path, key):
    """Keys are names, not paths: one that equals a zarr metadata file name must still round-trip."""
    sd = {
        "x": ShardedTensor.from_rank_offsets(key, torch.full((2,), 3.0)),
        "y": ShardedTensor.from_rank_offsets("other", torch.full((2,), 4.0)),
    }
    save(sd, tmp_path)
    out = load(
        {
            "x": ShardedTensor.from_rank_offsets(key, torch.empty(2)),
            "y": ShardedTensor.from_rank_offsets("other", torch.empty(2)),
        },
        tmp_path,
    )
    assert torch.equal(out["x"], torch.full((2,), 3.0)) and torch.equal(out["y"], torch.full((2,), 4.0))
    assert set(ZarrLoadShardedStrategy().load_tensors_metadata(tmp_path)) == {key, "other"}
