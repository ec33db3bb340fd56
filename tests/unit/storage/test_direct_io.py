"""direct_io.write_at: the bytes land where they belong whichever way they are written, the
aligned middle bypasses the page cache where the file system allows, and every refusal of
O_DIRECT falls back to the page cache instead of failing."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import Any, Iterator, List, Tuple

import pytest

from dist_ckpt.storage import direct_io
from dist_ckpt.storage.direct_io import DIRECT_IO_ALIGN, accepts_direct_writes, memory_address, open_direct, write_at
from tests.page_cache import resident_pages

SIZE = 3 * (1 << 20) + 777


@pytest.fixture
def aligned() -> Iterator[memoryview]:
    """Page-aligned memory (an anonymous mapping) holding a recognisable pattern."""
    mapped = mmap.mmap(-1, SIZE + 2 * DIRECT_IO_ALIGN)
    pattern = bytes(range(251)) * (len(mapped) // 251 + 1)
    mapped.write(pattern[: len(mapped)])
    yield memoryview(mapped)  # unmapped once collected: a failing test's traceback may still hold slices


def _direct_supported(directory: Path) -> bool:
    probe = directory / ".direct_probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:
        return False
    os.close(fd)
    probe.unlink()
    return hasattr(os, "O_DIRECT")


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    """``tmp_path``, where its file system takes O_DIRECT writes (skipped elsewhere)."""
    if not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    return tmp_path


def _write(path: Path, data: memoryview, offset: int, direct: bool = True) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    direct_fd = open_direct(path) if direct else None
    try:
        written = write_at(fd, direct_fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)
        if direct_fd is not None:
            os.close(direct_fd)
    return written


@pytest.mark.parametrize("shift", [0, 100, DIRECT_IO_ALIGN - 1])
def test_bytes_land_at_the_offset(tmp_path: Path, aligned: memoryview, shift: int) -> None:
    """Memory and file offset congruent (the snapshot's case): the aligned middle goes direct,
    the edges buffered, and the file reads back as the memory, with nothing before the offset
    but zeros."""
    path = tmp_path / "f"
    offset = 5 * DIRECT_IO_ALIGN + shift
    data = aligned[shift : shift + SIZE]
    direct = _write(path, data, offset)
    content = path.read_bytes()
    assert content[:offset] == bytes(offset)
    assert content[offset:] == bytes(data)
    if _direct_supported(tmp_path):
        lead = -offset % DIRECT_IO_ALIGN
        assert direct == (SIZE - lead) // DIRECT_IO_ALIGN * DIRECT_IO_ALIGN


def test_direct_bytes_skip_the_page_cache(direct_dir: Path, aligned: memoryview) -> None:
    path = direct_dir / "f"
    assert _write(path, aligned[:SIZE], 0) > 0
    # at most the unaligned tail's page is cached
    assert resident_pages(path) <= 1


def test_incongruent_memory_is_written_through_the_page_cache(tmp_path: Path, aligned: memoryview) -> None:
    path = tmp_path / "f"
    data = aligned[1 : 1 + SIZE]  # memory one byte past a block, file offset on one
    assert _write(path, data, DIRECT_IO_ALIGN) == 0
    assert path.read_bytes()[DIRECT_IO_ALIGN:] == bytes(data)


def test_no_direct_descriptor_means_the_page_cache(tmp_path: Path, aligned: memoryview) -> None:
    path = tmp_path / "f"
    assert _write(path, aligned[:SIZE], 0, direct=False) == 0
    assert path.read_bytes() == bytes(aligned[:SIZE])


def test_short_data_and_bytes_objects(tmp_path: Path) -> None:
    """Less than a block, or memory of unknown alignment: written whole, correctly."""
    path = tmp_path / "f"
    assert _write(path, memoryview(b"abc"), 10) == 0
    assert path.read_bytes() == bytes(10) + b"abc"
    assert _write(tmp_path / "empty", memoryview(b""), 0) == 0
    assert memory_address(memoryview(b"")) == 0


def test_a_file_system_without_o_direct_opens(tmp_path: Path, aligned: memoryview, monkeypatch: Any) -> None:
    real_open = os.open

    def refusing_open(path: Any, flags: int, *args: Any) -> int:
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    path = tmp_path / "f"
    assert _write(path, aligned[:SIZE], 0) == 0
    assert path.read_bytes() == bytes(aligned[:SIZE])


class _PwriteScript:
    """os.pwrite that misbehaves on the O_DIRECT descriptor as told, and works otherwise."""

    def __init__(self, monkeypatch: Any, behaviour: str) -> None:
        self.real = os.pwrite
        self.behaviour = behaviour
        self.direct_fds: List[int] = []
        self.calls: List[Tuple[int, int]] = []
        real_open = os.open

        def tracking_open(path: Any, flags: int, *args: Any) -> int:
            fd = real_open(path, flags, *args)
            if flags & getattr(os, "O_DIRECT", 0):
                self.direct_fds.append(fd)
            return fd

        monkeypatch.setattr(os, "open", tracking_open)
        monkeypatch.setattr(direct_io.os, "pwrite", self.pwrite)

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        if fd in self.direct_fds:
            self.calls.append((offset, len(data)))
            if self.behaviour == "einval-first":
                raise OSError(errno.EINVAL, "Invalid argument")
            if self.behaviour == "eio-second" and len(self.calls) == 2:
                raise OSError(errno.EIO, "Input/output error")
            if self.behaviour == "short" and len(self.calls) == 1:
                return int(self.real(fd, memoryview(data)[:DIRECT_IO_ALIGN], offset))
        return int(self.real(fd, data, offset))


@pytest.mark.parametrize("behaviour, direct_bytes", [("einval-first", 0), ("short", DIRECT_IO_ALIGN)])
def test_a_refused_or_short_direct_write_is_finished_through_the_page_cache(
    direct_dir: Path, aligned: memoryview, monkeypatch: Any, behaviour: str, direct_bytes: int
) -> None:
    """A file system that takes O_DIRECT opens but refuses the writes (EINVAL on the first), or a
    short direct write: the rest goes through the page cache, and the file is complete."""
    script = _PwriteScript(monkeypatch, behaviour)
    path = direct_dir / "f"
    assert _write(path, aligned[:SIZE], 0) == direct_bytes
    assert len(script.calls) == 1
    assert path.read_bytes() == bytes(aligned[:SIZE])


def test_a_failing_disk_is_reported_not_hidden(direct_dir: Path, aligned: memoryview, monkeypatch: Any) -> None:
    script = _PwriteScript(monkeypatch, "eio-second")
    monkeypatch.setattr(direct_io, "_DIRECT_WRITE_BYTES", 1 << 20)
    with pytest.raises(OSError) as raised:
        _write(direct_dir / "f", aligned[:SIZE], 0)
    assert raised.value.errno == errno.EIO
    assert len(script.calls) == 2


def test_accepts_direct_writes(tmp_path: Path, monkeypatch: Any) -> None:
    if not hasattr(os, "O_DIRECT"):
        assert not accepts_direct_writes(tmp_path)
        return
    monkeypatch.setattr(direct_io, "_DIRECT_BY_DEVICE", {})
    accepts_direct_writes(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the probe leaves nothing behind
    real_open = os.open

    def refusing(path: Any, flags: int, *args: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing)
    assert accepts_direct_writes(tmp_path) == direct_io._DIRECT_BY_DEVICE[tmp_path.stat().st_dev]  # probed once
    monkeypatch.setattr(direct_io, "_DIRECT_BY_DEVICE", {})
    assert not accepts_direct_writes(tmp_path)
