"""drop_from_page_cache: durable files leave the page cache (a checkpoint does not crowd out a
training job's data), best effort."""

from __future__ import annotations

import os

import pytest

from dist_ckpt.storage.files import drop_from_page_cache
from tests.page_cache import drops_clean_pages, resident_pages


def test_durable_files_leave_the_page_cache(tmp_path):
    if not drops_clean_pages(tmp_path):
        pytest.skip("this file system keeps a file's pages (tmpfs) or has no posix_fadvise")
    paths = [tmp_path / f"f{i}" for i in range(3)]
    for i, path in enumerate(paths):
        path.write_bytes(bytes([i]) * (1 << 20))
    os.sync()
    assert all(resident_pages(p) > 0 for p in paths)  # just written: cached
    drop_from_page_cache(paths[:2])
    assert [resident_pages(p) for p in paths[:2]] == [0, 0]
    assert resident_pages(paths[2]) > 0  # only the files named
    assert [p.read_bytes()[:1] for p in paths] == [b"\x00", b"\x01", b"\x02"]


def test_a_file_that_cannot_be_opened_is_skipped_and_the_others_are_dropped(tmp_path):
    """Best effort: the data is on the disk already, so a file that cannot be opened raises
    nothing, and the files after it are still dropped."""
    (tmp_path / "after").write_bytes(b"abc" * 4096)
    os.sync()
    drop_from_page_cache([tmp_path / "missing", tmp_path, tmp_path / "after"])  # a missing file, a directory
    if drops_clean_pages(tmp_path):
        assert resident_pages(tmp_path / "after") == 0
    assert (tmp_path / "after").read_bytes() == b"abc" * 4096
