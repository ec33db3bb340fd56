"""Unit tests of the TensorStore engine (dist_ckpt.backends.zarr.tensorstore_engine), in one process.

Most tests run for three (save engine, load engine) pairs: TensorStore -> TensorStore,
TensorStore -> zarr-python and zarr-python -> TensorStore, because the point of the engine is
that both read and write one format, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np
import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.registry import StrategyAction as A
from dist_ckpt.backends.zarr import layout as zarr_layout
from dist_ckpt.backends.zarr import tensorstore_arrays
from dist_ckpt.backends.zarr.layout import ZARR_DIR
from dist_ckpt.backends.zarr.megatron import postprocess_numpy_array
from dist_ckpt.backends.zarr.tensorstore_engine import (
    TensorStoreLoadShardedStrategy,
    TensorStoreSaveShardedStrategy,
    merge_global_slice_with_shape,
    open_ts_array,
    register_default_tensorstore_strategies,
)
from dist_ckpt.backends.zarr.zarr_python import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy
from dist_ckpt.errors import CorruptCheckpointError, KeyMismatchError, LoadMismatchError, MissingDependencyError
from dist_ckpt.model.dtypes import SUPPORTED_DTYPE_NAMES
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.strategies import base

from .test_zarr_strategy import assert_bits_equal, flat_pieces, random_tensor, split_state

SAVERS: Dict[str, Callable[[], Any]] = {"ts": TensorStoreSaveShardedStrategy, "zarr": ZarrSaveShardedStrategy}
LOADERS: Dict[str, Callable[[], Any]] = {"ts": TensorStoreLoadShardedStrategy, "zarr": ZarrLoadShardedStrategy}
PAIRS = [("ts", "ts"), ("ts", "zarr"), ("zarr", "ts")]


class Engines:
    def __init__(self, saver: str, loader: str) -> None:
        self.saver, self.loader = saver, loader

    def save(self, sd: Dict[str, Any], path: Path) -> None:
        SAVERS[self.saver]().save(sd, Path(path))

    def load(self, sd: Dict[str, Any], path: Path) -> Dict[str, Any]:
        return LOADERS[self.loader]().load(sd, Path(path))


@pytest.fixture(params=PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def eng(request: pytest.FixtureRequest) -> Engines:
    return Engines(*request.param)


@pytest.fixture
def small_fragments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fragments split into zarr chunks of 4 elements, in both engines (one layout module)."""
    monkeypatch.setattr(zarr_layout, "FRAGMENT_CHUNK_ELEMENTS", 4)


# --------------------------------------------------------------------------- dtypes and layouts


@pytest.mark.parametrize("name", SUPPORTED_DTYPE_NAMES)
def test_every_dtype_bit_exact_across_engines(tmp_path, eng, name):
    dtype = getattr(torch, name)
    full = random_tensor(dtype, (4, 6), seed=len(name))
    flat_full = random_tensor(dtype, (3, 5), seed=7)
    sd = {
        **split_state("t", full, 0, 2),
        **{f"f{i}": sh for i, sh in enumerate(flat_pieces("flat", flat_full, [0, 4, 15]))},
    }
    eng.save(sd, tmp_path)
    out = eng.load(
        {
            "w": ShardedTensor.from_rank_offsets("t", torch.empty(4, 6, dtype=dtype)),
            "f": ShardedTensor.from_rank_offsets("flat", torch.empty(3, 5, dtype=dtype)),
        },
        tmp_path,
    )
    assert_bits_equal(out["w"], full)
    assert_bits_equal(out["f"], flat_full)
    parts = eng.load(
        {f"p{r}": ShardedTensor.from_rank_offsets("t", torch.empty(4, 2, dtype=dtype), (1, r, 3)) for r in range(3)},
        tmp_path,
    )
    assert_bits_equal(torch.cat([parts[f"p{r}"] for r in range(3)], dim=1), full)


