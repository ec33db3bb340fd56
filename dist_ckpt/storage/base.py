"""The storage interface: where a checkpoint's bytes go, on a local disk or in an object store.

A :class:`Storage` is rooted at one location (a directory, or ``s3://bucket/prefix``) and
addresses *objects* by relative keys such as ``"safetensors/rank00000_0.safetensors"``. It is
deliberately small -- the operations a checkpoint needs and nothing else:

=====================  =====================================================================
operation              what it guarantees
=====================  =====================================================================
``write``              the whole object appears at once, or not at all (never a torn object)
``write_buffers``      the same, gathered from several buffers (header + tensor memory) without
                       concatenating them first where the backend allows
``open_writer``        a streaming writer: many ``write`` calls, visible only after
                       ``commit`` (clean ``with`` exit); an exception aborts, leaving nothing
``put_if_absent``      create-if-absent: the commit marker; raises :class:`ObjectExistsError`
                       when the object is already there, never overwrites it
``read``               a whole (small) object
``read_ranges``        many byte ranges, concurrently, straight into the caller's buffers
``size`` / ``exists``  object metadata
``list``               every object under a prefix (recursive), sorted by key
``list_dirs``          the "directories" directly under a prefix (one level)
``delete`` /           remove one object (missing is fine) / everything under a prefix
``delete_prefix``
=====================  =====================================================================

Implementations declare what they can do as class-level capabilities (``ClassVar[bool]``), so
callers branch on a capability, never on a concrete class. The two ways to make a save atomic
(Orbax's two implementations) map onto them: a local disk has ``atomic_rename`` (every file is
written under a temporary name and renamed), an object store has ``conditional_put`` (objects
appear whole when their upload completes, and the commit marker is created only if absent).
Both implementations here provide ``put_if_absent``, so a save commits the same way on both.

Call sequence in a distributed save (phase B of issue 7 wires this into ``dist_ckpt.save``):

1. every rank ``write``s / ``open_writer``s its own objects (keys unique per rank);
2. all ranks synchronize (a barrier: every rank's objects are complete);
3. rank 0 ``put_if_absent``s ``metadata.json``, last. A save that dies before step 3 leaves
   objects but no marker, which is not a checkpoint.

In a load every rank calls ``read`` for small metadata and ``read_ranges`` for the byte ranges
of the shards it needs. Methods are thread-safe; a storage object is *not* shared across
processes (each rank opens its own with :func:`open_storage`).

Keys are ``/``-separated relative names (:func:`validate_object_key`); keys derived from
checkpoint keys go through :func:`dist_ckpt.storage.paths.encode_key` first.
"""

from __future__ import annotations

import abc
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Iterable, List, Optional, Sequence, Tuple, Type, Union

from dist_ckpt.errors import InvalidKeyError
from dist_ckpt.storage.errors import StorageConfigError
from dist_ckpt.storage.paths import validate_key

if TYPE_CHECKING:  # pragma: no cover
    from dist_ckpt.storage.local import LocalStorageOptions
    from dist_ckpt.storage.s3 import S3StorageOptions

__all__ = [
    "BufferLike",
    "IOCounters",
    "IOStats",
    "ObjectInfo",
    "ObjectWriter",
    "RangeRead",
    "Storage",
    "as_byte_view",
    "coalesce_ranges",
    "open_storage",
    "split_range",
    "validate_object_key",
    "validate_prefix",
]

BufferLike = Union[bytes, bytearray, memoryview]
"""What a write accepts: any contiguous buffer (wrap a tensor as ``memoryview(t.numpy())``)."""

_MAX_KEY_BYTES = 1024  # the S3 limit on a whole key (prefix included)
_MAX_COMPONENT_BYTES = 255  # the usual limit on a file name


