"""Chunk files and array metadata written and read without an array library (`zarr.direct`):
the same zarr v3 arrays, which zarr-python and TensorStore open; a chunk written once; chunks of
plain bytes read from their files and checked from the bytes read (whole ones straight into their
tensors; parts, other layouts and dtypes through a buffer of the chunk); everything else through
the engine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

import dist_ckpt as dc
from dist_ckpt.backends.zarr import tensorstore_arrays, tensorstore_engine, zarr_python_load
from dist_ckpt.backends.zarr.layout import ZARR_DIR
from dist_ckpt.backends.zarr.metadata import plain_chunk_bytes
from dist_ckpt.backends.zarr.nodes import array_metadata
from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreLoadShardedStrategy, TensorStoreSaveShardedStrategy
from dist_ckpt.backends.zarr.zarr_python import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy
from dist_ckpt.errors import CheckpointingException, ChecksumMismatchError, CorruptCheckpointError, UnsafeLinkError
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.storage.location import resolve_location

ENGINES = {
    "zarr-python": (ZarrSaveShardedStrategy, ZarrLoadShardedStrategy),
    "tensorstore": (TensorStoreSaveShardedStrategy, TensorStoreLoadShardedStrategy),
}


def _state():
    full = torch.arange(48.0).reshape(8, 6)
    return full, {
        "w": ShardedTensor.from_rank_offsets("w", full),
        "h": ShardedTensor.from_rank_offsets("h", torch.arange(16, dtype=torch.int16).to(torch.bfloat16)),
        "s": ShardedTensor.from_rank_offsets("s", torch.tensor(3.5)),
    }


def _request():
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6)),
        "h": ShardedTensor.from_rank_offsets("h", torch.zeros(16, dtype=torch.bfloat16)),
        "s": ShardedTensor.from_rank_offsets("s", torch.tensor(0.0)),
    }


@pytest.fixture
def no_array_library_reads(monkeypatch):
    """Loads fail if zarr-python or TensorStore opens an array: local chunks of plain bytes need neither."""

    def refuse(*args, **kwargs):
        raise AssertionError("an array library was asked to read chunks of plain bytes from local files")

    monkeypatch.setattr(zarr_python_load.zarr, "open_array", refuse)
    monkeypatch.setattr(tensorstore_arrays.ts, "open", refuse)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_directly_written_arrays_are_plain_zarr_v3_that_zarr_python_and_tensorstore_read(engine, tmp_path):
    full, sd = _state()
    saver, _ = ENGINES[engine]
    dc.save(sd, tmp_path, sharded_strategy=saver())
    doc = json.loads((tmp_path / ZARR_DIR / "w" / "zarr.json").read_text())
    assert doc == array_metadata((8, 6), (8, 6), torch.float32, doc["attributes"]["dist_ckpt"])
    assert doc["storage_transformers"] == [] and doc["codecs"] == [
        {"name": "bytes", "configuration": {"endian": "little"}}
    ]
    # zarr-python's own reader, and TensorStore's
    assert np.array_equal(zarr.open_array(str(tmp_path / ZARR_DIR / "w"), mode="r")[:], full.numpy())
    assert zarr.open_array(str(tmp_path / ZARR_DIR / "s"), mode="r")[()] == 3.5
    ts_array = tensorstore_engine.open_ts_array(tmp_path / ZARR_DIR / "h")
    assert np.array_equal(
        ts_array.read().result(), torch.arange(16, dtype=torch.int16).to(torch.bfloat16).view(torch.uint16).numpy()
    )


@pytest.mark.parametrize("saved_by", sorted(ENGINES))
@pytest.mark.parametrize("loaded_by", sorted(ENGINES))
def test_whole_plain_chunks_load_bit_exactly_without_an_array_library(
    saved_by, loaded_by, tmp_path, no_array_library_reads
):
    full, sd = _state()
    dc.save(sd, tmp_path, sharded_strategy=ENGINES[saved_by][0]())
    out = dc.load(_request(), tmp_path, sharded_strategy=ENGINES[loaded_by][1]())
    assert torch.equal(out["w"], full)
    assert torch.equal(out["h"].view(torch.int16), sd["h"].data.view(torch.int16))
    assert out["s"].item() == 3.5


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_partial_chunk_is_read_from_its_file_and_its_part_copied_into_place(engine, tmp_path, no_array_library_reads):
    """Half of the one chunk: the engine's library would read the whole file too (a chunk of plain
    bytes is one file); read here, checked against the manifest, and the half copied."""
    full, sd = _state()
    dc.save(sd, tmp_path, sharded_strategy=ENGINES[engine][0]())
    part = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, 1, 2))}
    out = ENGINES[engine][1]().load(part, resolve_location(tmp_path))
    assert torch.equal(out["w"], full[4:])


def _split(key, full, axis, parts):
    return {
        f"{key}{r}": ShardedTensor.from_rank_offsets(key, c.clone(), (axis, r, parts))
        for r, c in enumerate(full.chunk(parts, axis))
    }


def _empty_split(key, full, axis, parts, dtype=None):
    return _split(key, torch.zeros_like(full, dtype=dtype or full.dtype), axis, parts)


@pytest.mark.parametrize("saved_by", sorted(ENGINES))
@pytest.mark.parametrize("loaded_by", sorted(ENGINES))
@pytest.mark.parametrize("parts", [1, 2, 8])
def test_resharded_loads_read_every_chunk_from_its_file(saved_by, loaded_by, parts, tmp_path, no_array_library_reads):
    """Saved as 4 chunks along each axis, loaded as 1, 2 (several whole chunks per shard, into
    strided destinations along axis 1) and 8 parts (half a chunk each): no array library, bit-exact."""
    rows, cols = torch.arange(96.0).reshape(16, 6), torch.arange(96, dtype=torch.int32).reshape(6, 16)
    half = torch.arange(64, dtype=torch.int16).to(torch.bfloat16).reshape(8, 8)
    dc.save(
        {**_split("rows", rows, 0, 4), **_split("cols", cols, 1, 4), **_split("half", half, 1, 4)},
        tmp_path,
        sharded_strategy=ENGINES[saved_by][0](),
    )
    request = {
        **_empty_split("rows", rows, 0, parts),
        **_empty_split("cols", cols, 1, parts),
        **_empty_split("half", half, 1, parts),
    }
    out = dc.load(request, tmp_path, sharded_strategy=ENGINES[loaded_by][1]())
    for name, full, axis in [("rows", rows, 0), ("cols", cols, 1), ("half", half, 1)]:
        for r, expected in enumerate(full.chunk(parts, axis)):
            got = out[f"{name}{r}"]
            assert got.dtype == full.dtype and torch.equal(got, expected), (name, r)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_chunks_read_from_their_files_convert_to_a_requested_dtype(engine, tmp_path, no_array_library_reads):
    full = torch.arange(48.0).reshape(8, 6)
    dc.save(_split("w", full, 0, 2), tmp_path, sharded_strategy=ENGINES[engine][0]())
    out = dc.load(_empty_split("w", full, 1, 2, torch.float64), tmp_path, sharded_strategy=ENGINES[engine][1]())
    assert torch.equal(out["w0"], full[:, :3].double()) and torch.equal(out["w1"], full[:, 3:].double())


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("request_parts", [1, 4])
def test_a_damaged_chunk_read_for_a_resharded_load_fails_naming_key_and_file(engine, request_parts, tmp_path):
    """Read whole into a buffer (one part of several chunks, or half of one): still checked."""
    full = torch.arange(48.0).reshape(6, 8)
    dc.save(_split("w", full, 1, 2), tmp_path, sharded_strategy=ENGINES[engine][0]())
    chunk = tmp_path / ZARR_DIR / "w" / "c.0.1"
    raw = bytearray(chunk.read_bytes())
    raw[3] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match=r"'w'.*c\.0\.1"):
        dc.load(_empty_split("w", full, 1, request_parts), tmp_path, sharded_strategy=ENGINES[engine][1]())


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_directly_read_chunk_with_other_bytes_fails_its_checksum_naming_key_and_file(engine, tmp_path):
    _, sd = _state()
    dc.save(sd, tmp_path, sharded_strategy=ENGINES[engine][0]())
    chunk = tmp_path / ZARR_DIR / "w" / "c.0.0"
    raw = bytearray(chunk.read_bytes())
    raw[5] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    with pytest.raises(ChecksumMismatchError, match=r"'w'.*c\.0\.0"):
        dc.load(_request(), tmp_path, sharded_strategy=ENGINES[engine][1]())


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_directly_read_chunk_that_is_missing_or_short_is_corrupt(engine, damage, tmp_path):
    _, sd = _state()
    dc.save(sd, tmp_path, sharded_strategy=ENGINES[engine][0]())
    chunk = tmp_path / ZARR_DIR / "w" / "c.0.0"
    if damage == "missing":
        chunk.unlink()
    else:
        chunk.write_bytes(chunk.read_bytes()[:-4])
    loader = ENGINES[engine][1](verify_checksums=False)
    with pytest.raises(CorruptCheckpointError, match=r"'w'"):
        dc.load(_request(), tmp_path, sharded_strategy=loader)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_chunk_is_written_once_an_existing_file_fails_the_save(engine, tmp_path, monkeypatch):
    from dist_ckpt.backends.zarr import local_save

    _, sd = _state()
    real = local_save.write_node_files

    def twice(top, node, window):
        real(top, node, window)
        return real(top, node, window)  # the same files again: refused, never overwritten

    monkeypatch.setattr(local_save, "write_node_files", twice)
    with pytest.raises((CheckpointingException, FileExistsError)):
        dc.save(sd, tmp_path, sharded_strategy=ENGINES[engine][0]())
    assert not (tmp_path / ZARR_DIR).exists()  # nothing published under the checkpoint's names


def test_plain_chunk_bytes_accepts_only_what_can_be_read_straight_into_a_tensor():
    doc = array_metadata((4,), (2,), torch.float32, {})
    assert plain_chunk_bytes(doc, torch.float32)
    assert plain_chunk_bytes(array_metadata((4,), (2,), torch.bfloat16, {}), torch.bfloat16)  # raw bits
    assert plain_chunk_bytes(dict(doc, data_type="int32"), torch.int32) is True  # its own name
    assert not plain_chunk_bytes(doc, torch.float64)  # another width
    assert not plain_chunk_bytes(
        dict(doc, codecs=[{"name": "bytes", "configuration": {"endian": "big"}}]), torch.float32
    )
    gzip = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "gzip", "configuration": {"level": 1}}]
    assert not plain_chunk_bytes(dict(doc, codecs=gzip), torch.float32)
    slashed = {"name": "default", "configuration": {"separator": "/"}}  # checkpoints saved before the "." keys
    assert plain_chunk_bytes(dict(doc, chunk_key_encoding=slashed), torch.float32)
    v2_keys = {"name": "v2", "configuration": {"separator": "."}}
    assert not plain_chunk_bytes(dict(doc, chunk_key_encoding=v2_keys), torch.float32)
    assert not plain_chunk_bytes(dict(doc, storage_transformers=[{"name": "x"}]), torch.float32)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_big_endian_array_of_another_writer_loads_through_the_engine(engine, tmp_path):
    """Chunks in the other byte order are not plain: the engine's library reads and converts them."""
    full, sd = _state()
    dc.save({"w": sd["w"]}, tmp_path, sharded_strategy=ZarrSaveShardedStrategy())
    path = tmp_path / ZARR_DIR / "w"
    attrs = json.loads((path / "zarr.json").read_text())["attributes"]
    for f in sorted(path.rglob("*"), reverse=True):
        f.unlink() if f.is_file() else f.rmdir()
    path.rmdir()
    arr = zarr.create_array(
        str(path),
        shape=(8, 6),
        chunks=(8, 6),
        dtype="float32",
        serializer=zarr.codecs.BytesCodec(endian="big"),
        compressors=None,
        attributes=attrs,
    )
    arr[:] = full.numpy()
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6))}
    out = ENGINES[engine][1](verify_checksums=False).load(request, resolve_location(tmp_path))
    assert torch.equal(out["w"], full)


