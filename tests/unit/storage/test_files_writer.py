"""SequentialWriter: large appending writes, and early writeback that hands what was written to
the disk (posix_fadvise DONTNEED) while later data is still being written."""

from __future__ import annotations

import os
from typing import List, Tuple

import numpy as np
import pytest

from dist_ckpt.storage.files import SequentialWriter


@pytest.mark.parametrize("early", [True, False])
def test_sequential_writer_chunks(tmp_path, early):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        writer = SequentialWriter(fd, early_writeback=early, chunk_bytes=1000)
        data = np.arange(5000, dtype=np.uint8)
        writer.write(data.data)
        writer.write(memoryview(b"xyz"))
        writer.finish()
        assert writer.position == 5003
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == data.tobytes() + b"xyz"


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this platform")
@pytest.mark.parametrize("early", [True, False])
def test_start_writeback_hands_what_was_written_to_the_disk_once(tmp_path, monkeypatch, early):
    """A writer of many small files (each below ``chunk_bytes``) starts writeback per file: the
    bytes written so far, once; nothing without early writeback or when nothing is new."""
    advised: List[Tuple[int, int, int]] = []
    real = os.posix_fadvise

    def record(fd: int, offset: int, length: int, advice: int) -> None:
        advised.append((offset, length, advice))
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        writer = SequentialWriter(fd, early_writeback=early, chunk_bytes=1 << 20)
        writer.write(memoryview(b"x" * 3000))
        assert advised == []  # below chunk_bytes: write() alone does not advise
        writer.start_writeback()
        writer.start_writeback()  # nothing new
    finally:
        os.close(fd)
    assert advised == ([(0, 3000, os.POSIX_FADV_DONTNEED)] if early else [])
    assert (tmp_path / "f").read_bytes() == b"x" * 3000
