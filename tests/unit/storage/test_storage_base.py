"""Pure functions of the storage interface: keys, buffer views, range splitting and merging, counters."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from dist_ckpt.errors import InvalidKeyError
from dist_ckpt.storage import RangeRead, StorageConfigError, validate_object_key
from dist_ckpt.storage.paths import validate_prefix
from dist_ckpt.storage.ranges import as_byte_view, coalesce_ranges, split_range
from dist_ckpt.storage.stats import IOCounters


def _lengths(reads: list) -> list:
    return [[len(b) for b in r.buffers] for r in reads]


def test_validate_object_key() -> None:
    for good in ("a", "a/b.c", "safetensors/rank00000_0.safetensors", "x~1", "%2F", "unicodé"):
        assert validate_object_key(good) == good
    for bad in ("", "/a", "a/", "a//b", "./a", "a/..", "a\\b", "a\nb", "x" * 256, "/".join(["abc"] * 300)):
        with pytest.raises(InvalidKeyError):
            validate_object_key(bad)
    assert validate_prefix("") == ""
    with pytest.raises(InvalidKeyError):
        validate_prefix("../x")


def test_as_byte_view_flattens_without_copy_and_refuses_bad_buffers() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    view = as_byte_view(memoryview(t.numpy()), writable=True)
    assert view.format == "B" and view.ndim == 1 and len(view) == 24
    view[0:4] = np.float32(42).tobytes()
    assert t[0, 0].item() == 42.0  # same memory
    with pytest.raises(StorageConfigError, match="contiguous"):
        as_byte_view(memoryview(t.numpy().T))
    with pytest.raises(StorageConfigError, match="writable"):
        as_byte_view(b"read-only", writable=True)


def test_range_read_checks_its_fields() -> None:
    with pytest.raises(StorageConfigError, match="offset"):
        RangeRead.into("k", -1, bytearray(1))
    with pytest.raises(InvalidKeyError):
        RangeRead.into("../k", 0, bytearray(1))
    assert RangeRead.into("k", 3, bytearray(2), bytearray(5)).length == 7


def test_split_range_keeps_order_and_views() -> None:
    a, b = bytearray(7), bytearray(5)
    pieces = split_range(RangeRead.into("k", 100, a, b), 4)
    assert [(p.offset, p.length) for p in pieces] == [(100, 4), (104, 4), (108, 4)]
    assert _lengths(pieces) == [[4], [3, 1], [4]]
    for i, p in enumerate(pieces):  # the pieces are views of the caller's buffers
        for buf in p.buffers:
            buf[:] = bytes([i + 1]) * len(buf)
    assert bytes(a) == b"\x01" * 4 + b"\x02" * 3 and bytes(b) == b"\x02" + b"\x03" * 4
    assert split_range(RangeRead.into("k", 0, bytearray(3)), 4)[0].length == 3
    with pytest.raises(StorageConfigError):
        split_range(RangeRead.into("k", 0, bytearray(3)), 0)


def test_coalesce_merges_neighbours_only() -> None:
    bufs = [bytearray(10) for _ in range(5)]
    reads = [
        RangeRead.into("k", 10, bufs[1]),  # out of order on purpose
        RangeRead.into("k", 0, bufs[0]),  # adjacent to the first: merged
        RangeRead.into("k", 25, bufs[2]),  # 5-byte gap: merged only with max_gap >= 5
        RangeRead.into("k", 30, bufs[3]),  # overlaps the previous: never merged
        RangeRead.into("other", 35, bufs[4]),  # another object
    ]
    exact = coalesce_ranges(reads, max_bytes=1000)
    assert [(r.key, r.offset, r.length) for r in exact] == [
        ("k", 0, 20),
        ("k", 25, 10),
        ("k", 30, 10),
        ("other", 35, 10),
    ]
    gapped = coalesce_ranges(reads, max_bytes=1000, max_gap=5)
    assert [(r.key, r.offset, r.length) for r in gapped] == [("k", 0, 35), ("k", 30, 10), ("other", 35, 10)]
    assert _lengths(gapped)[0] == [10, 10, 5, 10]  # the gap lands in a throwaway buffer
    capped = coalesce_ranges(reads, max_bytes=15)
    assert [(r.offset, r.length) for r in capped if r.key == "k"][:2] == [(0, 10), (10, 10)]
    assert coalesce_ranges([RangeRead.into("k", 0, bytearray(0))], 10) == []


def test_io_counters_are_thread_safe() -> None:
    counters = IOCounters()

    def work() -> None:
        for _ in range(1000):
            counters.add(bytes_read=3, read_requests=1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = counters.snapshot()
    assert (stats.bytes_read, stats.read_requests) == (12000, 4000)
    counters.reset()
    assert counters.snapshot().bytes_read == 0
