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


def test_a_file_that_cannot_be_opened_is_left_alone(tmp_path):
    (tmp_path / "kept").write_bytes(b"abc")
    drop_from_page_cache([tmp_path / "missing", tmp_path / "kept"])  # no error: the data is on the disk already
    assert (tmp_path / "kept").read_bytes() == b"abc"
