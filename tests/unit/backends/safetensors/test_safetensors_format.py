"""Unit tests of the safetensors file format module and the read engine (pure functions, files)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_ckpt.backends.safetensors.format import (
    DATA_ALIGN,
    StagingBuffer,
    encode_header,
    read_header_at,
    storage_layout,
    write_safetensors_file,
)
from dist_ckpt.backends.safetensors.io import (
    BounceRead,
    DirectRead,
    ReadOptions,
    contiguous_runs,
    plan_copy,
    read_bytes,
    read_into,
    src_span,
)
from dist_ckpt.backends.safetensors.read_threads import execute
from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError
from dist_ckpt.model.geometry import Box
from dist_ckpt.storage.files import SequentialWriter

# --------------------------------------------------------------------------- headers


def test_encode_header_layout():
    prefix, ranges = encode_header([("a", "F32", (2, 3), 24), ("b", "BF16", (), 2)], {"k": "v"})
    (length,) = struct.unpack("<Q", prefix[:8])
    assert len(prefix) == 8 + length and len(prefix) % DATA_ALIGN == 0
    doc = json.loads(prefix[8:])
    assert doc["__metadata__"] == {"k": "v"}
    assert doc["a"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    assert doc["b"]["data_offsets"] == [24, 26]
    assert ranges == [(len(prefix), len(prefix) + 24), (len(prefix) + 24, len(prefix) + 26)]


def test_duplicate_names_are_refused():
    with pytest.raises(CheckpointingException, match="twice"):
        encode_header([("a", "F32", (1,), 4), ("a", "F32", (1,), 4)])


def test_storage_layout():
    assert storage_layout(torch.bfloat16, (2, 3)) == ("BF16", (2, 3))
    assert storage_layout(torch.float8_e4m3fn, (4,)) == ("F8_E4M3", (4,))
    assert storage_layout(torch.complex128, (2,)) == ("F64", (2, 2))


def test_written_file_is_read_by_safetensors_and_by_us(tmp_path):
    tensors = [
        ("w", torch.randn(3, 4)),
        ("b", torch.arange(5, dtype=torch.int64)),
        ("s", torch.tensor(2.5, dtype=torch.bfloat16)),
        ("e", torch.zeros(0, 2)),
    ]
    size, ranges = write_safetensors_file(tmp_path / "m.safetensors", tensors, {"format": "pt"})
    assert size == os.path.getsize(tmp_path / "m.safetensors")
    loaded = load_file(str(tmp_path / "m.safetensors"))
    for name, t in tensors:
        assert torch.equal(loaded[name], t)
    header = read_header_at(tmp_path / "m.safetensors")
    assert header.metadata == {"format": "pt"} and header.file_size == size
    assert [(header.entries[n].begin, header.entries[n].end) for n, _ in tensors] == ranges
    assert header.entries["w"].dtype == torch.float32 and header.entries["w"].shape == (3, 4)


def test_we_read_what_safetensors_writes(tmp_path):
    tensors = {"x": torch.randn(7, 3).to(torch.float16), "y": torch.ones(2, dtype=torch.uint8)}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"a": "b"})
    header = read_header_at(tmp_path / "ref.safetensors")
    assert header.metadata == {"a": "b"} and set(header.entries) == {"x", "y"}
    entry = header.entries["x"]
    fd = os.open(tmp_path / "ref.safetensors", os.O_RDONLY)
    try:
        raw = read_bytes(fd, entry.end - entry.begin, entry.begin)
    finally:
        os.close(fd)
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float16).reshape(7, 3), tensors["x"])


def test_atomic_write_leaves_no_temporary_file(tmp_path):
    write_safetensors_file(tmp_path / "a.safetensors", [("t", torch.ones(3))], atomic=True)
    write_safetensors_file(tmp_path / "a.safetensors", [("t", torch.zeros(3))], atomic=True)  # replaces
    assert os.listdir(tmp_path) == ["a.safetensors"]
    assert torch.equal(load_file(str(tmp_path / "a.safetensors"))["t"], torch.zeros(3))
    with pytest.raises(FileExistsError):  # non-atomic writes never overwrite
        write_safetensors_file(tmp_path / "a.safetensors", [("t", torch.ones(3))])


def test_non_contiguous_tensor_is_written_by_value(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    write_safetensors_file(tmp_path / "t.safetensors", [("t", base.t())])
    assert torch.equal(load_file(str(tmp_path / "t.safetensors"))["t"], base.t())


def test_staging_buffer_writes_in_pieces(tmp_path):
    """The GPU branch's piecewise copy through a small reused host buffer, run on a CPU tensor
    (the copy loop does not depend on the device; no GPU here)."""
    values = torch.arange(25, dtype=torch.int16).reshape(5, 5).t()  # non-contiguous as well
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        writer = SequentialWriter(fd)
        staging = StagingBuffer(7)  # 7 bytes: pieces that split elements
        staging.write_device_tensor(writer, values)
        staging.write_device_tensor(writer, values[:1])  # the buffer is reused
        writer.finish()
    finally:
        os.close(fd)
    expected = values.contiguous().numpy().tobytes() + values[:1].contiguous().numpy().tobytes()
    assert (tmp_path / "f").read_bytes() == expected


def _file_with_header(path: Path, header: object, data: bytes = b"", length: int = -1) -> Path:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(raw) if length < 0 else length) + raw + data)
    return path


@pytest.mark.parametrize(
    "header,data,length,message",
    [
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, -1, "truncated"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12, -1, "trailing garbage"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4, -1, "needs 8"),
        ({"t": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, -1, "unsupported dtype"),
        ({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, -1, "'shape'"),
        ({"t": {"dtype": "F32", "shape": [2], "data_offsets": [4]}}, b"\0" * 8, -1, "'data_offsets'"),
        ({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, -1, "gap or overlap"),
        ({"t": [1, 2]}, b"", -1, "must be an object"),
        ({"__metadata__": {"a": 1}}, b"", -1, "__metadata__"),
        ([1, 2], b"", -1, "JSON object"),
        (b"{not json", b"", -1, "not valid JSON"),
        ({}, b"", 10**6, "claims"),
    ],
)
def test_bad_headers(tmp_path, header, data, length, message):
    path = _file_with_header(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(CorruptCheckpointError, match=message) as info:
        read_header_at(path)
    assert str(path) in str(info.value)


def test_tiny_and_missing_files(tmp_path):
    (tmp_path / "tiny").write_bytes(b"\1\2")
    with pytest.raises(CorruptCheckpointError, match="too few"):
        read_header_at(tmp_path / "tiny")
    with pytest.raises(CorruptCheckpointError, match="missing"):
        read_header_at(tmp_path / "absent")


# --------------------------------------------------------------------------- the read engine


def test_contiguous_runs_docstring_example():
    src, dst, run = contiguous_runs(Box((0, 2), (4, 4)), Box((0, 0), (4, 8)), Box((0, 2), (4, 4)))
    assert src.tolist() == [2, 10, 18, 26] and dst.tolist() == [0, 4, 8, 12] and run == 4


@pytest.mark.parametrize(
    "inter,src,dst,runs,length",
    [
        (Box((0, 0), (4, 8)), Box((0, 0), (4, 8)), Box((0, 0), (8, 8)), 1, 32),  # whole rows: one run
        (Box((2, 0), (2, 8)), Box((0, 0), (4, 8)), Box((2, 0), (2, 8)), 1, 16),
        (Box((0, 4), (4, 4)), Box((0, 0), (4, 8)), Box((0, 0), (4, 8)), 4, 4),  # column block
        (Box((1, 0, 2), (2, 3, 2)), Box((0, 0, 0), (4, 3, 4)), Box((1, 0, 2), (2, 3, 2)), 6, 2),
        (Box((), ()), Box((), ()), Box((), ()), 1, 1),  # 0-d
    ],
)
def test_contiguous_runs_cover_the_intersection(inter, src, dst, runs, length):
    s, d, run = contiguous_runs(inter, src, dst)
    assert len(s) == runs and run == length

    # brute force: the element offsets of the runs are exactly those of the intersection
    def offsets(box, holder):
        if not box.shape:
            return [0]
        idx = np.indices(box.shape).reshape(len(box.shape), -1).T + np.array(box.offset) - np.array(holder.offset)
        strides = [int(np.prod(holder.shape[i + 1 :])) for i in range(len(holder.shape))]
        return sorted(int(np.dot(i, strides)) for i in idx)

    assert sorted(int(a + k) for a in s for k in range(run)) == offsets(inter, src)
    assert sorted(int(a + k) for a in d for k in range(run)) == offsets(inter, dst)


def test_src_span():
    assert src_span(Box((1, 2), (2, 3)), Box((0, 0), (4, 8))) == (10, 11)
    assert src_span(Box((0,), (5,)), Box((0,), (5,))) == (0, 5)


def _fd(tmp_path, data: bytes) -> int:
    (tmp_path / "data").write_bytes(data)
    return os.open(tmp_path / "data", os.O_RDONLY)


def test_read_into_fills_several_buffers_and_detects_eof(tmp_path):
    fd = _fd(tmp_path, bytes(range(100)))
    try:
        a, b = bytearray(3), bytearray(5)
        assert read_into(fd, [memoryview(a), memoryview(b)], 10) == 8
        assert bytes(a) == bytes([10, 11, 12]) and bytes(b) == bytes(range(13, 18))
        with pytest.raises(EOFError, match="short"):
            read_into(fd, [memoryview(bytearray(10))], 95)
    finally:
        os.close(fd)


def test_plan_copy_chooses_direct_or_bounce(tmp_path):
    values = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    fd = _fd(tmp_path, values.numpy().tobytes())
    try:
        src = Box((0, 0), (4, 8))
        inter = Box((0, 4), (4, 4))
        dest = torch.zeros(4, 4)
        view = dest.reshape(-1).view(torch.uint8).numpy().data
        direct = plan_copy(fd, tmp_path, "k", src, 0, inter, inter, 0, view, dest, ReadOptions(small_run_bytes=0))
        assert all(isinstance(op, DirectRead) for op in direct) and len(direct) == 4
        execute(direct, ReadOptions())
        assert torch.equal(dest, values[:, 4:])
        dest.zero_()
        bounce = plan_copy(fd, tmp_path, "k", src, 0, inter, inter, 0, view, dest, ReadOptions(small_run_bytes=64))
        assert len(bounce) == 1 and isinstance(bounce[0], BounceRead)
        execute(bounce, ReadOptions(thread_count=1))
        assert torch.equal(dest, values[:, 4:])
        # a destination that cannot be read into directly always bounces
        base = torch.zeros(4, 8)
        assert isinstance(
            plan_copy(fd, tmp_path, "k", src, 0, inter, inter, 0, None, base[:, ::2], ReadOptions())[0], BounceRead
        )
    finally:
        os.close(fd)


def test_large_reads_are_split_for_the_threads(tmp_path):
    values = torch.arange(1000, dtype=torch.int32)
    fd = _fd(tmp_path, values.numpy().tobytes())
    try:
        dest = torch.zeros(1000, dtype=torch.int32)
        view = dest.view(torch.uint8).numpy().data
        box = Box((0,), (1000,))
        ops = plan_copy(fd, tmp_path, "k", box, 0, box, box, 0, view, dest, ReadOptions(max_read_bytes=300))
        assert [op.nbytes for op in ops] == [300] * 13 + [100]
        assert execute(ops, ReadOptions(thread_count=3)) == 4000
        assert torch.equal(dest, values)
    finally:
        os.close(fd)


def test_execute_reports_truncation_with_key_and_file(tmp_path):
    fd = _fd(tmp_path, b"\0" * 10)
    try:
        op = DirectRead(fd, tmp_path / "data", "my.key", 0, (memoryview(bytearray(20)),), 20)
        for threads in (1, 2):
            with pytest.raises(CorruptCheckpointError, match="'my.key'") as info:
                execute([op], ReadOptions(thread_count=threads))
            assert "truncated" in str(info.value) and str(tmp_path / "data") in str(info.value)
    finally:
        os.close(fd)