def validate_object_key(key: str) -> str:
    """Return ``key`` if it is a valid relative object key, else raise :class:`InvalidKeyError`.

    A key is ``/``-separated; no component is empty, ``.`` or ``..``; it does not start with
    ``/``; it has no backslash or control character; components fit in 255 bytes and the key in
    1024 bytes (UTF-8). The same key is then safe as a file path under a directory and as an S3
    key under a prefix.

    Example::

        validate_object_key("safetensors/index.json")   # ok
        validate_object_key("../etc/passwd")            # raises InvalidKeyError
    """
    validate_key(key)
    problem = None
    if "\\" in key:
        problem = "keys use '/' as the only separator (no backslash)"
    elif any(part == "" for part in key.split("/")):
        problem = "keys must not have empty components (leading, trailing or doubled '/')"
    elif len(key.encode("utf-8")) > _MAX_KEY_BYTES:
        problem = f"keys must fit in {_MAX_KEY_BYTES} bytes (UTF-8)"
    elif any(len(part.encode("utf-8")) > _MAX_COMPONENT_BYTES for part in key.split("/")):
        problem = f"each '/'-separated component must fit in {_MAX_COMPONENT_BYTES} bytes (UTF-8)"
    if problem:
        raise InvalidKeyError(f"invalid object key {key!r}: {problem}")
    return key


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` for :meth:`Storage.list` / :meth:`Storage.delete_prefix`: "" or a valid key.

    Example::

        validate_prefix("")             # everything under the root
        validate_prefix("safetensors")  # everything under safetensors/
    """
    return prefix if prefix == "" else validate_object_key(prefix)


def as_byte_view(buffer: BufferLike, *, writable: bool = False) -> memoryview:
    """A flat unsigned-byte view of ``buffer`` (no copy); raises if it is not C-contiguous.

    Example::

        view = as_byte_view(memoryview(tensor.numpy()), writable=True)   # len(view) == tensor.nbytes
    """
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise StorageConfigError("storage buffers must be C-contiguous (copy the tensor with .contiguous() first)")
    if writable and view.readonly:
        raise StorageConfigError("read destination buffers must be writable (got a read-only buffer)")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


@dataclass(frozen=True)
class ObjectInfo:
    """An object found by :meth:`Storage.list`.

    Attributes:
        key: the object's key relative to the storage root.
        size: its size in bytes.
    """

    key: str
    size: int


@dataclass(frozen=True)
class RangeRead:
    """Read ``sum(len(b) for b in buffers)`` bytes of object ``key`` from ``offset`` into ``buffers``.

    The buffers are filled in order, like ``os.preadv``: a stretch of an object that maps onto
    several destination pieces (the rows of a tensor slice) is one read. Build it with
    :meth:`into`, which accepts any writable contiguous buffers.

    Attributes:
        key: object key.
        offset: first byte of the range in the object.
        buffers: flat writable byte views, filled in order.
    """

    key: str
    offset: int
    buffers: Tuple[memoryview, ...]

    def __post_init__(self) -> None:
        validate_object_key(self.key)
        if not isinstance(self.offset, int) or self.offset < 0:
            raise StorageConfigError(f"RangeRead of {self.key!r}: offset must be an int >= 0, got {self.offset!r}")

    @classmethod
    def into(cls, key: str, offset: int, *buffers: BufferLike) -> "RangeRead":
        """A read of ``key`` at ``offset`` filling ``buffers`` (each writable and contiguous).

        Example::

            out = torch.empty(1024, dtype=torch.uint8)
            storage.read_ranges([RangeRead.into("a.bin", 4096, memoryview(out.numpy()))])
        """
        return cls(key, offset, tuple(as_byte_view(b, writable=True) for b in buffers))

    @property
    def length(self) -> int:
        """Number of bytes read."""
        return sum(len(b) for b in self.buffers)


def split_range(read: RangeRead, max_bytes: int) -> List[RangeRead]:
    """Split ``read`` into consecutive reads of at most ``max_bytes`` each (no copies: views).

    Lets one large range be fetched by several concurrent requests (and bounds what a single
    request holds in memory).

    Example::

        parts = split_range(RangeRead.into("a", 0, bytearray(10)), 4)   # lengths 4, 4, 2
    """
    if max_bytes < 1:
        raise StorageConfigError(f"split_range: max_bytes must be >= 1, got {max_bytes}")
    if read.length <= max_bytes:
        return [read]
    pieces: List[RangeRead] = []
    current: List[memoryview] = []
    room = max_bytes
    start = read.offset
    position = read.offset
    for buf in read.buffers:
        view = buf
        while len(view) > 0:
            take = min(room, len(view))
            current.append(view[:take])
            view = view[take:]
            room -= take
            position += take
            if room == 0:
                pieces.append(RangeRead(read.key, start, tuple(current)))
                current, room, start = [], max_bytes, position
    if current:
        pieces.append(RangeRead(read.key, start, tuple(current)))
    return pieces


def coalesce_ranges(reads: Sequence[RangeRead], max_bytes: int, max_gap: int = 0) -> List[RangeRead]:
    """Requests for ``reads``: each split to ``max_bytes``, neighbours merged up to ``max_bytes``.

    Ranges of the same object that follow each other with at most ``max_gap`` bytes between
    them become one request (the gap lands in a throwaway buffer, so it costs ``max_gap``
    downloaded bytes at most; 0 merges only exactly adjacent ranges, which costs nothing).
    Overlapping ranges are never merged. Fewer, larger requests matter on object stores, where
    every request has a latency and a price.

    Example::

        a, b = bytearray(4), bytearray(4)
        coalesce_ranges([RangeRead.into("k", 0, a), RangeRead.into("k", 4, b)], 1 << 20)
        # -> one RangeRead("k", 0, (a, b))
    """
    pieces = sorted(
        (p for r in reads for p in split_range(r, max_bytes) if p.length > 0), key=lambda p: (p.key, p.offset)
    )
    merged: List[RangeRead] = []
    for piece in pieces:
        if merged:
            last = merged[-1]
            end = last.offset + last.length
            gap = piece.offset - end
            if piece.key == last.key and 0 <= gap <= max_gap and last.length + gap + piece.length <= max_bytes:
                filler: Tuple[memoryview, ...] = (memoryview(bytearray(gap)),) if gap else ()
                merged[-1] = RangeRead(last.key, last.offset, last.buffers + filler + piece.buffers)
                continue
        merged.append(piece)
    return merged


@dataclass(frozen=True)
class IOStats:
    """A snapshot of what a storage (and its children) moved, for tests and reports.

    Attributes:
        bytes_read: payload bytes received by reads (``read`` and ``read_ranges``).
        bytes_written: payload bytes handed to writes that completed.
        read_requests: read requests issued (one per ranged GET / ``pread`` piece; retries
            inside the S3 client are not counted here -- the test server counts those).
        objects_written: objects written (a multipart upload counts once).
        metadata_requests: ``size`` / ``exists`` / ``list`` / ``delete`` calls.
    """

    bytes_read: int = 0
    bytes_written: int = 0
    read_requests: int = 0
    objects_written: int = 0
    metadata_requests: int = 0


@dataclass
class IOCounters:
    """Thread-safe running totals behind :attr:`Storage.stats` (shared by a storage and its children)."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _totals: IOStats = field(default_factory=IOStats)

    def add(
        self,
        *,
        bytes_read: int = 0,
        bytes_written: int = 0,
        read_requests: int = 0,
        objects_written: int = 0,
        metadata_requests: int = 0,
    ) -> None:
        """Add to the totals."""
        with self._lock:
            t = self._totals
            self._totals = IOStats(
                t.bytes_read + bytes_read,
                t.bytes_written + bytes_written,
                t.read_requests + read_requests,
                t.objects_written + objects_written,
                t.metadata_requests + metadata_requests,
            )

    def snapshot(self) -> IOStats:
        """The totals so far."""
        with self._lock:
            return self._totals

    def reset(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self._totals = IOStats()


class ObjectWriter(abc.ABC):
    """A streaming write of one object: ``write`` many buffers, then ``commit`` (or ``abort``).

    Nothing is visible at the key before :meth:`commit` returns; after :meth:`abort` (or an
    exception inside the ``with`` block) nothing is left behind. Use it as a context manager::

        with storage.open_writer("rank0.safetensors") as w:
            w.write(header)
            for t in tensors:
                w.write(memoryview(t.numpy()))
        # committed here; an exception in the block aborts instead

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

    Capabilities (class attributes):
        atomic_rename: writes go to a temporary name and are renamed into place (local disk).
        conditional_put: ``put_if_absent`` is atomic at the server (never overwrites).
        ranged_read: ``read_ranges`` fetches only the requested bytes.
        multipart_upload: large objects are uploaded in parts, concurrently.
        local_paths: objects are files on a local file system (``local_path(key)`` exists), so
            libraries that need a path (TensorStore's ``file`` driver, zarr's LocalStore) can
            use them directly.
    """

    atomic_rename: ClassVar[bool] = False
    conditional_put: ClassVar[bool] = False
    ranged_read: ClassVar[bool] = False
    multipart_upload: ClassVar[bool] = False
    local_paths: ClassVar[bool] = False

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
        """What this storage and every storage derived from it by :meth:`child` moved so far."""
        return self._counters.snapshot()

    def reset_stats(self) -> None:
        """Zero the counters (shared with children)."""
        self._counters.reset()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # -- writing -----------------------------------------------------------------------------

    @abc.abstractmethod
    def write(self, key: str, data: BufferLike) -> None:
        """Write the whole object ``key`` (replacing any previous one); visible whole or not at all.

        Example::

            storage.write("common.pt", buffer.getvalue())
        """

    @abc.abstractmethod
    def write_buffers(self, key: str, buffers: Sequence[BufferLike]) -> None:
        """Write the concatenation of ``buffers`` as object ``key`` (same guarantees as :meth:`write`).

        The buffers are sent from their own memory where the backend allows (a local file is
        written buffer by buffer; an S3 multipart upload copies once into its part buffers).

        Example::

            storage.write_buffers("rank0.bin", [header, memoryview(t.numpy())])
        """

    @abc.abstractmethod
    def open_writer(self, key: str) -> ObjectWriter:
        """Start a streaming write of object ``key`` (see :class:`ObjectWriter`).

        Example::

            with storage.open_writer("big.bin") as w:
                for chunk in chunks:
                    w.write(chunk)
        """

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: BufferLike) -> None:
        """Create object ``key`` with ``data`` only if no object is there: the commit marker.

        Raises:
            ObjectExistsError: an object already exists at ``key``; it is left untouched.

        Example::

            storage.put_if_absent("metadata.json", json.dumps(meta).encode())
        """

    # -- reading -----------------------------------------------------------------------------

    @abc.abstractmethod
    def read(self, key: str) -> bytes:
        """The whole object ``key``.

        Raises:
            ObjectNotFoundError: no such object.

        Example::

            meta = json.loads(storage.read("metadata.json"))
        """

    @abc.abstractmethod
    def read_ranges(self, reads: Sequence[RangeRead]) -> None:
        """Fill every read's buffers from its object's byte range, concurrently (bounded).

        Each read gets exactly its bytes; the destination buffers are the caller's (a tensor's
        own memory): no intermediate copy of the whole range is kept.

        Raises:
            ObjectNotFoundError: an object does not exist.
            TruncatedObjectError: an object ends before a range does.

        Example::

            out = bytearray(100)
            storage.read_ranges([RangeRead.into("a.bin", 0, memoryview(out)[:50]),
                                 RangeRead.into("b.bin", 10, memoryview(out)[50:])])
        """

    def read_into(self, key: str, offset: int, out: BufferLike) -> None:
        """Fill ``out`` with the bytes of ``key`` starting at ``offset`` (one range).

        Example::

            storage.read_into("a.bin", 4096, memoryview(tensor.numpy()))
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

        Example::

            files = [o.key for o in storage.list("safetensors")]
        """

    def list_dirs(self, prefix: str = "") -> List[str]:
        """Names of the "directories" directly under ``prefix`` ("" for the root), sorted: the
        next key component of every object deeper down (S3's common prefixes). Lets a run's
        checkpoints be found without listing every object of every checkpoint.

        This default lists every object; implementations list one level.

        Example::

            open_storage("s3://bucket/run1").list_dirs()   # ["iter_0000100", "iter_0000200"]
        """
        start = len(prefix) + 1 if prefix else 0
        return sorted({o.key[start:].split("/", 1)[0] for o in self.list(prefix) if "/" in o.key[start:]})

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove object ``key``; a missing object is not an error."""

    @abc.abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under ``prefix`` ("" for everything under the root); return how many."""

    @abc.abstractmethod
    def child(self, prefix: str) -> "Storage":
        """The storage rooted at ``prefix`` under this one (same options, shared counters).

        Example::

            ckpt = open_storage("s3://bucket/run1").child("iter_0001000")
        """


StorageOptions = Union["LocalStorageOptions", "S3StorageOptions"]


def open_storage(
    location: Union[str, "os.PathLike[str]", Storage], options: Optional[StorageOptions] = None
) -> Storage:
    """The storage for a local path or an ``s3://bucket/prefix`` URL.

    A :class:`Storage` is returned as given. ``file://`` URLs and plain paths are local. S3
    needs the ``s3`` extra (``pip install "dist_ckpt[s3]"``); its endpoint, region and
    credentials come from the usual AWS environment variables (``AWS_ENDPOINT_URL``,
    ``AWS_ACCESS_KEY_ID``, ...; see :mod:`dist_ckpt.storage.s3`).

    Args:
        location: a directory path, ``file:///abs/path`` or ``s3://bucket[/prefix]``.
        options: :class:`~dist_ckpt.storage.local.LocalStorageOptions` for paths,
            :class:`~dist_ckpt.storage.s3.S3StorageOptions` for ``s3://`` URLs.

    Raises:
        StorageConfigError: unknown URL scheme, malformed URL, or options of the wrong kind.

    Example::

        storage = open_storage("s3://my-bucket/runs/exp1/iter_0001000")
        storage.write("hello.txt", b"hi")
    """
    if isinstance(location, Storage):
        if options is not None:
            raise StorageConfigError(f"open_storage: options were given with an already opened storage {location!r}")
        return location
    text = os.fspath(location)
    scheme, sep, rest = text.partition("://")
    if sep and scheme.lower() in ("s3", "s3a"):
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
    return LocalStorage(Path(text), options)


def _check_reads(reads: Iterable[RangeRead]) -> List[RangeRead]:
    """The reads as a list, each checked (keys valid, buffers flat views) -- shared by implementations."""
    checked = list(reads)
    for r in checked:
        if not isinstance(r, RangeRead):
            raise StorageConfigError(f"read_ranges expects RangeRead items, got {type(r).__name__}")
    return checked
