"""The storage interface: where a checkpoint's bytes go, on a local disk or in an object store.

A [`Storage`][dist_ckpt.storage.base.Storage] is rooted at one location (a directory, or ``s3://bucket/prefix``) and
addresses *objects* by relative keys such as ``"safetensors/rank00000_0.safetensors"``. It is
deliberately small -- the operations a checkpoint needs and nothing else:

* ``write`` -- the whole object appears at once, or not at all (never a torn object)
* ``write_buffers`` -- the same, gathered from several buffers (header + tensor memory) without concatenating them first
  where the backend allows
* ``open_writer`` -- a streaming writer: many ``write`` calls, visible only after ``commit`` (clean ``with`` exit); an
  exception aborts, leaving nothing
* ``put_if_absent`` -- create-if-absent: the commit marker; raises `ObjectExistsError` when the object is already there,
  never overwrites it
* ``read`` -- a whole (small) object
* ``read_ranges`` -- many byte ranges, concurrently, straight into the caller's buffers
* ``open_reader`` -- positional reads of one object into the caller's buffers, many times
* ``size`` / ``exists`` -- object metadata
* ``list`` -- every object under a prefix (recursive), sorted by key
* ``list_dirs`` -- the "directories" directly under a prefix (one level)
* ``dir_exists`` -- whether a "directory" (a prefix) exists
* ``make_dir`` -- create a directory where the storage has them (nothing on object stores)
* ``delete`` / ``delete_prefix`` -- remove one object (missing is fine) / everything under a prefix

Local directories and object stores go through this one interface; what only a local disk can
do is declared as class-level capabilities (``ClassVar[bool]``), so callers branch on a
capability, never on a concrete class:

* ``local_paths``: objects are files under [`Storage.local_dir`][dist_ckpt.storage.base.Storage.local_dir]. Code that
  needs a path uses it: TensorStore's ``file`` driver and zarr's ``LocalStore``, files written in parts at
  planned offsets by several processes with early writeback (the safetensors backend), symlinks
  and directory renames (checkpoint rotation), HuggingFace folders.
* ``positional_reads``: [`Storage.open_reader()`][dist_ckpt.storage.base.Storage.open_reader] reads with ``os.preadv``
  on an open descriptor, straight into the destination memory, so small reads cost a system call, not a
  request: loaders use more, smaller reads (and check checksums piece by piece) where it is set.
* ``atomic_rename`` / ``conditional_put``: the two ways to make a save atomic (Orbax's two
  implementations): a local disk writes every file under a temporary name and renames it, an
  object store makes objects appear whole when their upload completes. Both implementations
  here provide ``put_if_absent``, so a save commits the same way on both.
* ``ranged_read``, ``multipart_upload``: what the object-store client does with large objects.
* ``s3_compatible``: the location is an S3 bucket and prefix that array libraries with their
  own S3 clients can be handed (``S3Storage.obstore_store()`` for zarr-python,
  ``S3Storage.tensorstore_kvstore()`` for TensorStore).

Call sequence in a distributed save:

1. every rank ``write``s / ``open_writer``s its own objects (keys unique per rank);
2. all ranks synchronize (a barrier: every rank's objects are complete);
3. rank 0 ``put_if_absent``s ``metadata.json``, last. A save that dies before step 3 leaves
   objects but no marker, which is not a checkpoint.

In a load every rank calls ``read`` for small metadata and ``read_ranges`` (or an
``open_reader`` per file) for the byte ranges of the shards it needs. Methods are thread-safe;
a storage object is *not* shared across processes (each rank opens its own with
[`open_storage()`][dist_ckpt.storage.base.open_storage]; a pickled storage carries its location and options, not its
connection).

Keys are ``/``-separated relative names (`validate_object_key()`);
keys derived from checkpoint keys go through `dist_ckpt.storage.paths.encode_key()` first.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, List, Optional, Sequence, Tuple, Type, Union

from dist_ckpt.storage.errors import StorageConfigError
from dist_ckpt.storage.paths import validate_object_key, validate_prefix
from dist_ckpt.storage.ranges import BufferLike, RangeRead
from dist_ckpt.storage.stats import IOCounters, IOStats

if TYPE_CHECKING:  # pragma: no cover
    from dist_ckpt.storage.local import LocalStorageOptions
    from dist_ckpt.storage.s3 import S3StorageOptions

__all__ = ["S3_SCHEMES", "ObjectInfo", "ObjectReader", "ObjectWriter", "Storage", "StorageOptions", "open_storage"]

#: URL schemes of S3-compatible object stores (``s3a`` is Hadoop's spelling of the same thing)
S3_SCHEMES: Tuple[str, ...] = ("s3", "s3a")


@dataclass(frozen=True)
class ObjectInfo:
    """An object found by [`Storage.list()`][dist_ckpt.storage.base.Storage.list].

    Attributes:
        key: the object's key relative to the storage root.
        size: its size in bytes.
    """

    key: str
    size: int


class ObjectReader(abc.ABC):
    """Positional reads of one object, many times: what loaders read files with.

    ``read_into`` fills the caller's buffers (a tensor's own memory) from a byte offset, like
    ``os.preadv``; a reader may be used from several threads at once. Open one with
    [`Storage.open_reader()`][dist_ckpt.storage.base.Storage.open_reader], close it when done (or use it as a context
    manager):

    ```python
    with storage.open_reader("safetensors/rank00000_0.safetensors") as reader:
        header_length = bytearray(8)
        reader.read_into([memoryview(header_length)], 0)
    ```

    Attributes:
        positional: the storage's ``positional_reads`` capability: each read is a system call
            on an open descriptor (cheap), not a request (latency).
    """

    positional: ClassVar[bool] = False

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The object's location, for messages."""

    @abc.abstractmethod
    def read_into(self, buffers: Sequence[memoryview], offset: int) -> int:
        """Fill ``buffers`` (in order) from byte ``offset``; return the number of bytes read.

        Raises:
            TruncatedObjectError: the object ends before the buffers are full.
            ObjectNotFoundError: the object does not exist.
        """

    @abc.abstractmethod
    def size(self) -> int:
        """The object's size in bytes.

        Raises:
            ObjectNotFoundError: the object does not exist.
        """

    def close(self) -> None:
        """Release what the reader holds (an open descriptor); idempotent."""

    def __enter__(self) -> "ObjectReader":
        return self

    def __exit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.close()

    def __str__(self) -> str:
        return self.url


