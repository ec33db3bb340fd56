"""Objects as files under a root directory: [`LocalStorage`][dist_ckpt.storage.local.LocalStorage], the local Storage.

Every write goes through a temporary file, fsync and rename (`files`), reads through
``os.preadv`` on an open descriptor, and the capabilities only a local disk has are declared
(``local_paths``, ``positional_reads``, ``atomic_rename``), so code written against the
[`Storage`][dist_ckpt.storage.base.Storage] interface runs unchanged on a disk or on S3 and takes
the local fast paths where a capability says it can.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Dict, List, Optional, Sequence, Tuple, Union

from dist_ckpt.storage import files as local_files
from dist_ckpt.storage.base import ObjectInfo, ObjectWriter, Storage
from dist_ckpt.storage.errors import (
    ObjectExistsError,
    ObjectNotFoundError,
    StorageConfigError,
    StorageError,
    write_failed,
)
from dist_ckpt.storage.files import FileReader, fsync_dir, is_temp_name, make_dirs, replace_durably, temp_name
from dist_ckpt.storage.meter import count_bytes
from dist_ckpt.storage.paths import confined, validate_object_key, validate_prefix
from dist_ckpt.storage.ranges import BufferLike, RangeRead, as_byte_view, check_reads, split_range
from dist_ckpt.storage.stats import IOCounters

__all__ = ["LocalStorage", "LocalStorageOptions"]

#: errors of ``link`` on file systems without hard links (some network and FUSE file systems)
_NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK}
# -- the Storage implementation ---------------------------------------------------------------


@dataclass(frozen=True)
class LocalStorageOptions:
    """How [`LocalStorage`][dist_ckpt.storage.local.LocalStorage] writes and reads.

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
        self._tmp = temp_name(path)
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
        try:
            self._file.write(view)
        except OSError as e:
            raise write_failed(e, self._storage.url_of(self._key), len(view), offset=self._written) from e
        self._written += len(view)
        count_bytes(len(view))
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
            if fsync:
                fsync_dir(self._path.parent)
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError) and not isinstance(e, StorageError):
                raise write_failed(e, self._storage.url_of(self._key), self._written, operation="commit") from e
            raise
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

    Symbolic links (the one policy of every local read and write): the root itself may be a link;
    links inside it are followed; a link that leads outside the root -- and outside ``link_roots``,
    the directories it may also lead into -- is refused with
    [`UnsafeLinkError`][dist_ckpt.errors.UnsafeLinkError]. A `child()` keeps its parent's root among its
    link roots, so ``child("safetensors")`` may follow a link elsewhere inside the checkpoint.

    Example:

    ```python
    storage = LocalStorage("/ckpt/iter_1000")
    storage.write("a.bin", b"hello")
    out = bytearray(4)
    storage.read_into("a.bin", 1, out)     # out == b"ello"
    ```
    """

    local_paths = True
    positional_reads = True
    atomic_rename = True
    conditional_put = True
    ranged_read = True
    multipart_upload = False
    s3_compatible = False

    def __init__(
        self,
        root: Union[str, "os.PathLike[str]"],
        options: Optional[LocalStorageOptions] = None,
        *,
        counters: Optional[IOCounters] = None,
        link_roots: Sequence[Union[str, "os.PathLike[str]"]] = (),
    ) -> None:
        super().__init__(counters)
        self.root = Path(root).absolute()
        #: directories besides the root that links may lead into (a HuggingFace cache's blobs)
        self.link_roots: Tuple[Path, ...] = tuple(Path(r).absolute() for r in link_roots)
        # messages and URLs name the directory as it was given (relative paths stay relative)
        given = os.fspath(root)
        self._url = given.rstrip("/") or given or "."
        self.options = options if options is not None else LocalStorageOptions()
        self._dirs: Dict[str, Path] = {}  # resolved directories by key (see local_path)

    @property
    def url(self) -> str:
        return self._url

    def __fspath__(self) -> str:
        """The directory, so that code written for paths (``Path(checkpoint_dir)``) keeps working."""
        return str(self.root)

    def __reduce__(self) -> Tuple[Any, ...]:
        """Pickle as root, options and link roots (the copy counts its own I/O)."""
        return (functools.partial(LocalStorage, link_roots=self.link_roots), (self.root, self.options))

    @property
    def local_dir(self) -> Path:
        return self.root

    def local_path(self, key: str) -> Path:
        """The file of object ``key`` (checked to stay under the root, symlinks resolved; a link
        leading out of the root and the link roots raises [`UnsafeLinkError`][dist_ckpt.errors.UnsafeLinkError]).

        Each directory is resolved (and checked) once, then remembered: resolving a whole path
        costs a system call per component, and the zarr engines ask for a path per chunk file.

        Example:

        ```python
        LocalStorage("/ckpt").local_path("zarr/w/zarr.json")   # Path("/ckpt/zarr/w/zarr.json")
        ```
        """
        validate_object_key(key)
        parent, _, name = key.rpartition("/")
        directory = self._dirs.get(parent)
        if directory is None:
            directory = self._confined(parent.split("/")) if parent else self.root.resolve()
            self._dirs[parent] = directory
        path = directory / name
        if os.path.islink(path):  # a link as the last component: follow it, refusing one that leaves the root
            return self._confined(key.split("/"))
        return path

    def _confined(self, parts: Sequence[str]) -> Path:
        """The real path of ``parts`` (components of a validated key: no ``..``) under the root;
        a link on the way that leads out of the root and the link roots raises
        [`UnsafeLinkError`][dist_ckpt.errors.UnsafeLinkError] (`confined()`)."""
        return confined(self.root.joinpath(*parts), self.root, *self.link_roots)

    def _not_found(self, key: str, operation: str, error: OSError) -> ObjectNotFoundError:
        url = self.url_of(key)
        return ObjectNotFoundError(f"{operation} {url}: no such file ({error.strerror})", url=url, operation=operation)

    def _dir_of(self, prefix: str) -> Path:
        return self.local_path(prefix) if prefix else self.root

    # -- writing -----------------------------------------------------------------------------

    def write(self, key: str, data: BufferLike) -> None:
        self.write_buffers(key, [data])

    def write_buffers(self, key: str, buffers: Sequence[BufferLike]) -> None:
        path = self.local_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        views = [as_byte_view(b) for b in buffers]
        replace_durably(local_files.write_temp_file(path, views, fsync=self.options.fsync), path, self.options.fsync)
        self._counters.add(bytes_written=sum(len(v) for v in views), objects_written=1)

    def open_writer(self, key: str) -> ObjectWriter:
        return _LocalWriter(self, key, self.local_path(key))

    def put_if_absent(self, key: str, data: BufferLike) -> None:
        path = self.local_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        view = as_byte_view(data)
        tmp = local_files.write_temp_file(path, [view], fsync=self.options.fsync)
        try:
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
            except OSError as e:
                if e.errno not in _NO_HARD_LINKS:
                    raise write_failed(e, self.url_of(key), len(view), operation="put_if_absent") from e
                self._create_exclusive(key, path, view)  # a file system without hard links
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        if self.options.fsync:
            fsync_dir(path.parent)
        self._counters.add(bytes_written=len(view), objects_written=1)

    def _create_exclusive(self, key: str, path: Path, view: memoryview) -> None:
        """put_if_absent where ``link`` is not supported: ``O_EXCL`` still creates the file only
        if absent; a crash while writing can leave it short, which readers of a commit marker
        refuse as damaged (never as a valid checkpoint)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError as e:
            url = self.url_of(key)
            raise ObjectExistsError(
                f"put_if_absent {url}: the file already exists and was left untouched",
                url=url,
                operation="put_if_absent",
            ) from e
        try:
            with open(fd, "wb", closefd=True) as f:
                f.write(view)
                f.flush()
                if self.options.fsync:
                    os.fsync(f.fileno())
        except BaseException as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            if isinstance(e, OSError):
                raise write_failed(e, self.url_of(key), len(view), operation="put_if_absent") from e
            raise

    def make_dir(self, prefix: str = "") -> None:
        make_dirs(self._dir_of(prefix), fsync=self.options.fsync)

    # -- reading -----------------------------------------------------------------------------

    def read(self, key: str) -> bytes:
        with open(local_files.open_regular(self.local_path(key), self.url_of(key)), "rb") as f:
            data = f.read()
        count_bytes(len(data))
        self._counters.add(bytes_read=len(data), read_requests=1)
        return data

    def open_reader(self, key: str) -> FileReader:
        return FileReader.open(self.local_path(key), self.url_of(key))

    def read_ranges(self, reads: Sequence[RangeRead]) -> None:
        pieces = [p for r in check_reads(reads) for p in split_range(r, self.options.max_read_bytes) if p.length > 0]
        if not pieces:
            return
        readers: Dict[str, FileReader] = {}
        try:
            for piece in pieces:
                if piece.key not in readers:
                    readers[piece.key] = self.open_reader(piece.key)
            threads = min(self.options.read_threads, len(pieces))
            if threads == 1:
                for piece in pieces:
                    self._pread(readers[piece.key], piece)
            else:
                with ThreadPoolExecutor(threads, thread_name_prefix="dist_ckpt-read") as pool:
                    futures = [pool.submit(self._pread, readers[p.key], p) for p in pieces]
                    try:
                        for future in futures:
                            future.result()
                    finally:
                        for future in futures:
                            future.cancel()
        finally:
            for reader in readers.values():
                reader.close()

    def _pread(self, reader: FileReader, piece: RangeRead) -> None:
        reader.read_into(piece.buffers, piece.offset)
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
        """Whether ``key`` is a file; a question, not a read, so a link leading out of the root
        answers too (reading through it is refused)."""
        validate_object_key(key)
        self._counters.add(metadata_requests=1)
        return self.root.joinpath(*key.split("/")).is_file()

    def list(self, prefix: str = "") -> List[ObjectInfo]:
        validate_prefix(prefix)
        self._counters.add(metadata_requests=1)
        base = self.root.joinpath(*prefix.split("/")) if prefix else self.root
        found: List[ObjectInfo] = []
        seen = set()
        # the real path of a directory that is not a link is its parent's plus its name: only
        # links are resolved (a resolve per directory cost a listing of a zarr checkpoint, one
        # directory per chunk row, more than the save it reports on)
        known: Dict[str, Path] = {}
        # links inside the root are followed (keys keep the names under which they are reached),
        # a link out of it is refused (the link policy above), a directory is listed once
        for dirpath, dirnames, filenames in os.walk(base, followlinks=True):
            real = known.pop(dirpath, None) or self._confined(Path(dirpath).relative_to(self.root).parts)
            if real in seen:
                dirnames[:] = []
                continue
            seen.add(real)
            dirnames[:] = [d for d in dirnames if not is_temp_name(d)]
            for d in dirnames:
                if not os.path.islink(os.path.join(dirpath, d)):
                    known[os.path.join(dirpath, d)] = real / d
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if is_temp_name(name):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                with contextlib.suppress(FileNotFoundError):  # deleted while we walked
                    found.append(ObjectInfo(key, os.stat(os.path.join(dirpath, name)).st_size))
        return sorted(found, key=lambda o: o.key)

    def list_dirs(self, prefix: str = "") -> List[str]:
        """The directories directly under ``prefix``; a symlink to a directory is one (it is read
        like one), in-progress temporary names are not."""
        validate_prefix(prefix)
        self._counters.add(metadata_requests=1)
        try:
            with os.scandir(self._dir_of(prefix)) as it:
                return sorted(e.name for e in it if _entry_is_dir(e) and not is_temp_name(e.name))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def dir_exists(self, prefix: str = "") -> bool:
        validate_prefix(prefix)
        self._counters.add(metadata_requests=1)
        return self._dir_of(prefix).is_dir()

    def delete(self, key: str) -> None:
        self._counters.add(metadata_requests=1)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.local_path(key))

    def delete_prefix(self, prefix: str) -> int:
        count = 0
        for info in self.list(prefix):
            self.delete(info.key)
            count += 1
        base = self._dir_of(prefix)
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
        child = LocalStorage(
            self.root.joinpath(*prefix.split("/")),
            self.options,
            counters=self._counters,
            link_roots=(self.root, *self.link_roots),
        )
        child._url = self.url_of(prefix)
        return child


def _entry_is_dir(entry: "os.DirEntry[str]") -> bool:
    try:
        return entry.is_dir()
    except OSError:  # a dangling symlink, or one we may not follow
        return False
