"""Durable writes on a local (POSIX) file system.

A file is written under a temporary name in its final directory, flushed and fsynced, then
renamed over its final name, and the directory is fsynced: a crash leaves either no file or the
whole file, never a torn one.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import IO, Iterator, Union

Buffer = Union[bytes, bytearray, memoryview]


def fsync_file(path: Union[str, Path]) -> None:
    """Flush a file's data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Union[str, Path]) -> None:
    """Flush a directory entry table (makes creations and renames in it durable)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_write(path: Union[str, Path], *, fsync: bool = True) -> Iterator[IO[bytes]]:
    """Open ``path`` for binary writing so that it appears whole or not at all.

    Example::

        with atomic_write(ckpt / "common.pt") as f:
            torch.save(obj, f)
    """
    final = Path(path)
    tmp = _temp_name(final)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(final.parent)


def write_bytes_atomic(path: Union[str, Path], data: Buffer, *, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write`)."""
    with atomic_write(path, fsync=fsync) as f:
        f.write(data)
