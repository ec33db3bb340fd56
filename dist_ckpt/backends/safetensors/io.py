"""Reading boxes of stored tensors into destination tensors: few, large, positional reads.

A stored shard is a box of a global tensor laid out row-major at some byte offset of a file; a
destination is a box of the same global tensor laid out row-major in a tensor (or a flattened
range of one). Copying their intersection reduces to *runs*: stretches that are contiguous in
both. `contiguous_runs()` finds them (vectorized, no per-element work) and `plan_copy()`
turns them into read operations:

* `DirectRead` -- one ``preadv`` of a contiguous stretch of the file straight into one
  or more memoryviews of the destination tensor's own memory (in place, no second copy). Used
  for CPU destinations whose runs are at least ``ReadOptions.small_run_bytes`` long.
* `BounceRead` -- read the file span covering the intersection into a bounded bounce
  buffer, then copy the strided part out with torch. Used for short runs separated by short
  gaps (the disk reads whole pages anyway, and a system call per few bytes would dominate),
  for non-contiguous destinations, for destinations on other devices (the buffer is
  pinned then), and for destinations of another dtype than the stored one: the buffer holds the
  stored values and the copy out converts them (`copy_cast()`).

A read may carry a `ReadCheck` (see `safetensors_blocks`): the read is then widened
to whole checksum blocks -- the extra bytes before and after a direct read land in scratch
buffers of the same ``preadv`` -- and the check sees every byte right after it is read (in the
destination for direct reads, in the bounce buffer otherwise). From a local file, a checked read
is issued in pieces of ``ReadOptions.checked_piece_bytes`` (whole blocks), each checked by the
same thread as soon as its ``preadv`` returns, while its bytes are still in the CPU cache: a
check after a whole read of tens of MiB would fetch every byte from memory a second time.

A file is read through an [`ObjectReader`][dist_ckpt.storage.base.ObjectReader], whatever the storage
([`open_reader()`][dist_ckpt.storage.base.Storage.open_reader]): on a local disk an open descriptor read
with ``os.preadv`` (``positional_reads``), on an object store ranged GETs into the same
destination buffers. Every byte read from a file goes through `read_into()`, the one place
that reads, so tests can count what a load reads. Running the operations is
`dist_ckpt.backends.safetensors.read_threads`'s job.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Iterator, List, Optional, Protocol, Sequence, Tuple, Union

import numpy as np
import torch

from dist_ckpt.errors import CheckpointingException
from dist_ckpt.model.geometry import Box
from dist_ckpt.storage import FileReader, ObjectReader, TruncatedObjectError
from dist_ckpt.storage.files import IOV_MAX

__all__ = [
    "BounceRead",
    "DirectRead",
    "ReadCheck",
    "ReadOp",
    "ReadOptions",
    "as_reader",
    "contiguous_runs",
    "plan_copy",
    "read_bytes",
    "read_into",
    "slabs",
    "src_span",
    "row_major_strides",
]


@dataclass(frozen=True)
class ReadOptions:
    """How loads read files.

    Attributes:
        thread_count: threads issuing reads (``os.preadv`` releases the GIL; more threads keep
            more requests in flight: on the 2-core test VM, 4 threads per rank loaded a cold
            1 GiB checkpoint 10-20% faster and with less variance than 2).
        bounce_buffer_bytes: size of each thread's bounce buffer, the bound on extra memory
            for reads that cannot land in place.
        small_run_bytes: runs shorter than this are read through a bounce buffer, together with
            the gaps between them, instead of one system call each.
        max_read_bytes: larger in-place reads are split, so that threads share big tensors.
        verify_checksums: check the crc32c of every checksum block a load reads, when the
            checkpoint recorded them (reading the rest of a block a load needs only part of);
            False skips the check.
        checked_piece_bytes: reads from local files that are checked are issued in pieces of
            about this many bytes (rounded down to whole checksum blocks, at least one), each
            checked right after its ``preadv``, while it is still in the CPU cache (on the
            2-core test VM the crc of a just-read piece ran at ~23 GiB/s, of bytes already
            evicted at ~12). Reads from object stores are not split (a request costs latency).
        object_store_threads: threads issuing reads when the files are objects in an object
            store (each read is a ranged GET: latency, not the disk, is the limit, so more
            requests are kept in flight than on a disk).
        object_store_small_run_bytes: ``small_run_bytes`` for object stores: a request costs
            about as much as downloading a few hundred KiB, so short runs separated by short
            gaps are fetched as one range (the gaps are downloaded and dropped).
        allow_dtype_cast: a requested dtype may differ from the stored one: the stored values
            are read through the bounce buffers and converted (see
            `dist_ckpt.model.dtype_cast`); False raises ``LoadMismatchError`` instead.
    """

    thread_count: int = 4
    bounce_buffer_bytes: int = 16 * 2**20
    small_run_bytes: int = 4096
    max_read_bytes: int = 64 * 2**20
    verify_checksums: bool = True
    checked_piece_bytes: int = 2 * 2**20
    object_store_threads: int = 16
    object_store_small_run_bytes: int = 256 * 2**10
    allow_dtype_cast: bool = True

    def __post_init__(self) -> None:
        for name in (
            "thread_count",
            "bounce_buffer_bytes",
            "max_read_bytes",
            "checked_piece_bytes",
            "object_store_threads",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointingException(f"ReadOptions.{name} must be a positive int, got {value!r}")
        for name in ("small_run_bytes", "object_store_small_run_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CheckpointingException(f"ReadOptions.{name} must be an int >= 0, got {value!r}")
        for name in ("verify_checksums", "allow_dtype_cast"):
            if not isinstance(getattr(self, name), bool):
                raise CheckpointingException(f"ReadOptions.{name} must be a bool, got {getattr(self, name)!r}")

    def for_object_store(self) -> "ReadOptions":
        """These options with the object-store thread count and run threshold in effect.

        Example:

        ```python
        ReadOptions().for_object_store().thread_count   # 16
        ```
        """
        return replace(self, thread_count=self.object_store_threads, small_run_bytes=self.object_store_small_run_bytes)


# --------------------------------------------------------------------------- the reader


def as_reader(fd: Union[ObjectReader, int]) -> ObjectReader:
    """``fd`` as a reader: a storage's reader as it is, a plain open descriptor (an ``int``, not
    closed here) as a `FileReader`."""
    return fd if isinstance(fd, ObjectReader) else FileReader(fd, owned=False)


def read_into(fd: Union[ObjectReader, int], buffers: Sequence[memoryview], offset: int) -> int:
    """Fill ``buffers`` (in order) from the file ``fd`` starting at byte ``offset``.

    The single function through which dist_ckpt reads safetensors files: ``fd`` is a storage's
    [`ObjectReader`][dist_ckpt.storage.base.ObjectReader] (``os.preadv`` on a local descriptor, ranged
    GETs on an object store); a plain open descriptor (an ``int``) is read as a
    `FileReader`. Returns the number of bytes read (their total
    size); raises `EOFError` if the file ends first.

    Example:

    ```python
    buf = bytearray(8)
    read_into(reader, [memoryview(buf)], 0)   # the 8-byte header length
    ```
    """
    try:
        return as_reader(fd).read_into(buffers, offset)
    except TruncatedObjectError as e:
        raise EOFError(str(e)) from e


def read_bytes(fd: Union[ObjectReader, int], nbytes: int, offset: int) -> bytes:
    """``nbytes`` bytes of ``fd`` at ``offset`` (through `read_into()`).

    Example:

    ```python
    header_length = int.from_bytes(read_bytes(reader, 8, 0), "little")
    ```
    """
    buf = bytearray(nbytes)
    read_into(fd, [memoryview(buf)], offset)
    return bytes(buf)


# --------------------------------------------------------------------------- geometry of runs


def row_major_strides(shape: Sequence[int]) -> List[int]:
    return [math.prod(shape[d + 1 :]) for d in range(len(shape))]


def _flat(index: Sequence[int], strides: Sequence[int]) -> int:
    return sum(i * s for i, s in zip(index, strides))


def contiguous_runs(inter: Box, src: Box, dst: Box) -> Tuple[np.ndarray, np.ndarray, int]:
    """Runs of ``inter`` that are contiguous both in ``src`` and in ``dst`` (row-major boxes).

    Returns ``(src_offsets, dst_offsets, run_length)``: element offsets of each run's start
    within the row-major ``src`` and ``dst`` boxes, in increasing order, and the common run
    length in elements. Trailing axes that ``inter`` spans completely in both boxes merge into
    one run.

    Example:

    ```python
    # columns 2..5 of rows 0..3 of a stored (4, 8) shard, into a (4, 4) destination
    contiguous_runs(Box((0, 2), (4, 4)), Box((0, 0), (4, 8)), Box((0, 2), (4, 4)))
    # -> (array([2, 10, 18, 26]), array([0, 4, 8, 12]), 4)
    ```
    """
    n = len(inter.shape)
    ss, ds = row_major_strides(src.shape), row_major_strides(dst.shape)
    s0 = _flat([i - o for i, o in zip(inter.offset, src.offset)], ss)
    d0 = _flat([i - o for i, o in zip(inter.offset, dst.offset)], ds)
    if n == 0:
        return np.array([s0], dtype=np.int64), np.array([d0], dtype=np.int64), 1
    j = n - 1
    while j > 0 and inter.shape[j] == src.shape[j] == dst.shape[j]:
        j -= 1
    run = math.prod(inter.shape[j:])
    src_off = np.array([s0], dtype=np.int64)
    dst_off = np.array([d0], dtype=np.int64)
    for d in range(j):
        steps = np.arange(inter.shape[d], dtype=np.int64)
        src_off = (src_off[:, None] + steps[None, :] * ss[d]).reshape(-1)
        dst_off = (dst_off[:, None] + steps[None, :] * ds[d]).reshape(-1)
    return src_off, dst_off, run


def src_span(box: Box, src: Box) -> Tuple[int, int]:
    """``(first, count)``: the element range of the row-major ``src`` box that covers ``box``."""
    ss = row_major_strides(src.shape)
    first = _flat([b - s for b, s in zip(box.offset, src.offset)], ss)
    last = _flat([b + n - 1 - s for b, n, s in zip(box.offset, box.shape, src.offset)], ss)
    return first, last - first + 1


def slabs(box: Box, src: Box, limit: int) -> Iterator[Box]:
    """Split ``box`` into sub-boxes whose span in ``src`` is at most ``limit`` elements."""
    if src_span(box, src)[1] <= limit or box.numel <= 1:
        yield box
        return
    axis = next(d for d, n in enumerate(box.shape) if n > 1)
    row_shape = box.shape[:axis] + (1,) + box.shape[axis + 1 :]
    row_span = src_span(Box(box.offset, row_shape), src)[1]
    stride = row_major_strides(src.shape)[axis]
    rows = 1 if row_span > limit else 1 + (limit - row_span) // stride
    for start in range(0, box.shape[axis], rows):
        count = min(rows, box.shape[axis] - start)
        offset = box.offset[:axis] + (box.offset[axis] + start,) + box.offset[axis + 1 :]
        sub = Box(offset, box.shape[:axis] + (count,) + box.shape[axis + 1 :])
        if rows == 1 and row_span > limit:
            yield from slabs(sub, src, limit)
        else:
            yield sub


# --------------------------------------------------------------------------- read operations


class ReadCheck(Protocol):
    """Checks bytes right after they are read (e.g. their checksums), in whole blocks.

    Reads that skip gaps shorter than ``block_bytes`` are read whole through a bounce buffer
    instead (the check needs the gaps' bytes anyway).
    """

    @property
    def block_bytes(self) -> int:
        """Size of the blocks checked."""

    def widen(self, start: int, stop: int) -> Tuple[int, int]:
        """The byte range to read so that ``[start, stop)`` is checkable (whole blocks)."""

    def after_read(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """``buffers`` (in order) hold the file's bytes from ``offset`` on, whole blocks (a range
        returned by `widen()`, or a piece of one cut at block boundaries); raise if they are bad."""


@dataclass(frozen=True)
class DirectRead:
    """Read ``nbytes`` at ``offset`` of ``fd`` into ``buffers`` (views of the destination)."""

    fd: ObjectReader
    path: str
    key: str
    offset: int
    buffers: Tuple[memoryview, ...]
    nbytes: int
    check: Optional[ReadCheck] = None


@dataclass(frozen=True)
class BounceRead:
    """Copy ``inter`` from the row-major ``src_box`` stored at ``src_offset`` of ``fd`` into
    ``target`` (a view of the destination holding exactly ``inter``), via a bounce buffer; the
    stored values are of ``src_dtype`` (None: the target's dtype) and converted by the copy."""

    fd: ObjectReader
    path: str
    key: str
    src_offset: int
    src_box: Box
    inter: Box
    target: torch.Tensor
    check: Optional[ReadCheck] = None
    src_dtype: Optional[torch.dtype] = None

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype of the values in the file."""
        return self.target.dtype if self.src_dtype is None else self.src_dtype

    @property
    def nbytes(self) -> int:
        return self.inter.numel * self.target.element_size()


ReadOp = Union[DirectRead, BounceRead]


def byte_view(tensor: torch.Tensor) -> Optional[memoryview]:
    """A writable byte view of a contiguous CPU tensor's memory, else None."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    return tensor.detach().reshape(-1).view(torch.uint8).numpy().data


def plan_copy(
    fd: Union[ObjectReader, int],
    path: str,
    key: str,
    src_box: Box,
    src_offset: int,
    inter: Box,
    dst_box: Box,
    dst_base: int,
    dest_bytes: Optional[memoryview],
    target: torch.Tensor,
    options: ReadOptions,
    check: Optional[ReadCheck] = None,
    src_dtype: Optional[torch.dtype] = None,
) -> List[ReadOp]:
    """The reads that copy ``inter`` from a stored box into a destination box.

    Args:
        fd, path: the open file and its name (for errors).
        key: the tensor's checkpoint key (for errors).
        src_box: the stored box, row-major at byte ``src_offset`` of the file.
        inter: the part to copy (inside both boxes).
        dst_box: the destination box, row-major from element ``dst_base`` of the destination.
        dest_bytes: byte view of the whole destination, or None if it cannot be read into
            directly (not a contiguous CPU tensor).
        target: view of the destination holding exactly ``inter`` (for bounce reads).
        options: thresholds.
        check: sees the bytes of every read (see `ReadCheck`).
        src_dtype: the stored dtype, when it differs from ``target``'s: every byte then goes
            through a bounce buffer and is converted on the way out.

    Example:

    ```python
    # rows 2..3 of a (4, 8) float32 shard stored at byte 128, into a (2, 8) tensor
    dest = torch.empty(2, 8)
    ops = plan_copy(fd, path, "w", Box((0, 0), (4, 8)), 128, Box((2, 0), (2, 8)), Box((2, 0), (2, 8)), 0,
                    byte_view(dest), dest, ReadOptions())
    execute(ops, ReadOptions())
    ```
    """
    fd = as_reader(fd)
    if src_dtype is not None and src_dtype != target.dtype:
        return _cast_reads(fd, path, key, src_box, src_offset, inter, target, options, check, src_dtype)
    itemsize = target.element_size()
    src_off, dst_off, run = contiguous_runs(inter, src_box, dst_box)
    run_bytes = run * itemsize
    if (
        dest_bytes is None
        or _read_through(src_off, run, itemsize, options.small_run_bytes)
        or (check is not None and _gaps_inside_blocks(src_off, run, itemsize, check.block_bytes))
    ):
        return [BounceRead(fd, path, key, src_offset, src_box, inter, target, check)]
    src_bytes = (src_offset + src_off * itemsize).tolist()
    dst_bytes = ((dst_base + dst_off) * itemsize).tolist()
    reads = _direct_reads(fd, path, key, src_bytes, dst_bytes, run_bytes, dest_bytes, options.max_read_bytes, check)
    return list(reads)


def _cast_reads(
    fd: ObjectReader,
    path: str,
    key: str,
    src_box: Box,
    src_offset: int,
    inter: Box,
    target: torch.Tensor,
    options: ReadOptions,
    check: Optional[ReadCheck],
    src_dtype: torch.dtype,
) -> List[ReadOp]:
    """The reads of a copy into another dtype: through the bounce buffers, which hold the stored
    values until the copy out converts them. Runs that a direct read would fetch one by one
    (long runs, or long gaps between them) are bounced one by one too, so a cast reads the same
    bytes as a load in the stored dtype; short runs with short gaps are read through as one span."""
    itemsize = src_dtype.itemsize
    src_off, _, run = contiguous_runs(inter, src_box, inter)
    if (
        len(src_off) < 2
        or _read_through(src_off, run, itemsize, options.small_run_bytes)
        or (check is not None and _gaps_inside_blocks(src_off, run, itemsize, check.block_bytes))
    ):
        return [BounceRead(fd, path, key, src_offset, src_box, inter, target, check, src_dtype)]
    axis = len(inter.shape) - 1  # the first axis of a run: runs span the trailing axes from it
    while axis > 0 and math.prod(inter.shape[axis:]) < run:
        axis -= 1
    reads: List[ReadOp] = []
    for index in itertools.product(*(range(n) for n in inter.shape[:axis])):
        box = Box(
            tuple(o + i for o, i in zip(inter.offset, index)) + inter.offset[axis:], (1,) * axis + inter.shape[axis:]
        )
        reads.append(
            BounceRead(fd, path, key, src_offset, src_box, box, target[box.slices_within(inter)], check, src_dtype)
        )
    return reads


def _gaps_inside_blocks(src_off: np.ndarray, run: int, itemsize: int, block_bytes: int) -> bool:
    """Whether the runs are separated by gaps shorter than a checksum block: every block the
    runs touch must then be read whole to be checked, so one read through the span (a bounce
    read) reads each byte once instead of the runs and then the blocks again."""
    if len(src_off) < 2:
        return False
    largest_gap = (int(np.max(np.diff(src_off))) - run) * itemsize
    return 0 < largest_gap < block_bytes


def _read_through(src_off: np.ndarray, run: int, itemsize: int, small: int) -> bool:
    """Whether short runs separated by short gaps are better read as one span: the disk reads
    whole pages anyway, and one system call per few bytes would dominate."""
    if len(src_off) < 2 or run * itemsize >= small:
        return False
    largest_gap = int(np.max(np.diff(src_off))) - run
    return largest_gap * itemsize <= small


def _direct_reads(
    fd: ObjectReader,
    path: str,
    key: str,
    src_bytes: Sequence[int],
    dst_bytes: Sequence[int],
    run_bytes: int,
    dest: memoryview,
    max_bytes: int,
    check: Optional[ReadCheck] = None,
) -> Iterator[DirectRead]:
    """Group runs into reads: consecutive runs that are contiguous in the file share one
    ``preadv`` (one buffer per stretch of the destination), up to ``max_bytes`` and
    ``_IOV_MAX`` buffers per read; longer runs are split."""
    spans: List[List[int]] = []  # [start, end) byte ranges of the destination, in file order
    size = start = expect = 0

    def flush() -> DirectRead:
        return DirectRead(fd, path, key, start, tuple(dest[a:b] for a, b in spans), size, check)

    for src, dst in zip(src_bytes, dst_bytes):
        done = 0
        while done < run_bytes:
            if spans and (src + done != expect or size >= max_bytes or len(spans) >= IOV_MAX):
                yield flush()
                spans, size = [], 0
            if not spans:
                start = src + done
            take = min(run_bytes - done, max_bytes - size)
            if spans and spans[-1][1] == dst + done:
                spans[-1][1] += take
            else:
                spans.append([dst + done, dst + done + take])
            size += take
            done += take
            expect = src + done
    if spans:
        yield flush()