class _RangeReader(ObjectReader):
    """The reader of any storage: each read is one [`Storage.read_ranges()`][dist_ckpt.storage.base.Storage.read_ranges]
    call (on an object store, ranged GETs -- split into concurrent ones when large -- into the caller's
    buffers)."""

    def __init__(self, storage: "Storage", key: str) -> None:
        self.storage = storage
        self.key = validate_object_key(key)

    @property
    def url(self) -> str:
        return self.storage.url_of(self.key)

    def read_into(self, buffers: Sequence[memoryview], offset: int) -> int:
        pending = [b for b in buffers if len(b)]
        if not pending:
            return 0
        read = RangeRead.into(self.key, offset, *pending)
        self.storage.read_ranges([read])
        return read.length

    def size(self) -> int:
        return self.storage.size(self.key)


class ObjectWriter(abc.ABC):
    """A streaming write of one object: ``write`` many buffers, then ``commit`` (or ``abort``).

    Nothing is visible at the key before [`commit()`][.commit] returns; after [`abort()`][.abort] (or an
    exception inside the ``with`` block) nothing is left behind. Use it as a context manager:

    ```python
    with storage.open_writer("rank0.safetensors") as w:
        w.write(header)
        for t in tensors:
            w.write(memoryview(t.numpy()))
    # committed here; an exception in the block aborts instead
    ```

    A writer is used by one thread.
    """

    @abc.abstractmethod
    def write(self, data: BufferLike) -> int:
        """Append ``data`` (copied or sent before returning: the buffer may be reused); return its size."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Make the object visible, whole. Idempotent after success."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard everything written; the key is left as it was. Idempotent."""

    def __enter__(self) -> "ObjectWriter":
        return self

    def __exit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class Storage(abc.ABC):
    """A place holding a checkpoint's objects: a local directory or an object-store prefix.

    See the module docstring for the operations, the capabilities and the call sequence of a
    distributed save. Every method may be called from several threads of one process.

    Capabilities (class attributes; see the module docstring for what uses them):
        local_paths: objects are files under [`local_dir`][.local_dir] ([`local_path()`][.local_path]), so code
            and libraries that need a path (TensorStore's ``file`` driver, zarr's LocalStore,
            files written in parts, symlinks) can use them directly.
        positional_reads: [`open_reader()`][.open_reader] reads with ``os.preadv`` on an open descriptor:
            many small reads are cheap.
        atomic_rename: writes go to a temporary name and are renamed into place (local disk).
        conditional_put: ``put_if_absent`` is atomic at the server (never overwrites).
        ranged_read: ``read_ranges`` fetches only the requested bytes.
        multipart_upload: large objects are uploaded in parts, concurrently.
        s3_compatible: other S3 clients can reach the location (``obstore_store()``,
            ``tensorstore_kvstore()``: the zarr engines' own clients).
    """

    local_paths: ClassVar[bool] = False
    positional_reads: ClassVar[bool] = False
    atomic_rename: ClassVar[bool] = False
    conditional_put: ClassVar[bool] = False
    ranged_read: ClassVar[bool] = False
    multipart_upload: ClassVar[bool] = False
    s3_compatible: ClassVar[bool] = False

    def __init__(self, counters: Optional[IOCounters] = None) -> None:
        self._counters = counters if counters is not None else IOCounters()

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Where the root is: a local path or ``s3://bucket/prefix`` (never with credentials)."""

    def url_of(self, key: str) -> str:
        """The location of object ``key``, for messages."""
        return f"{self.url.rstrip('/')}/{key}"

    @property
    def stats(self) -> IOStats:
        """What this storage and every storage derived from it by [`child()`][..child] moved so far."""
        return self._counters.snapshot()

    def reset_stats(self) -> None:
        """Zero the counters (shared with children)."""
        self._counters.reset()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # -- local fast paths (storages with ``local_paths``) ----------------------------------------

    @property
    def local_dir(self) -> Path:
        """The directory this storage's objects are files in (storages with ``local_paths``).

        Lets a strategy written for directories work on a local checkpoint; code that also runs
        on object stores checks ``local_paths`` first.

        Raises:
            StorageConfigError: the storage has no local files (an object store).

        Example:

        ```python
        if storage.local_paths:
            directory = storage.local_dir          # a pathlib.Path
        ```
        """
        raise StorageConfigError(f"{self.url} is not a local directory: {type(self).__name__} has no local paths")

    def local_path(self, key: str) -> Path:
        """The file of object ``key`` (storages with ``local_paths``; checked to stay under the root).

        Raises:
            StorageConfigError: the storage has no local files (an object store).

        Example:

        ```python
        LocalStorage("/ckpt").local_path("zarr/w/zarr.json")   # Path("/ckpt/zarr/w/zarr.json")
        ```
        """
        validate_object_key(key)
        return self.local_dir / key

    # -- writing -----------------------------------------------------------------------------

    @abc.abstractmethod
    def write(self, key: str, data: BufferLike) -> None:
        """Write the whole object ``key`` (replacing any previous one); visible whole or not at all.

        Example:

        ```python
        storage.write("common.pt", buffer.getvalue())
        ```
        """

    @abc.abstractmethod
    def write_buffers(self, key: str, buffers: Sequence[BufferLike]) -> None:
        """Write the concatenation of ``buffers`` as object ``key`` (same guarantees as [`write()`][..write]).

        The buffers are sent from their own memory where the backend allows (a local file is
        written buffer by buffer; an S3 multipart upload copies once into its part buffers).

        Example:

        ```python
        storage.write_buffers("rank0.bin", [header, memoryview(t.numpy())])
        ```
        """

    @abc.abstractmethod
    def open_writer(self, key: str) -> ObjectWriter:
        """Start a streaming write of object ``key`` (see [`ObjectWriter`][dist_ckpt.storage.base.ObjectWriter]).

        Example:

        ```python
        with storage.open_writer("big.bin") as w:
            for chunk in chunks:
                w.write(chunk)
        ```
        """

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: BufferLike) -> None:
        """Create object ``key`` with ``data`` only if no object is there: the commit marker.

        Raises:
            ObjectExistsError: an object already exists at ``key``; it is left untouched.

        Example:

        ```python
        storage.put_if_absent("metadata.json", json.dumps(meta).encode())
        ```
        """

    # -- reading -----------------------------------------------------------------------------

    @abc.abstractmethod
    def read(self, key: str) -> bytes:
        """The whole object ``key``.

        Raises:
            ObjectNotFoundError: no such object.

        Example:

        ```python
        meta = json.loads(storage.read("metadata.json"))
        ```
        """

    @abc.abstractmethod
    def read_ranges(self, reads: Sequence[RangeRead]) -> None:
        """Fill every read's buffers from its object's byte range, concurrently (bounded).

        Each read gets exactly its bytes; the destination buffers are the caller's (a tensor's
        own memory): no intermediate copy of the whole range is kept.

        Raises:
            ObjectNotFoundError: an object does not exist.
            TruncatedObjectError: an object ends before a range does.

        Example:

        ```python
        out = bytearray(100)
        storage.read_ranges([RangeRead.into("a.bin", 0, memoryview(out)[:50]),
                             RangeRead.into("b.bin", 10, memoryview(out)[50:])])
        ```
        """

    def open_reader(self, key: str) -> ObjectReader:
        """A reader of object ``key`` for many positional reads (see
        [`ObjectReader`][dist_ckpt.storage.base.ObjectReader]).

        The default reads through [`read_ranges()`][..read_ranges]; a local storage reads with ``os.preadv``
        on a descriptor it opens here (``positional_reads``).

        Raises:
            ObjectNotFoundError: the object does not exist (here, or at the first read).

        Example:

        ```python
        with storage.open_reader("a.bin") as reader:
            reader.read_into([memoryview(out)], 4096)
        ```
        """
        return _RangeReader(self, key)

    def read_into(self, key: str, offset: int, out: BufferLike) -> None:
        """Fill ``out`` with the bytes of ``key`` starting at ``offset`` (one range).

        Example:

        ```python
        storage.read_into("a.bin", 4096, memoryview(tensor.numpy()))
        ```
        """
        self.read_ranges([RangeRead.into(key, offset, out)])

    # -- metadata ----------------------------------------------------------------------------

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes of object ``key``.

        Raises:
            ObjectNotFoundError: no such object.
        """

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether object ``key`` exists."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> List[ObjectInfo]:
        """Every object whose key is under ``prefix`` (``prefix/...``; "" for all), sorted by key.

        In-progress writes (temporary files, incomplete uploads) are not listed.

        Example:

        ```python
        files = [o.key for o in storage.list("safetensors")]
        ```
        """

    def list_dirs(self, prefix: str = "") -> List[str]:
        """Names of the "directories" directly under ``prefix`` ("" for the root), sorted: the
        next key component of every object deeper down (S3's common prefixes). Lets a run's
        checkpoints be found without listing every object of every checkpoint.

        This default lists every object; implementations list one level.

        Example:

        ```python
        open_storage("s3://bucket/run1").list_dirs()   # ["iter_0000100", "iter_0000200"]
        ```
        """
        start = len(prefix) + 1 if prefix else 0
        return sorted({o.key[start:].split("/", 1)[0] for o in self.list(prefix) if "/" in o.key[start:]})

    def dir_exists(self, prefix: str = "") -> bool:
        """Whether the "directory" ``prefix`` ("" for the root) exists: a local directory (even
        an empty one), or an object-store prefix under which an object lives.

        This default lists; implementations ask in one request.

        Example:

        ```python
        open_storage("s3://bucket/run1").dir_exists("iter_0000100")
        ```
        """
        validate_prefix(prefix)
        return bool(self.list_dirs(prefix)) or bool(self.list(prefix))

    def make_dir(self, prefix: str = "") -> None:
        """Create the directory ``prefix`` ("" for the root) and its parents where the storage
        has directories (durably on a local disk: each new entry's parent is fsynced); object
        stores have nothing to create (a prefix exists once an object lives under it). Writes
        create the directories of their keys themselves (a disk fsyncs the file and its
        directory, as before); ``make_dir`` is for directories whose entries must survive a
        crash, such as a checkpoint's own.

        Example:

        ```python
        storage.make_dir("zarr")
        ```
        """
        validate_prefix(prefix)

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove object ``key``; a missing object is not an error."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under ``prefix`` ("" for everything under the root); return how many."""

    @abc.abstractmethod
    def child(self, prefix: str) -> "Storage":
        """The storage rooted at ``prefix`` under this one (same options, shared counters).

        Example:

        ```python
        ckpt = open_storage("s3://bucket/run1").child("iter_0001000")
        ```
        """


StorageOptions = Union["LocalStorageOptions", "S3StorageOptions"]


def open_storage(
    location: Union[str, "os.PathLike[str]", Storage], options: Optional[StorageOptions] = None
) -> Storage:
    """The storage for a local path or an ``s3://bucket/prefix`` URL.

    A [`Storage`][dist_ckpt.storage.base.Storage] is returned as given. ``file://`` URLs and plain paths are local. S3
    needs the ``s3`` extra (``pip install "dist_ckpt[s3]"``); its endpoint, region and
    credentials come from the usual AWS environment variables (``AWS_ENDPOINT_URL``,
    ``AWS_ACCESS_KEY_ID``, ...; see [`dist_ckpt.storage.s3`][dist_ckpt.storage.s3]).

    Args:
        location: a directory path, ``file:///abs/path`` or ``s3://bucket[/prefix]``.
        options: [`LocalStorageOptions`][dist_ckpt.storage.local.LocalStorageOptions] for paths,
            [`S3StorageOptions`][dist_ckpt.storage.s3_client.S3StorageOptions] for ``s3://`` URLs.

    Raises:
        StorageConfigError: unknown URL scheme, malformed URL, or options of the wrong kind.

    Example:

    ```python
    storage = open_storage("s3://my-bucket/runs/exp1/iter_0001000")
    storage.write("hello.txt", b"hi")
    ```
    """
    if isinstance(location, Storage):
        if options is not None:
            raise StorageConfigError(f"open_storage: options were given with an already opened storage {location!r}")
        return location
    text = os.fspath(location)
    scheme, sep, rest = text.partition("://")
    if sep and scheme.lower() in S3_SCHEMES:
        from dist_ckpt.storage.s3 import S3Storage, S3StorageOptions

        if options is not None and not isinstance(options, S3StorageOptions):
            raise StorageConfigError(f"open_storage({text!r}): expected S3StorageOptions, got {type(options).__name__}")
        return S3Storage.from_url(text, options)
    from dist_ckpt.storage.local import LocalStorage, LocalStorageOptions

    if options is not None and not isinstance(options, LocalStorageOptions):
        raise StorageConfigError(f"open_storage({text!r}): expected LocalStorageOptions, got {type(options).__name__}")
    if sep:
        if scheme.lower() != "file":
            raise StorageConfigError(
                f"open_storage({text!r}): unsupported URL scheme {scheme!r}; use a local path, file:///path or s3://bucket/prefix"
            )
        if rest and not rest.startswith("/"):
            raise StorageConfigError(f"open_storage({text!r}): file URLs must be absolute (file:///abs/path)")
        text = rest
    return LocalStorage(text, options)
