"""fsync_tree: one syncfs per file system where Linux has it, else an fsync per file and directory."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest

from dist_ckpt.storage import files


def _tree(tmp_path):
    top = tmp_path / "zarr"
    paths = []
    for name in ("a/c/0/0", "a/zarr.json", "b/c/1", "zarr.json"):
        p = top / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
        paths.append(p)
    return top, paths


def _count_fsyncs(monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    return calls


def test_one_syncfs_and_no_fsync_where_syncfs_exists(tmp_path, monkeypatch):
    if files._syncfs() is None:
        pytest.skip("no syncfs here")
    top, paths = _tree(tmp_path)
    synced = []
    real = files._syncfs()
    monkeypatch.setattr(files, "_syncfs", lambda: lambda fd: (synced.append(fd), real(fd))[1])
    fsyncs = _count_fsyncs(monkeypatch)
    files.fsync_tree(paths, top)
    assert len(synced) == 1 and fsyncs == []


def test_without_syncfs_every_file_and_directory_is_fsynced(tmp_path, monkeypatch):
    top, paths = _tree(tmp_path)
    monkeypatch.setattr(files, "_syncfs", lambda: None)
    fsyncs = _count_fsyncs(monkeypatch)
    files.fsync_tree(paths, top)
    # 4 files; directories a/c/0, a/c, a, b/c, b and top
    assert len(fsyncs) == 4 + 6


def test_a_failed_syncfs_raises_naming_the_path(tmp_path, monkeypatch):
    def failing(fd):
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(files, "_syncfs", lambda: failing)
    with pytest.raises(OSError, match="syncfs") as info:
        files.sync_filesystem(tmp_path)
    assert info.value.errno == errno.EIO and str(tmp_path) in str(info.value)


def test_syncfs_missing_in_the_kernel_falls_back_to_fsync(tmp_path, monkeypatch):
    def missing(fd):
        ctypes.set_errno(errno.ENOSYS)
        return -1

    top, paths = _tree(tmp_path)
    monkeypatch.setattr(files, "_syncfs", lambda: missing)
    fsyncs = _count_fsyncs(monkeypatch)
    files.fsync_tree(paths, top)
    assert len(fsyncs) == 10
