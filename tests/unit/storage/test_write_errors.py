"""Failed local writes are StorageErrors (issue 39 item 4): each names the file, the bytes it
wanted and why, keeps the ``errno`` of the ``OSError`` it replaces (its cause), and leaves no
temporary file behind. ``/dev/full`` and a patched ``os.fsync`` stand in for a full disk."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from dist_ckpt.errors import CorruptCheckpointError
from dist_ckpt.storage import LocalStorage, StorageError
from dist_ckpt.storage.errors import RetriesExhaustedError, storage_error_in, write_failed
from dist_ckpt.storage.files import SequentialWriter, atomic_write, write_bytes_atomic


def _full_disk(*args: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux), whose writes fail with ENOSPC")
def test_a_sequential_write_that_finds_the_disk_full():
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        writer = SequentialWriter(fd, start=4096, url="/ckpt/rank0.safetensors")
        with pytest.raises(StorageError) as caught:
            writer.write(memoryview(bytes(1000)))
    finally:
        os.close(fd)
    error = caught.value
    assert error.errno == errno.ENOSPC and isinstance(error.__cause__, OSError)
    assert error.url == "/ckpt/rank0.safetensors" and error.wanted_bytes == 1000
    assert "1000 bytes at byte 4096 to /ckpt/rank0.safetensors" in str(error)
    assert "the file system is full" in str(error)


def test_a_storage_write_whose_flush_fails_leaves_nothing(tmp_path, monkeypatch):
    storage = LocalStorage(tmp_path)
    monkeypatch.setattr(os, "fsync", _full_disk)
    with pytest.raises(StorageError, match=r"write of 5 bytes to .*a\.bin failed: No space left on device") as caught:
        storage.write("a.bin", b"hello")
    assert caught.value.errno == errno.ENOSPC
    with pytest.raises(StorageError, match=r"commit of 3 bytes to .*b\.bin failed") as caught:
        with storage.open_writer("b.bin") as writer:
            writer.write(b"abc")
    with pytest.raises(StorageError, match=r"write of 2 bytes to .*c\.json failed"):
        storage.put_if_absent("c.json", b"{}")
    with pytest.raises(StorageError, match=r"write of 2 bytes to .*d\.json failed"):
        write_bytes_atomic(tmp_path / "d.json", b"{}")
    assert sorted(os.listdir(tmp_path)) == []  # no temporary file is left


def test_a_torch_save_whose_file_fills_up_is_a_storage_error(tmp_path):
    """``torch.save`` turns the ``OSError`` of its file into a ``RuntimeError`` (as below); the
    write that failed is still told as a StorageError naming the file and the bytes handed to it."""
    with pytest.raises(
        StorageError, match=r"write of 4 bytes to .*common\.pt failed: No space left on device"
    ) as caught:
        with atomic_write(tmp_path / "common.pt") as f:
            f.write(b"PK\x03\x04")
            f.flush()
            try:
                _full_disk()
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert caught.value.errno == errno.ENOSPC and isinstance(caught.value.__cause__, RuntimeError)
    assert os.listdir(tmp_path) == []
    with pytest.raises(KeyError):  # not a write: passes unchanged
        with atomic_write(tmp_path / "other.pt"):
            raise KeyError("x")


def test_storage_error_in_finds_the_write_under_other_errors():
    raw = OSError(errno.ENOSPC, "No space left on device", "/ckpt/__0_0.distcp")
    wrapped = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    wrapped.__context__ = raw
    found = storage_error_in(wrapped)
    assert isinstance(found, StorageError) and found.errno == errno.ENOSPC
    assert "/ckpt/__0_0.distcp" in str(found)
    assert storage_error_in(wrapped, "the files of rank 3", 64).wanted_bytes == 64

    storage = write_failed(raw, "/ckpt/a", 8)
    outer = RuntimeError("through a library")
    outer.__cause__ = storage
    copy = storage_error_in(outer)
    assert copy is not storage and str(copy) == str(storage) and copy.errno == errno.ENOSPC  # raisable from outer
    assert storage_error_in(storage) is storage
    corrupt = CorruptCheckpointError("a problem of its own")
    corrupt.__cause__ = raw
    assert storage_error_in(corrupt) is None
    assert storage_error_in(ValueError("no write")) is None


def test_at_rank_names_the_rank_once():
    error = write_failed(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), "/ckpt/a", 8)
    located = error.at_rank(3)
    assert str(located).startswith("[rank 3] write of 8 bytes to /ckpt/a failed")
    assert "quota" in str(located) and located.errno == errno.EDQUOT and located.wanted_bytes == 8
    assert located.at_rank(3) is located
    retries = RetriesExhaustedError("PUT s3://b/k: gave up", url="s3://b/k", operation="PUT", attempts=5)
    assert str(retries.at_rank(1)) == "[rank 1] PUT s3://b/k: gave up"


def test_a_message_without_an_errno(tmp_path: Path):
    error = write_failed(OSError("short write"), str(tmp_path / "x"))
    assert str(error) == f"write of data to {tmp_path / 'x'} failed: short write" and error.errno is None