def test_grid_resharding(tmp_path, eng):
    full = torch.randn(4, 6)
    sd = {
        f"{i}{j}": ShardedTensor.from_rank_offsets(
            "w", full[2 * i : 2 * i + 2, 3 * j : 3 * j + 3].clone(), (0, i, 2), (1, j, 2)
        )
        for i in range(2)
        for j in range(2)
    }
    eng.save(sd, tmp_path)
    req = {
        f"{i}{j}": ShardedTensor.from_rank_offsets("w", torch.empty(1, 2), (0, i, 4), (1, j, 3))
        for i in range(4)
        for j in range(3)
    }
    out = eng.load(req, tmp_path)
    for i in range(4):
        for j in range(3):
            assert torch.equal(out[f"{i}{j}"], full[i : i + 1, 2 * j : 2 * j + 2])


def test_prepend_axis_and_flattened_with_prepend(tmp_path, eng):
    stacked = torch.randn(3, 4, 6)
    sd = {
        f"s{s}": ShardedTensor.from_rank_offsets("layers.w", stacked[s].clone(), (0, s, 3), prepend_axis_num=1)
        for s in range(3)
    }
    for s in range(2):
        for i, sh in enumerate(flat_pieces("st", stacked[s, :3, :4], [0, 7, 12], (0, s, 2), prepend_axis_num=1)):
            sd[f"f{s}.{i}"] = sh
    eng.save(sd, tmp_path)
    req = {
        f"{s}.{j}": ShardedTensor.from_rank_offsets(
            "layers.w", torch.empty(4, 3), (0, s, 3), (2, j, 2), prepend_axis_num=1
        )
        for s in range(3)
        for j in range(2)
    }
    out = eng.load(req, tmp_path)
    for s in range(3):
        for j in range(2):
            assert torch.equal(out[f"{s}.{j}"], stacked[s, :, 3 * j : 3 * j + 3])
    whole = eng.load({"x": ShardedTensor.from_rank_offsets("st", torch.empty(2, 3, 4))}, tmp_path)["x"]
    assert torch.equal(whole, stacked[:2, :3, :4])


def test_flattened_uneven_and_chunked_fragments(tmp_path, eng, small_fragments):
    full = torch.arange(48, dtype=torch.int32).reshape(8, 6)
    sd = {}
    for tp in range(2):
        for i, sh in enumerate(flat_pieces("opt.w", full[4 * tp : 4 * tp + 4], [0, 5, 17, 24], (0, tp, 2))):
            sd[f"tp{tp}.dp{i}"] = sh
    eng.save(sd, tmp_path)
    req = {
        f"{tp}.{i}": ShardedTensor.from_rank_offsets_flat(
            "opt.w", torch.full((b - a,), -1, dtype=torch.int32), (4, 6), (0, tp, 2), flattened_range=slice(a, b)
        )
        for tp in range(2)
        for i, (a, b) in enumerate([(0, 11), (11, 13), (13, 24)])
    }
    out = eng.load(req, tmp_path)
    for tp in range(2):
        assert torch.equal(torch.cat([out[f"{tp}.{i}"] for i in range(3)]), full[4 * tp : 4 * tp + 4].flatten())
    cols = eng.load(
        {
            f"c{j}": ShardedTensor.from_rank_offsets("opt.w", torch.empty(8, 2, dtype=torch.int32), (1, j, 3))
            for j in range(3)
        },
        tmp_path,
    )
    assert torch.equal(torch.cat([cols[f"c{j}"] for j in range(3)], dim=1), full)


def test_zero_d_empty_and_all_zero_chunks(tmp_path, eng):
    zeros_then_ones = torch.zeros(4, 6, dtype=torch.bfloat16)
    zeros_then_ones[2:] = 1
    sd = {
        "s": ShardedTensor.from_rank_offsets("scalar", torch.tensor(3.5)),
        "e": ShardedTensor.from_rank_offsets("empty", torch.zeros(0, 3)),
        "fs": ShardedTensor.from_rank_offsets_flat("flat_scalar", torch.tensor([2.5]), (), flattened_range=slice(0, 1)),
        **split_state("z", zeros_then_ones, 0, 2),
    }
    eng.save(sd, tmp_path)
    assert (tmp_path / ZARR_DIR / "z" / "c.0.0").is_file()  # the all-zero chunk exists on disk
    dest = torch.tensor(0.0)
    out = eng.load(
        {
            "s": ShardedTensor.from_rank_offsets("scalar", dest),
            "e": ShardedTensor.from_rank_offsets("empty", torch.zeros(0, 3)),
            "fs": ShardedTensor.from_rank_offsets("flat_scalar", torch.tensor(0.0)),
            "z": ShardedTensor.from_rank_offsets("z", torch.full((4, 6), 9.0).bfloat16()),
        },
        tmp_path,
    )
    assert out["s"] is dest and out["s"].item() == 3.5
    assert out["e"].shape == (0, 3) and out["fs"].item() == 2.5
    assert torch.equal(out["z"], zeros_then_ones)


