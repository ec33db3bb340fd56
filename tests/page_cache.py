"""How much of a file the page cache holds (``mincore(2)`` over a mapping of it), for tests of
code that drops what it wrote from the cache."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import Union


def resident_pages(path: Union[str, Path]) -> int:
    """Pages of ``path`` in the page cache now (Linux; mapping the file reads nothing)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # writable, so ctypes can take its address
    try:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vector = (ctypes.c_ubyte * pages)()
        view = (ctypes.c_char * size).from_buffer(mapped)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(view)), ctypes.c_size_t(size), vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        finally:
            del view
        return sum(v & 1 for v in vector)
    finally:
        mapped.close()


def drops_clean_pages(directory: Union[str, Path]) -> bool:
    """Whether the file system of ``directory`` caches a file written there and drops its pages on
    ``posix_fadvise(DONTNEED)`` once durable (a disk file system does; tmpfs, whose pages are the
    file, does not drop them; one that never caches writes has nothing to drop)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    probe = Path(directory) / ".page_cache_probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, b"x" * (1 << 20))
        os.fsync(fd)
        if resident_pages(probe) == 0:
            return False
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return resident_pages(probe) == 0
    finally:
        os.close(fd)
        probe.unlink()
