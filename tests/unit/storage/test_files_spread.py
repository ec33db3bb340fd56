"""spread_subdirectories: ext4's "top of directory hierarchies" hint, set where the file system
takes it and a no-op (False, nothing raised) where it does not."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from dist_ckpt.storage import files


def _lsattr_flags(path) -> str:
    out = subprocess.run(["lsattr", "-d", str(path)], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def test_the_hint_is_set_where_taken_and_reported(tmp_path):
    root = tmp_path / "tree"
    root.mkdir()
    taken = files.spread_subdirectories(root)
    if not taken:
        pytest.skip("this file system does not take the hint")
    if shutil.which("lsattr") is None:
        pytest.skip("no lsattr to read the flag back")
    assert "T" in _lsattr_flags(root)
    assert files.spread_subdirectories(root) is True  # set already: still true, nothing changes
    (root / "a").mkdir()  # directories are still made as usual below it
    assert (root / "a").is_dir()


def test_a_missing_directory_or_a_file_without_the_ioctl_returns_false(tmp_path):
    assert files.spread_subdirectories(tmp_path / "missing") is False


def test_a_file_system_that_refuses_the_ioctl_returns_false(tmp_path, monkeypatch):
    import errno
    import fcntl

    def refuse(fd, request, arg=0):
        raise OSError(errno.ENOTTY, "Inappropriate ioctl for device")

    monkeypatch.setattr(fcntl, "ioctl", refuse)
    assert files.spread_subdirectories(tmp_path) is False


def test_other_platforms_leave_the_directory_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(files.sys, "platform", "darwin")
    assert files.spread_subdirectories(tmp_path) is False