class TestShapeMismatch:
    @pytest.fixture
    def stored(self, tmp_path, eng):
        full = torch.arange(1, 25, dtype=torch.float32).reshape(4, 6)
        eng.save(split_state("emb", full, 0, 2), tmp_path)
        return full

    def test_pad_and_crop(self, tmp_path, eng, stored):
        out = eng.load(
            {
                "x": ShardedTensor.from_rank_offsets("emb", torch.full((6, 8), 7.0), allow_shape_mismatch=True),
                "c": ShardedTensor.from_rank_offsets("emb", torch.empty(2, 3), allow_shape_mismatch=True),
            },
            tmp_path,
        )
        expected = torch.zeros(6, 8)
        expected[:4, :6] = stored
        assert torch.equal(out["x"], expected) and torch.equal(out["c"], stored[:2, :3])

    def test_flattened_pad(self, tmp_path, eng, stored):
        sh = ShardedTensor.from_rank_offsets_flat(
            "emb", torch.full((20,), 7.0), (5, 6), flattened_range=slice(10, 30), allow_shape_mismatch=True
        )
        expected = torch.zeros(5, 6)
        expected[:4] = stored
        assert torch.equal(eng.load({"x": sh}, tmp_path)["x"], expected.flatten()[10:30])

    def test_mismatches_raise_before_reading(self, tmp_path, eng, stored):
        with pytest.raises(LoadMismatchError, match="allow_shape_mismatch"):
            eng.load({"x": ShardedTensor.from_rank_offsets("emb", torch.empty(6, 8))}, tmp_path)
        with pytest.raises(LoadMismatchError, match="bfloat16"):
            LOADERS[eng.loader](allow_dtype_cast=False).load(
                {"x": ShardedTensor.from_rank_offsets("emb", torch.empty(4, 6, dtype=torch.bfloat16))}, tmp_path
            )
        with pytest.raises(KeyMismatchError, match="'absent'") as info:
            eng.load({"x": ShardedTensor.from_rank_offsets("absent", torch.empty(2))}, tmp_path)
        assert info.value.unexpected_keys == ["absent"]


class TestInPlace:
    def test_chunked_flattened_and_strided_destinations(self, tmp_path):
        full = torch.randn(4, 6)
        TensorStoreSaveShardedStrategy().save(split_state("w", full, 1, 3), tmp_path)
        t = torch.empty(4, 6)
        flat = torch.empty(10)
        base_ = torch.zeros(4, 12)
        strided = base_[:, ::2]
        out = TensorStoreLoadShardedStrategy().load(
            {
                "t": ShardedTensor.from_rank_offsets("w", t),
                "f": ShardedTensor.from_rank_offsets_flat("w", flat, (4, 6), flattened_range=slice(7, 17)),
                "s": ShardedTensor.from_rank_offsets("w", strided),
            },
            tmp_path,
        )
        assert out["t"] is t and torch.equal(t, full)
        assert out["f"] is flat and torch.equal(flat, full.flatten()[7:17])
        assert out["s"] is strided and torch.equal(strided, full) and torch.equal(base_[:, 1::2], torch.zeros(4, 6))

    def test_meta_or_missing_data_gets_new_tensor(self, tmp_path):
        full = torch.randn(4, 6)
        TensorStoreSaveShardedStrategy().save(split_state("w", full, 0, 2), tmp_path)
        out = TensorStoreLoadShardedStrategy().load(
            {
                "m": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6, device="meta")),
                "n": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6)).without_data(),
            },
            tmp_path,
        )
        assert out["m"].device.type == "cpu" and torch.equal(out["m"], full) and torch.equal(out["n"], full)