def test_stored_metadata_marks_plain_arrays(tmp_path):
    from dist_ckpt.backends.zarr.layout import checkpoint_node
    from dist_ckpt.backends.zarr.metadata import open_tensor_info

    _, sd = _state()
    dc.save(sd, tmp_path, sharded_strategy=ZarrSaveShardedStrategy())
    info = open_tensor_info(checkpoint_node(Path(tmp_path), "test") / ZARR_DIR, "w")
    assert info is not None and info.plain_chunks


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_chunk_files_fill_padded_stacked_and_flattened_requests(engine, tmp_path, no_array_library_reads):
    """Parts of chunks into the shapes a resharded load asks for: a shard reaching past the stored
    tensor (``allow_shape_mismatch``: the rest zero), a layer of stacked layers
    (``prepend_axis_num``), and a flattened range (distributed optimizer) of a chunked tensor."""
    full = torch.arange(64.0).reshape(8, 8)
    layers = torch.arange(128.0).reshape(2, 8, 8)
    stacked = {
        f"l{layer}c{c}": ShardedTensor.from_rank_offsets(
            "layers", layers[layer].chunk(2, 1)[c].clone(), (0, layer, 2), (2, c, 2), prepend_axis_num=1
        )
        for layer in range(2)
        for c in range(2)
    }
    dc.save({**_split("w", full, 1, 2), **stacked}, tmp_path, sharded_strategy=ENGINES[engine][0]())
    padded = ShardedTensor("w", torch.full((10, 5), 7.0), torch.float32, (10, 5), (10, 10), (0, 5), None)
    padded.allow_shape_mismatch = True
    request = {
        "padded": padded,
        "layer1": ShardedTensor.from_rank_offsets(
            "layers", torch.zeros(4, 8), (0, 1, 2), (1, 1, 2), prepend_axis_num=1
        ),
        "flat": ShardedTensor.from_rank_offsets_flat("w", torch.zeros(20), (8, 8), flattened_range=slice(10, 30)),
    }
    out = ENGINES[engine][1]().load(request, resolve_location(tmp_path))  # shards of other requests' layouts
    expected_padded = torch.zeros(10, 5)
    expected_padded[:8, :3] = full[:, 5:]
    assert torch.equal(out["padded"], expected_padded)
    assert torch.equal(out["layer1"], layers[1, 4:])
    assert torch.equal(out["flat"], full.flatten()[10:30])


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_resharded_load_without_checksums_reads_chunk_files_unchecked(engine, tmp_path, no_array_library_reads):
    full = torch.arange(48.0).reshape(6, 8)
    dc.save(_split("w", full, 1, 2), tmp_path, sharded_strategy=ENGINES[engine][0]())
    chunk = tmp_path / ZARR_DIR / "w" / "c.0.1"
    raw = bytearray(chunk.read_bytes())
    raw[0:4] = np.float32(-1.0).tobytes()
    chunk.write_bytes(bytes(raw))
    out = dc.load(_empty_split("w", full, 0, 2), tmp_path, sharded_strategy=ENGINES[engine][1](verify_checksums=False))
    assert out["w0"][0, 4] == -1.0 and torch.equal(out["w0"][:, :4], full[:3, :4])


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_chunk_file_linked_out_of_the_checkpoint_is_refused_by_a_resharded_load(engine, tmp_path):
    full = torch.arange(48.0).reshape(6, 8)
    dc.save(_split("w", full, 1, 2), tmp_path / "ckpt", sharded_strategy=ENGINES[engine][0]())
    chunk = tmp_path / "ckpt" / ZARR_DIR / "w" / "c.0.1"
    outside = tmp_path / "outside"
    outside.write_bytes(chunk.read_bytes())
    chunk.unlink()
    chunk.symlink_to(outside)
    loader = ENGINES[engine][1](verify_checksums=False)
    with pytest.raises(UnsafeLinkError, match="c.0.1"):
        dc.load(_empty_split("w", full, 0, 2), tmp_path / "ckpt", sharded_strategy=loader)


def test_tensorstore_chunk_buffers_larger_than_the_staging_cap_are_read_one_at_a_time(tmp_path, no_array_library_reads):
    full = torch.arange(4096.0).reshape(64, 64)
    dc.save(_split("w", full, 1, 4), tmp_path, sharded_strategy=TensorStoreSaveShardedStrategy())
    loader = TensorStoreLoadShardedStrategy(max_staged_bytes=1)  # every chunk buffer exceeds it
    out = dc.load(_empty_split("w", full, 0, 4), tmp_path, sharded_strategy=loader)
    assert all(torch.equal(out[f"w{r}"], full[16 * r : 16 * r + 16]) for r in range(4))
