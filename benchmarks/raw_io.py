"""The raw disk as the benchmarks measure it: whole files read with large sequential reads and
no library in between (the reference every checkpointing system's load is compared with)."""

from __future__ import annotations

import os
from typing import Union

#: bytes per ``write`` / ``readv`` call of the raw-disk measurements
BLOCK = 64 * 2**20


def read_whole(path: Union[str, "os.PathLike[str]"], buf: bytearray) -> None:
    """Read the file ``path`` from start to end into ``buf`` (reused: `BLOCK` bytes at a time)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.readv(fd, [buf]) > 0:
            pass
    finally:
        os.close(fd)


def write_whole(path: Union[str, "os.PathLike[str]"], nbytes: int, block: memoryview) -> None:
    """Write ``nbytes`` to a new file ``path`` with `BLOCK`-sized writes of ``block``, then fsync it
    (what a checkpoint's data file costs the disk, with no library in between)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[: min(len(block), left)])
        os.fsync(fd)
    finally:
        os.close(fd)