def _normalized_metadata(path: Path) -> Dict[str, Any]:
    """A zarr.json reduced to what defines the array (engines spell defaults differently)."""
    doc = json.loads(path.read_text())
    if doc.get("node_type") == "group":
        return {"node_type": "group", "attributes": doc.get("attributes", {})}
    return {k: doc[k] for k in ("node_type", "shape", "data_type", "chunk_grid", "attributes")} | {
        "fill_value": np.asarray(doc["fill_value"], dtype=np.float64).tolist(),
        "codecs": [c["name"] for c in doc["codecs"]],
        "chunk_key_encoding": doc["chunk_key_encoding"]["name"],
    }


def test_both_engines_write_the_same_checkpoint(tmp_path, small_fragments):
    """Same files, same chunk bytes, same array definitions and attributes."""
    sd = {
        **split_state("a.w", random_tensor(torch.bfloat16, (4, 6), seed=1), 0, 2),
        **split_state("b", random_tensor(torch.complex64, (3, 4), seed=2), 1, 2),
        "s": ShardedTensor.from_rank_offsets("scalar", torch.tensor(True)),
        **{
            f"f{i}": sh
            for i, sh in enumerate(flat_pieces("opt", random_tensor(torch.float32, (5, 3), seed=3), [0, 6, 15]))
        },
    }
    ZarrSaveShardedStrategy().save(sd, tmp_path / "zarr")
    TensorStoreSaveShardedStrategy().save(sd, tmp_path / "ts")

    def tree(root: Path) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        for p in sorted(root.rglob("*")):
            if p.is_file():
                rel = str(p.relative_to(root))
                out[rel] = _normalized_metadata(p) if p.name == "zarr.json" else p.read_bytes()
        # the manifests list the same files, and the same crcs for every chunk file (the engines
        # format zarr.json differently, so those files' crcs differ)
        manifest = json.loads(out.pop("zarr/checksums.json"))
        out["zarr/checksums.json"] = {
            name: entry if not name.endswith("zarr.json") else None for name, entry in manifest["files"].items()
        }
        return out

    zarr_tree, ts_tree = tree(tmp_path / "zarr"), tree(tmp_path / "ts")
    assert sorted(zarr_tree) == sorted(ts_tree)
    assert "zarr/opt/0.0_6/c.1" in ts_tree  # fragments split into several chunks
    for name in zarr_tree:
        assert zarr_tree[name] == ts_tree[name], name


# --------------------------------------------------------------------------- damage


