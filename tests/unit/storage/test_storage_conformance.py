"""One conformance suite for every Storage implementation (zarr-python's StoreTests idea).

``StorageConformance`` holds the contract; each implementation gets a subclass that provides
the ``storage`` fixture: a local directory, and a prefix on a real S3 API server (moto, started
by the ``s3_server`` fixture in ``tests/conftest.py``).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch

from dist_ckpt.errors import InvalidKeyError
from dist_ckpt.storage import (
    LocalStorage,
    ObjectExistsError,
    ObjectNotFoundError,
    RangeRead,
    Storage,
    TruncatedObjectError,
    encode_key,
    open_storage,
)
from dist_ckpt.storage.local import LocalStorageOptions
from dist_ckpt.storage.s3 import S3StorageOptions

MiB = 2**20


def _payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


class StorageConformance:
    """The Storage contract. Subclasses define the ``storage`` fixture."""

    # -- whole objects ----------------------------------------------------------------------

    def test_write_read_roundtrip_and_overwrite(self, storage: Storage) -> None:
        storage.write("a/b/obj.bin", b"first version")
        assert storage.read("a/b/obj.bin") == b"first version"
        storage.write("a/b/obj.bin", b"v2")
        assert storage.read("a/b/obj.bin") == b"v2"
        assert storage.size("a/b/obj.bin") == 2

    def test_write_buffers_from_tensor_memory(self, storage: Storage) -> None:
        t = torch.arange(1000, dtype=torch.float32)
        arr = np.arange(10, dtype=np.int64)
        header = b"HDR"
        storage.write_buffers("mixed.bin", [header, bytearray(b"xy"), memoryview(t.numpy()), memoryview(arr)])
        expected = header + b"xy" + t.numpy().tobytes() + arr.tobytes()
        assert storage.read("mixed.bin") == expected
        assert storage.size("mixed.bin") == len(expected)

    def test_empty_object(self, storage: Storage) -> None:
        storage.write("empty", b"")
        assert storage.exists("empty")
        assert storage.size("empty") == 0
        assert storage.read("empty") == b""

    def test_missing_object_errors(self, storage: Storage) -> None:
        with pytest.raises(ObjectNotFoundError, match="nope.bin") as info:
            storage.read("nope.bin")
        assert isinstance(info.value, FileNotFoundError)
        with pytest.raises(ObjectNotFoundError):
            storage.size("nope.bin")
        with pytest.raises(ObjectNotFoundError):
            storage.read_into("nope.bin", 0, bytearray(1))
        assert not storage.exists("nope.bin")

    # -- ranged reads -----------------------------------------------------------------------

    def test_ranged_reads_into_caller_buffers(self, storage: Storage) -> None:
        data = _payload(100_000, seed=1)
        storage.write("r.bin", data)
        out = bytearray(1000)
        storage.read_into("r.bin", 12_345, out)
        assert bytes(out) == data[12_345:13_345]
        # a tensor's own memory as destination, scattered over two pieces (like preadv)
        dst = torch.zeros(2, 100, dtype=torch.uint8)
        rows = dst.numpy()
        storage.read_ranges([RangeRead.into("r.bin", 500, memoryview(rows[0]), memoryview(rows[1]))])
        assert dst.flatten().numpy().tobytes() == data[500:700]

    def test_many_concurrent_ranges_over_objects(self, storage: Storage) -> None:
        objects = {f"obj{i}.bin": _payload(50_000 + i, seed=i) for i in range(3)}
        for key, value in objects.items():
            storage.write(key, value)
        rng = np.random.default_rng(7)
        reads, expected = [], []
        for _ in range(60):
            key = f"obj{int(rng.integers(0, 3))}.bin"
            start = int(rng.integers(0, 49_000))
            length = int(rng.integers(0, 1000))
            buf = bytearray(length)
            reads.append(RangeRead.into(key, start, buf))
            expected.append((buf, objects[key][start : start + length]))
        storage.read_ranges(reads)
        for buf, want in expected:
            assert bytes(buf) == want

    def test_adjacent_ranges_and_a_large_range(self, storage: Storage) -> None:
        data = _payload(3 * MiB + 17, seed=3)
        storage.write("big.bin", data)
        whole = bytearray(len(data))
        view = memoryview(whole)
        # adjacent pieces (mergeable) and one range larger than a read chunk
        storage.read_ranges(
            [
                RangeRead.into("big.bin", 0, view[:10]),
                RangeRead.into("big.bin", 10, view[10:100]),
                RangeRead.into("big.bin", 100, view[100:]),
            ]
        )
        assert bytes(whole) == data

    def test_range_past_the_end_is_truncation(self, storage: Storage) -> None:
        storage.write("short.bin", b"0123456789")
        with pytest.raises(TruncatedObjectError, match="short.bin"):
            storage.read_into("short.bin", 5, bytearray(10))  # ends 5 bytes past the end
        with pytest.raises(TruncatedObjectError, match="short.bin"):
            storage.read_into("short.bin", 20, bytearray(1))  # starts past the end

    # -- listing and deleting ----------------------------------------------------------------

    def test_list_is_recursive_sorted_and_prefix_is_a_directory(self, storage: Storage) -> None:
        for key, size in {"ab/x": 1, "a/z": 2, "a/b/y": 3, "top": 4}.items():
            storage.write(key, b"#" * size)
        listed = storage.list()
        assert [(o.key, o.size) for o in listed] == [("a/b/y", 3), ("a/z", 2), ("ab/x", 1), ("top", 4)]
        assert [o.key for o in storage.list("a")] == ["a/b/y", "a/z"]  # not "ab/x"
        assert [o.key for o in storage.list("a/b")] == ["a/b/y"]
        assert storage.list("missing") == []

    def test_list_dirs_is_one_level(self, storage: Storage) -> None:
        for key in (
            "run/iter_2/metadata.json",
            "run/iter_2/safetensors/r0",
            "run/iter_10/common.pt",
            "run/note.txt",
            "runx/a/b",
        ):
            storage.write(key, b"1")
        assert storage.list_dirs("run") == ["iter_10", "iter_2"]  # no files, no deeper levels
        assert storage.list_dirs() == ["run", "runx"]
        assert storage.list_dirs("run/iter_2") == ["safetensors"]
        assert storage.list_dirs("missing") == []
        assert storage.child("run").list_dirs() == ["iter_10", "iter_2"]

    def test_dir_exists_and_make_dir(self, storage: Storage) -> None:
        assert not storage.dir_exists("run") and not storage.dir_exists("run/iter_1")
        storage.write("run/iter_1/metadata.json", b"{}")
        assert storage.dir_exists() and storage.dir_exists("run") and storage.dir_exists("run/iter_1")
        assert not storage.dir_exists("run/iter_1/metadata.json") and not storage.dir_exists("ru")
        storage.make_dir("run/iter_2")  # a directory on a disk; nothing to create on an object store
        assert storage.dir_exists("run/iter_2") is storage.local_paths
        assert storage.child("run").dir_exists("iter_1")

    def test_reader_reads_positionally_into_caller_buffers(self, storage: Storage) -> None:
        data = _payload(3 * MiB + 5, seed=3)
        storage.write("r/obj.bin", data)
        with storage.open_reader("r/obj.bin") as reader:
            assert reader.size() == len(data) and reader.url == storage.url_of("r/obj.bin")
            head, tail = bytearray(10), torch.empty(2 * MiB, dtype=torch.uint8)
            assert reader.read_into([memoryview(head), memoryview(tail.numpy())], 1000) == 10 + 2 * MiB
            assert bytes(head) == data[1000:1010] and tail.numpy().tobytes() == data[1010 : 1010 + 2 * MiB]
            with pytest.raises(TruncatedObjectError, match="obj.bin"):
                reader.read_into([memoryview(bytearray(10))], len(data) - 5)
        missing = None
        with pytest.raises(ObjectNotFoundError, match="absent.bin"):
            missing = storage.open_reader("r/absent.bin")
            missing.size()  # an object store finds out at the first request
        assert missing is None or missing.close() is None

    def test_delete_and_delete_prefix(self, storage: Storage) -> None:
        for key in ("keep/one", "gone/one", "gone/sub/two", "gonex"):
            storage.write(key, b"1")
        storage.delete("keep/one")
        storage.delete("keep/one")  # a missing object is fine
        assert not storage.exists("keep/one")
        assert storage.delete_prefix("gone") == 2
        assert [o.key for o in storage.list()] == ["gonex"]
        assert storage.delete_prefix("") == 1
        assert storage.list() == []

    # -- the commit marker ------------------------------------------------------------------

    def test_put_if_absent_creates_once(self, storage: Storage) -> None:
        storage.put_if_absent("metadata.json", b'{"v": 1}')
        assert storage.read("metadata.json") == b'{"v": 1}'
        with pytest.raises(ObjectExistsError, match="metadata.json") as info:
            storage.put_if_absent("metadata.json", b'{"v": 2}')
        assert isinstance(info.value, FileExistsError)
        assert storage.read("metadata.json") == b'{"v": 1}'  # untouched
        # even over an object written the ordinary way
        storage.write("other", b"x")
        with pytest.raises(ObjectExistsError):
            storage.put_if_absent("other", b"y")

    # -- streaming writer -------------------------------------------------------------------

    def test_streaming_writer_commits_whole_object(self, storage: Storage) -> None:
        buf = bytearray(b"A" * 1000)
        t = torch.arange(256, dtype=torch.int16)
        with storage.open_writer("stream.bin") as w:
            w.write(buf)
            buf[:] = b"B" * 1000  # the writer must not keep a reference to a reused buffer
            w.write(buf)
            w.write(memoryview(t.numpy()))
            assert not storage.exists("stream.bin")  # nothing visible before commit
        assert storage.read("stream.bin") == b"A" * 1000 + b"B" * 1000 + t.numpy().tobytes()

    def test_streaming_writer_aborts_on_error(self, storage: Storage) -> None:
        storage.write("kept.bin", b"old")
        with pytest.raises(RuntimeError, match="producer failed"):
            with storage.open_writer("kept.bin") as w:
                w.write(b"new data that must not land")
                raise RuntimeError("producer failed")
        assert storage.read("kept.bin") == b"old"
        with pytest.raises(RuntimeError):
            with storage.open_writer("never.bin") as w:
                w.write(b"x")
                raise RuntimeError("boom")
        assert [o.key for o in storage.list()] == ["kept.bin"]

    def test_large_object_round_trip(self, storage: Storage) -> None:
        data = _payload(11 * MiB + 3, seed=11)  # > two 5 MiB parts on S3
        storage.write("large/whole.bin", data)
        with storage.open_writer("large/stream.bin") as w:
            for start in range(0, len(data), 3 * MiB):
                w.write(memoryview(data)[start : start + 3 * MiB])
        for key in ("large/whole.bin", "large/stream.bin"):
            assert storage.size(key) == len(data)
            out = bytearray(2 * MiB)
            storage.read_into(key, 4 * MiB, out)
            assert bytes(out) == data[4 * MiB : 6 * MiB]
        assert storage.read("large/stream.bin") == data

    # -- keys, children, counters ------------------------------------------------------------

    def test_encoded_and_unusual_keys_round_trip(self, storage: Storage) -> None:
        keys = [
            encode_key("decoder.layers/0.weight"),
            encode_key("a b+c=d&e?f#g%"),
            "x~1234abcd",
            "sp ace/plus+sign",
            "unicodé/ключ",
        ]
        for key in keys:
            storage.write(key, key.encode())
        assert [o.key for o in storage.list()] == sorted(keys)
        for key in keys:
            assert storage.read(key) == key.encode()
            assert storage.size(key) == len(key.encode())

    @pytest.mark.parametrize("key", ["../escape", "/abs", "a//b", "a/./b", "trailing/", "back\\slash", "", "ctl\x01"])
    def test_invalid_keys_are_refused_before_io(self, storage: Storage, key: str) -> None:
        with pytest.raises(InvalidKeyError):
            storage.write(key, b"x")
        with pytest.raises(InvalidKeyError):
            storage.read(key)

    def test_child_storage_and_shared_counters(self, storage: Storage) -> None:
        child = storage.child("iter_0000010")
        child.write("common.pt", b"abc")
        assert [o.key for o in storage.list()] == ["iter_0000010/common.pt"]
        assert storage.read("iter_0000010/common.pt") == b"abc"
        assert child.url.endswith("iter_0000010")
        before = storage.stats
        out = bytearray(2)
        child.read_into("common.pt", 1, out)
        after = storage.stats
        assert bytes(out) == b"bc"
        assert after.bytes_read - before.bytes_read == 2
        assert after.read_requests - before.read_requests == 1

    def test_stats_count_exact_bytes(self, storage: Storage) -> None:
        storage.write("s.bin", _payload(10_000))
        storage.reset_stats()
        bufs = [bytearray(n) for n in (10, 200, 3000)]
        storage.read_ranges([RangeRead.into("s.bin", off, b) for off, b in zip((0, 5000, 6000), bufs)])
        assert storage.stats.bytes_read == 3210
        assert storage.stats.read_requests == 3
        assert storage.stats.bytes_written == 0

    def test_open_storage_returns_a_storage_as_given(self, storage: Storage) -> None:
        assert open_storage(storage) is storage


class TestLocalStorage(StorageConformance):
    @pytest.fixture
    def storage(self, tmp_path: Any) -> Storage:
        return open_storage(tmp_path / "ckpt", LocalStorageOptions(read_threads=3, max_read_bytes=MiB))

    def test_temporary_files_are_not_listed(self, storage: Storage, tmp_path: Any) -> None:
        storage.write("a/x", b"1")
        assert isinstance(storage, LocalStorage)
        (storage.local_path("a/x").parent / ".y.tmp-123-abcd").write_bytes(b"partial")
        assert [o.key for o in storage.list()] == ["a/x"]

    def test_put_if_absent_leaves_no_temporary_file(self, storage: Storage) -> None:
        assert isinstance(storage, LocalStorage)
        storage.put_if_absent("m", b"1")
        with pytest.raises(ObjectExistsError):
            storage.put_if_absent("m", b"2")
        assert sorted(os.listdir(storage.root)) == ["m"]


class TestS3Storage(StorageConformance):
    @pytest.fixture
    def storage(self, s3_url: str) -> Storage:
        options = S3StorageOptions(
            part_size=5 * MiB,
            max_concurrency=4,
            read_chunk_size=MiB,
            max_retries=3,
            initial_backoff_s=0.01,
            max_backoff_s=0.05,
        )
        return open_storage(s3_url, options)
