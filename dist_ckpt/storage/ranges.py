"""Buffers and byte ranges: what storage reads fill and writes send, without copies.

A write accepts any contiguous buffer (`BufferLike`); a read fills the caller's buffers
(`RangeRead`: an object's byte range into a list of writable views, like ``os.preadv``).
`split_range()` and `coalesce_ranges()` turn the ranges a load needs into the requests a
storage issues: large ranges split so that several requests share them, neighbours merged so that
an object store is asked fewer times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Sequence, Tuple, Union

from dist_ckpt.storage.errors import StorageConfigError
from dist_ckpt.storage.paths import validate_object_key

__all__ = ["BufferLike", "RangeRead", "as_byte_view", "check_reads", "coalesce_ranges", "split_range"]

BufferLike = Union[bytes, bytearray, memoryview]
"""What a write accepts: any contiguous buffer (wrap a tensor as ``memoryview(t.numpy())``)."""


def as_byte_view(buffer: BufferLike, *, writable: bool = False) -> memoryview:
    """A flat unsigned-byte view of ``buffer`` (no copy); raises if it is not C-contiguous.

    Example:

    ```python
    view = as_byte_view(memoryview(tensor.numpy()), writable=True)   # len(view) == tensor.nbytes
    ```
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
class RangeRead:
    """Read ``sum(len(b) for b in buffers)`` bytes of object ``key`` from ``offset`` into ``buffers``.

    The buffers are filled in order, like ``os.preadv``: a stretch of an object that maps onto
    several destination pieces (the rows of a tensor slice) is one read. Build it with
    `into()`, which accepts any writable contiguous buffers.

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

        Example:

        ```python
        out = torch.empty(1024, dtype=torch.uint8)
        storage.read_ranges([RangeRead.into("a.bin", 4096, memoryview(out.numpy()))])
        ```
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

    Example:

    ```python
    parts = split_range(RangeRead.into("a", 0, bytearray(10)), 4)   # lengths 4, 4, 2
    ```
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

    Example:

    ```python
    a, b = bytearray(4), bytearray(4)
    coalesce_ranges([RangeRead.into("k", 0, a), RangeRead.into("k", 4, b)], 1 << 20)
    # -> one RangeRead("k", 0, (a, b))
    ```
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


def check_reads(reads: Iterable[RangeRead]) -> List[RangeRead]:
    """The reads as a list, each checked (keys valid, buffers flat views) -- for implementations of ``read_ranges``."""
    checked = list(reads)
    for r in checked:
        if not isinstance(r, RangeRead):
            raise StorageConfigError(f"read_ranges expects RangeRead items, got {type(r).__name__}")
    return checked