class TestDamage:
    @pytest.fixture
    def stored(self, tmp_path, eng):
        full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
        sd = split_state("dmg.w", full, 0, 4)
        sd.update({f"f{i}": sh for i, sh in enumerate(flat_pieces("frag", full[:3], [0, 5, 12]))})
        eng.save(sd, tmp_path)
        return full

    def request(self) -> Dict[str, ShardedTensor]:
        return {f"r{r}": ShardedTensor.from_rank_offsets("dmg.w", torch.empty(2, 4), (0, r, 4)) for r in range(4)}

    def test_deleted_chunk_names_key_and_file(self, tmp_path, eng, stored):
        chunk = tmp_path / ZARR_DIR / "dmg.w" / "c.1.0"
        chunk.unlink()
        with pytest.raises(CorruptCheckpointError) as info:
            eng.load(self.request(), tmp_path)
        assert "'dmg.w'" in str(info.value) and str(chunk) in str(info.value) and "missing" in str(info.value)
        # the other chunks still load
        out = eng.load({"q": ShardedTensor.from_rank_offsets("dmg.w", torch.empty(2, 4), (0, 0, 4))}, tmp_path)
        assert torch.equal(out["q"], stored[:2])

    @pytest.mark.parametrize("size", [0, 10, 40])
    def test_wrongly_sized_chunk(self, tmp_path, eng, stored, size):
        chunk = tmp_path / ZARR_DIR / "dmg.w" / "c.2.0"
        with open(chunk, "r+b") as f:
            f.truncate(size)
        with pytest.raises(CorruptCheckpointError) as info:
            eng.load(self.request(), tmp_path)
        assert "'dmg.w'" in str(info.value) and str(chunk) in str(info.value)

    def test_deleted_fragment_chunk(self, tmp_path, eng, stored):
        (chunk,) = [
            p for p in (tmp_path / ZARR_DIR / "frag" / "0.0_5").rglob("*") if p.is_file() and p.name != "zarr.json"
        ]
        chunk.unlink()
        with pytest.raises(CorruptCheckpointError) as info:
            eng.load({"x": ShardedTensor.from_rank_offsets("frag", torch.empty(3, 4))}, tmp_path)
        assert "'frag'" in str(info.value) and str(chunk) in str(info.value)

    def test_deleted_fragment_breaks_coverage(self, tmp_path, eng, stored):
        shutil.rmtree(tmp_path / ZARR_DIR / "frag" / "0.0_5")
        with pytest.raises(CorruptCheckpointError, match="'frag'"):
            eng.load({"x": ShardedTensor.from_rank_offsets("frag", torch.empty(3, 4))}, tmp_path)

    def test_corrupt_array_metadata(self, tmp_path, unindexed_zarr, stored):
        """Read from its own file (a checkpoint without the root's index): see test_zarr_metadata_index."""
        path = tmp_path / ZARR_DIR / "dmg.w" / "zarr.json"
        doc = json.loads(path.read_text())
        doc["data_type"] = "no_such_type"
        path.write_text(json.dumps(doc))
        with pytest.raises(CorruptCheckpointError) as info:
            TensorStoreLoadShardedStrategy().load(self.request(), tmp_path)
        assert str(path.parent) in str(info.value)


# --------------------------------------------------------------------------- concurrency


class _Recorder:
    """Wraps TensorStore futures to log when reads are issued and when they are awaited."""

    def __init__(self, real: Any, log: List[str]) -> None:
        self.real, self.log = real, log

    def array(self, *args: Any, **kwargs: Any) -> Any:
        return _Proxy(self.real.array(*args, **kwargs), self.log)

    def open(self, *args: Any, **kwargs: Any) -> Any:
        return _Future(_Proxy.wrap_open(self.real.open(*args, **kwargs), self.log), self.log, "open")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class _Future:
    def __init__(self, real: Any, log: List[str], what: str) -> None:
        self.real, self.log, self.what = real, log, what

    def result(self) -> Any:
        if self.what != "open":
            self.log.append("wait")
        return self.real.result()


class _Proxy:
    def __init__(self, real: Any, log: List[str]) -> None:
        self.real, self.log = real, log

    @staticmethod
    def wrap_open(future: Any, log: List[str]) -> Any:
        class Opened:
            def result(self) -> Any:
                return _Proxy(future.result(), log)

        return Opened()

    def __getitem__(self, index: Any) -> "_Proxy":
        return _Proxy(self.real[index], self.log)

    def read(self) -> _Future:
        self.log.append("issue")
        return _Future(self.real.read(), self.log, "read")

    def write(self, source: Any) -> _Future:
        self.log.append("issue")
        return _Future(self.real.write(source.real if isinstance(source, _Proxy) else source), self.log, "write")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def test_reads_of_a_rank_are_in_flight_together(tmp_path, monkeypatch, small_fragments):
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    sd = {**split_state("a", full, 0, 4), **{f"f{i}": sh for i, sh in enumerate(flat_pieces("f", full, [0, 30, 64]))}}
    TensorStoreSaveShardedStrategy().save(sd, tmp_path)
    log: List[str] = []
    monkeypatch.setattr(tensorstore_arrays, "ts", _Recorder(tensorstore_arrays.ts, log))
    req = {f"a{r}": ShardedTensor.from_rank_offsets("a", torch.empty(4, 8), (0, r, 2)) for r in range(2)}
    req["f"] = ShardedTensor.from_rank_offsets("f", torch.empty(8, 8))
    out = TensorStoreLoadShardedStrategy().load(req, tmp_path)
    assert torch.equal(torch.cat([out["a0"], out["a1"]]), full) and torch.equal(out["f"], full)
    # "a" (chunks of plain bytes) is read from its chunk files without TensorStore; "f" (fragments
    # of a flattened tensor) by TensorStore in 4 contiguous boxes (2 per fragment)
    assert log.count("issue") == 4
    assert log.index("wait") == log.count("issue")  # every read issued before the first wait


