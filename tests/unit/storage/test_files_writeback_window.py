"""WritebackWindow: a writer of many files drops each from the page cache once more bytes than
the window were handed over after it, and closes every descriptor it took, failures included."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import List

import pytest

from dist_ckpt.storage.files import WritebackWindow
from tests.page_cache import drops_clean_pages, resident_pages

MIB = 1 << 20


def _written(path: Path, nbytes: int) -> int:
    """A descriptor of ``path``, just written with ``nbytes`` and durable (so its pages are clean)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"\x07" * nbytes)
    os.fsync(fd)
    return fd


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_file_leaves_the_page_cache_once_the_window_moved_past_it(tmp_path):
    if not drops_clean_pages(tmp_path):
        pytest.skip("this file system keeps a file's pages (tmpfs) or has no posix_fadvise")
    paths = [tmp_path / f"f{i}" for i in range(3)]
    with WritebackWindow(window_bytes=2 * MIB) as window:
        fds = []
        for path in paths:
            fds.append(_written(path, MIB))
            window.hand_over(fds[-1], MIB)
        # 2 MiB were handed over after f0: dropped and closed; f1 and f2 are still in the window
        assert [resident_pages(p) > 0 for p in paths] == [False, True, True]
        assert [_is_open(fd) for fd in fds] == [False, True, True]
    assert [resident_pages(p) for p in paths] == [0, 0, 0]  # the end of the window drops the rest
    assert not any(_is_open(fd) for fd in fds)
    assert [p.read_bytes() for p in paths] == [b"\x07" * MIB] * 3  # dropped, never lost


def test_a_file_larger_than_the_window_is_dropped_when_the_next_one_comes(tmp_path):
    with WritebackWindow(window_bytes=MIB) as window:
        first, second = _written(tmp_path / "a", 4 * MIB), _written(tmp_path / "b", MIB)
        window.hand_over(first, 4 * MIB)
        assert _is_open(first)  # alone in the window: kept until a later file moves it past
        window.hand_over(second, MIB)
        assert not _is_open(first) and _is_open(second)
    assert not _is_open(second)


def test_threads_share_a_window_and_every_descriptor_is_closed(tmp_path):
    handed: List[int] = []
    lock = threading.Lock()
    window = WritebackWindow(window_bytes=64 * 1024)

    def writer(n: int) -> None:
        for i in range(25):
            fd = _written(tmp_path / f"t{n}-{i}", 4096 * (1 + i % 5))
            with lock:
                handed.append(fd)
            window.hand_over(fd, 4096 * (1 + i % 5))

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    window.close()
    assert len(handed) == 100 and not any(_is_open(fd) for fd in handed)
    assert len(list(tmp_path.iterdir())) == 100


def test_a_failure_inside_the_window_still_closes_what_it_holds(tmp_path):
    fd = _written(tmp_path / "f", MIB)
    with pytest.raises(RuntimeError, match="the write failed"):
        with WritebackWindow(window_bytes=8 * MIB) as window:
            window.hand_over(fd, MIB)
            raise RuntimeError("the write failed")
    assert not _is_open(fd)


def test_a_failed_close_is_raised_by_the_end_of_the_window(tmp_path, monkeypatch):
    """On a network file system close() is where a failed write is reported: the window closes
    every file it holds, then raises the first such error (never lost in a later file's write)."""
    import errno

    fds = [_written(tmp_path / f"f{i}", MIB) for i in range(3)]
    real_close = os.close

    def failing_close(fd: int) -> None:
        real_close(fd)
        if fd == fds[0]:
            raise OSError(errno.EIO, "Input/output error")

    window = WritebackWindow(window_bytes=MIB)
    monkeypatch.setattr(os, "close", failing_close)
    for fd in fds:
        window.hand_over(fd, MIB)  # the first is closed here: its error waits for close()
    with pytest.raises(OSError, match="Input/output error"):
        window.close()
    monkeypatch.undo()
    assert not any(_is_open(fd) for fd in fds)


def test_a_failure_under_way_is_not_replaced_by_a_failed_close(tmp_path, monkeypatch):
    import errno

    fd = _written(tmp_path / "f", MIB)
    real_close = os.close

    def failing_close(n: int) -> None:
        real_close(n)
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(RuntimeError, match="the write failed"):
        with WritebackWindow() as window:
            window.hand_over(fd, MIB)
            monkeypatch.setattr(os, "close", failing_close)
            raise RuntimeError("the write failed")
    monkeypatch.undo()
    assert not _is_open(fd)
