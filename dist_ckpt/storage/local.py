"""Durable writes on a local (POSIX) file system, and :class:`LocalStorage` built on them.

A file is written under a temporary name in its final directory, flushed and fsynced, then
renamed over its final name, and the directory is fsynced: a crash leaves either no file or the
whole file, never a torn one. The functions (:func:`atomic_write`, :func:`write_bytes_atomic`,
:func:`fsync_file`, :func:`fsync_dir`) are used directly by modules that work on paths;
:class:`LocalStorage` is the same machinery behind the :class:`~dist_ckpt.storage.base.Storage`
interface, so code written against that interface runs unchanged on a disk or on S3.
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from dist_ckpt.storage.base import (
    BufferLike,
    IOCounters,
    ObjectInfo,
    ObjectWriter,
    RangeRead,
    Storage,
    _check_reads,
    as_byte_view,
    split_range,
    validate_object_key,
    validate_prefix,
)
from dist_ckpt.storage.errors import (
    ObjectExistsError,
    ObjectNotFoundError,
    StorageConfigError,
    StorageError,
    TruncatedObjectError,
)
from dist_ckpt.storage.paths import safe_join

__all__ = ["LocalStorage", "LocalStorageOptions", "atomic_write", "fsync_dir", "fsync_file", "write_bytes_atomic"]

Buffer = Union[bytes, bytearray, memoryview]
_IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024))


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


# -- the Storage implementation ---------------------------------------------------------------


def _is_temp_name(name: str) -> bool:
    """Whether ``name`` is an in-progress write of :func:`atomic_write` (never listed)."""
    return name.startswith(".") and ".tmp-" in name


@dataclass(frozen=True)
class LocalStorageOptions:
    """How :class:`LocalStorage` writes and reads.

    Attributes:
        fsync: flush every file and its directory before a write returns (durability across a
            power loss; turn off only for scratch data).
        read_threads: threads serving one ``read_ranges`` call (``os.preadv`` releases the GIL).
        max_read_bytes: ranges larger than this are split so that threads share a big range.
    """

    fsync: bool = True
    read_threads: int = 4
    max_read_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        for name in ("read_threads", "max_read_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise StorageConfigError(f"LocalStorageOptions.{name} must be a positive int, got {value!r}")


class _LocalWriter(ObjectWriter):
    """Streams into a temporary file next to the target; commit = fsync + rename + fsync dir."""

    def __init__(self, storage: "LocalStorage", key: str, path: Path) -> None:
        self._storage = storage
        self._key = key
        self._path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = _temp_name(path)
        self._file: Optional[IO[bytes]] = open(self._tmp, "wb")
        self._written = 0
        self._done = False

    def write(self, data: BufferLike) -> int:
        if self._file is None:
            raise StorageError(
                f"write to {self._storage.url_of(self._key)} after commit/abort",
                url=self._storage.url_of(self._key),
                operation="write",
            )
        view = as_byte_view(data)
        self._file.write(view)
        self._written += len(view)
        return len(view)

    def commit(self) -> None:
        if self._done:
            return
        if self._file is None:
            raise StorageError(
                f"commit of {self._storage.url_of(self._key)} after abort",
                url=self._storage.url_of(self._key),
                operation="commit",
            )
        fsync = self._storage.options.fsync
        try:
            self._file.flush()
            if fsync:
                os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            os.replace(self._tmp, self._path)
        except BaseException:
            self.abort()
            raise
        if fsync:
            fsync_dir(self._path.parent)
        self._done = True
        self._storage._counters.add(bytes_written=self._written, objects_written=1)

    def abort(self) -> None:
        if self._done:
            return
        if self._file is not None:
            self._file.close()
            self._file = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)


class LocalStorage(Storage):
    """Objects as files under a root directory: atomic rename for every write, fsync for durability.

    The root is created on the first write. ``put_if_absent`` writes a temporary file and
    hard-links it into place (``link`` fails if the target exists, so the check and the
    creation are one atomic step and the file is whole when it appears). Reads use
    ``os.preadv`` straight into the caller's buffers from a few threads.

    Example::

        storage = LocalStorage("/ckpt/iter_1000")
        storage.write("a.bin", b"hello")
        out = bytearray(4)
        storage.read_into("a.bin", 1, out)     # out == b"ello"
    """

    atomic_rename = True
    conditional_put = True
    ranged_read = True
    multipart_upload = False
    local_paths = True

    def __init__(
        self,
        root: Union[str, "os.PathLike[str]"],
        options: Optional[LocalStorageOptions] = None,
        *,
        counters: Optional[IOCounters] = None,
    ) -> None:
        super().__init__(counters)
        self.root = Path(root).absolute()
        self.options = options if options is not None else LocalStorageOptions()

    @property
    def url(self) -> str:
        return str(self.root)

    def __reduce__(self) -> Tuple[Any, ...]:
        """Pickle as root and options (the copy counts its own I/O)."""
        return (LocalStorage, (self.root, self.options))

    def local_path(self, key: str) -> Path:
        """The file of object ``key`` (checked to stay under the root).

        For libraries that need a path (TensorStore's ``file`` driver, zarr's LocalStore).

        Example::

            LocalStorage("/ckpt").local_path("zarr/w/zarr.json")   # Path("/ckpt/zarr/w/zarr.json")
        """
        validate_object_key(key)
        return safe_join(self.root, *key.split("/"))

    def _not_found(self, key: str, operation: str, error: OSError) -> ObjectNotFoundError:
        url = self.url_of(key)
        return ObjectNotFoundError(f"{operation} {url}: no such file ({error.strerror})", url=url, operation=operation)

    # -- writing -----------------------------------------------------------------------------

    def write(self, key: str, data: BufferLike) -> None:
        self.write_buffers(key, [data])

    def write_buffers(self, key: str, buffers: Sequence[BufferLike]) -> None:
        path = self.local_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        views = [as_byte_view(b) for b in buffers]
        with atomic_write(path, fsync=self.options.fsync) as f:
            for view in views:
                f.write(view)
        self._counters.add(bytes_written=sum(len(v) for v in views), objects_written=1)

    def open_writer(self, key: str) -> ObjectWriter:
        return _LocalWriter(self, key, self.local_path(key))

    def put_if_absent(self, key: str, data: BufferLike) -> None:
        path = self.local_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        view = as_byte_view(data)
        tmp = _temp_name(path)
        try:
            with open(tmp, "wb") as f:
                f.write(view)
                f.flush()
                if self.options.fsync:
                    os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # atomic create-if-absent of a complete file
            except FileExistsError as e:
                url = self.url_of(key)
                raise ObjectExistsError(
                    f"put_if_absent {url}: the file already exists and was left untouched "
                    "(another save committed here; use a new checkpoint directory)",
                    url=url,
                    operation="put_if_absent",
                ) from e
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if self.options.fsync:
            fsync_dir(path.parent)
        self._counters.add(bytes_written=len(view), objects_written=1)

    # -- reading -----------------------------------------------------------------------------

    def read(self, key: str) -> bytes:
        path = self.local_path(key)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
            raise self._not_found(key, "read", e) from e
        self._counters.add(bytes_read=len(data), read_requests=1)
        return data

    def read_ranges(self, reads: Sequence[RangeRead]) -> None:
        pieces = [p for r in _check_reads(reads) for p in split_range(r, self.options.max_read_bytes) if p.length > 0]
        if not pieces:
            return
        fds: Dict[str, int] = {}
        try:
            for piece in pieces:
                if piece.key not in fds:
                    try:
                        fds[piece.key] = os.open(self.local_path(piece.key), os.O_RDONLY)
                    except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
                        raise self._not_found(piece.key, "read", e) from e
            threads = min(self.options.read_threads, len(pieces))
            if threads == 1:
                for piece in pieces:
                    self._pread(fds[piece.key], piece)
            else:
                with ThreadPoolExecutor(threads, thread_name_prefix="dist_ckpt-read") as pool:
                    futures = [pool.submit(self._pread, fds[p.key], p) for p in pieces]
                    try:
                        for future in futures:
                            future.result()
                    finally:
                        for future in futures:
                            future.cancel()
        finally:
            for fd in fds.values():
                os.close(fd)

    def _pread(self, fd: int, piece: RangeRead) -> None:
        """``preadv`` until the piece is full; a short file is a :class:`TruncatedObjectError`."""
        views = list(piece.buffers)
        offset = piece.offset
        while views:
            n = os.preadv(fd, views[:_IOV_MAX], offset)
            if n == 0:
                url = self.url_of(piece.key)
                raise TruncatedObjectError(
                    f"read {url}: the file ends at byte {offset}, but bytes "
                    f"{piece.offset}..{piece.offset + piece.length} "
                    "were expected (the file was truncated, or the index describing it is wrong)"
                )
            offset += n
            while n > 0:
                if n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][n:]
                    n = 0
        self._counters.add(bytes_read=piece.length, read_requests=1)

    # -- metadata ----------------------------------------------------------------------------

    def size(self, key: str) -> int:
        self._counters.add(metadata_requests=1)
        path = self.local_path(key)
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError) as e:
            raise self._not_found(key, "size", e) from e
        if not stat.S_ISREG(st.st_mode):
            raise ObjectNotFoundError(
                f"size {self.url_of(key)}: not a regular file", url=self.url_of(key), operation="size"
            )
        return st.st_size

    def exists(self, key: str) -> bool:
        self._counters.add(metadata_requests=1)
        return self.local_path(key).is_file()

    def list(self, prefix: str = "") -> List[ObjectInfo]:
        validate_prefix(prefix)
        self._counters.add(metadata_requests=1)
        base = self.local_path(prefix) if prefix else self.root
        found: List[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not _is_temp_name(d)]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if _is_temp_name(name):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                with contextlib.suppress(FileNotFoundError):  # deleted while we walked
                    found.append(ObjectInfo(key, os.stat(os.path.join(dirpath, name)).st_size))
        return sorted(found, key=lambda o: o.key)

    def list_dirs(self, prefix: str = "") -> List[str]:
        validate_prefix(prefix)
        self._counters.add(metadata_requests=1)
        base = self.local_path(prefix) if prefix else self.root
        try:
            with os.scandir(base) as it:
                return sorted(e.name for e in it if e.is_dir(follow_symlinks=False) and not _is_temp_name(e.name))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, key: str) -> None:
        self._counters.add(metadata_requests=1)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.local_path(key))

    def delete_prefix(self, prefix: str) -> int:
        count = 0
        for info in self.list(prefix):
            self.delete(info.key)
            count += 1
        base = self.local_path(prefix) if prefix else self.root
        # remove the directories the objects lived in (the root itself stays)
        for dirpath, _dirnames, _filenames in sorted(os.walk(base), key=lambda w: -len(w[0])):
            if Path(dirpath) != self.root:
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)
        if self.options.fsync and count and self.root.is_dir():
            fsync_dir(self.root)
        return count

    def child(self, prefix: str) -> "LocalStorage":
        validate_object_key(prefix)
        return LocalStorage(self.root.joinpath(*prefix.split("/")), self.options, counters=self._counters)