def test_staged_reads_are_bounded(tmp_path, monkeypatch):
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    TensorStoreSaveShardedStrategy().save(
        {f"f{i}": sh for i, sh in enumerate(flat_pieces("f", full, [0, 16, 32, 48, 64]))}, tmp_path
    )
    log: List[str] = []
    monkeypatch.setattr(tensorstore_arrays, "ts", _Recorder(tensorstore_arrays.ts, log))
    req = {"c": ShardedTensor.from_rank_offsets("f", torch.empty(8, 4), (1, 1, 2))}  # fragments read staged
    out = TensorStoreLoadShardedStrategy(max_staged_bytes=1).load(req, tmp_path)
    assert torch.equal(out["c"], full[:, 4:])
    # 4 fragments, 4 staged reads: the budget keeps at most two in flight
    assert log == ["issue", "issue", "wait", "issue", "wait", "issue", "wait", "wait"]


# --------------------------------------------------------------------------- helpers, metadata, registry


def test_merge_global_slice_with_shape():
    assert merge_global_slice_with_shape((0, slice(4, 12)), (2, 10), "w") == (0, slice(4, 10, None))
    assert merge_global_slice_with_shape((slice(0, 3), slice(None)), (5, 6), "w") == (slice(0, 3), slice(0, 6))
    with pytest.raises(LoadMismatchError, match="'w'.*starts at 10"):
        merge_global_slice_with_shape((slice(10, 12),), (10,), "w")
    with pytest.raises(LoadMismatchError, match="'w'.*index 3"):
        merge_global_slice_with_shape((3, slice(0, 1)), (3, 4), "w")
    with pytest.raises(LoadMismatchError, match="2 axes"):
        merge_global_slice_with_shape((0, slice(0, 1)), (3,), "w")


def test_open_ts_array_and_metadata(tmp_path):
    sd = {
        **split_state("a", torch.ones(4, 6, dtype=torch.bfloat16), 0, 2),
        **{f"f{i}": sh for i, sh in enumerate(flat_pieces("b", torch.ones(3, 5), [0, 7, 15]))},
    }
    ZarrSaveShardedStrategy().save(sd, tmp_path)
    arr = open_ts_array(tmp_path / ZARR_DIR / "a")
    raw = arr.read().result()  # bfloat16 is stored as its raw bits, which any zarr v3 reader opens
    assert tuple(arr.shape) == (4, 6) and raw.dtype.name == "uint16"
    as_tensor = postprocess_numpy_array(raw, sd["a/rank0"])  # Megatron-Core's way to read
    assert_bits_equal(as_tensor[:2], torch.ones(2, 6, dtype=torch.bfloat16))
    ts_meta = TensorStoreLoadShardedStrategy().load_tensors_metadata(tmp_path)
    zarr_meta = ZarrLoadShardedStrategy().load_tensors_metadata(tmp_path)
    assert {k: (v.global_shape, v.dtype) for k, v in ts_meta.items()} == {
        k: (v.global_shape, v.dtype) for k, v in zarr_meta.items()
    }
    with pytest.raises(CorruptCheckpointError, match="nope"):
        open_ts_array(tmp_path / ZARR_DIR / "nope")


def test_through_save_and_load(tmp_path):
    """dist_ckpt.save/load with the strategy objects: the checkpoint records the zarr backend."""
    full = torch.randn(6, 4)
    dc.save(split_state("w", full, 0, 3), tmp_path, sharded_strategy=TensorStoreSaveShardedStrategy())
    assert dc.maybe_load_config(tmp_path).sharded_backend == "zarr"
    out = dc.load(
        {"x": ShardedTensor.from_rank_offsets("w", torch.empty(6, 4))},
        tmp_path,
        sharded_strategy=TensorStoreLoadShardedStrategy(),
    )
    assert torch.equal(out["x"], full)
    assert torch.equal(dc.load_plain_tensors(tmp_path)["w"], full)
    # with a cap of one concurrent file operation the result is the same
    capped = TensorStoreLoadShardedStrategy(concurrency=1).load(
        {"x": ShardedTensor.from_rank_offsets("w", torch.empty(6, 4))}, tmp_path
    )
    assert torch.equal(capped["x"], full)
    TensorStoreSaveShardedStrategy(concurrency=1).save(split_state("w", full, 1, 2), tmp_path / "capped")
    assert torch.equal(
        ZarrLoadShardedStrategy().load(
            {"x": ShardedTensor.from_rank_offsets("w", torch.empty(6, 4))}, tmp_path / "capped"
        )["x"],
        full,
    )
    with pytest.raises(dc.CheckpointingException, match="'zarr', 1"):
        TensorStoreSaveShardedStrategy("safetensors", 1)


def test_registry_alternatives_and_megatron_registration(tmp_path):
    assert base.alternative_strategies(A.LOAD_SHARDED, "zarr", 1) == ["tensorstore"]
    assert base.alternative_strategies(A.SAVE_SHARDED, "zarr", 1) == ["tensorstore"]
    assert base.alternative_strategies(A.LOAD_SHARDED, "torch", 1) == []
    assert isinstance(
        base.get_alternative_strategy(A.LOAD_SHARDED, "zarr", 1, "tensorstore"), TensorStoreLoadShardedStrategy
    )
    with pytest.raises(dc.UnknownStrategyError, match="'nope'.*tensorstore"):
        base.get_alternative_strategy(A.LOAD_SHARDED, "zarr", 1, "nope")
    assert isinstance(dc.get_default_strategy(A.LOAD_SHARDED, "zarr", 1), ZarrLoadShardedStrategy)
    try:
        register_default_tensorstore_strategies()
        assert isinstance(dc.get_default_strategy(A.LOAD_SHARDED, "zarr", 1), TensorStoreLoadShardedStrategy)
        assert isinstance(dc.get_default_strategy(A.SAVE_SHARDED, "zarr", 1), ZarrSaveShardedStrategy)
        register_default_tensorstore_strategies(include_save=True)
        assert isinstance(dc.get_default_strategy(A.SAVE_SHARDED, "zarr", 1), TensorStoreSaveShardedStrategy)
    finally:
        base.unregister_strategy(A.LOAD_SHARDED, "zarr", 1)
        base.unregister_strategy(A.SAVE_SHARDED, "zarr", 1)
    assert isinstance(dc.get_default_strategy(A.LOAD_SHARDED, "zarr", 1), ZarrLoadShardedStrategy)


def test_missing_tensorstore_names_the_pip_extra():
    code = (
        "import sys\n"
        "sys.modules['tensorstore'] = None  # as if not installed\n"
        "import dist_ckpt\n"
        "from dist_ckpt.strategies import base\n"
        "try:\n"
        "    import dist_ckpt.backends.zarr.tensorstore_engine\n"
        "except dist_ckpt.MissingDependencyError as e:\n"
        "    print('import:', e)\n"
        "try:\n"
        "    base.get_alternative_strategy(base.StrategyAction.LOAD_SHARDED, 'zarr', 1, 'tensorstore')\n"
        "except dist_ckpt.MissingDependencyError as e:\n"
        "    print('registry:', e)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=dict(os.environ)
    )
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2, result.stdout + result.stderr
    assert all("pip install 'dist_ckpt[tensorstore]'" in line for line in lines)
    assert issubclass(MissingDependencyError, ImportError)


def test_importing_dist_ckpt_does_not_import_tensorstore():
    code = "import sys, dist_ckpt, dist_ckpt.backends.base\nprint('tensorstore' in sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
