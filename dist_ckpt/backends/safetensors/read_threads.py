"""Running read operations on a few threads: the second half of a load's reads.

`dist_ckpt.backends.safetensors.io` plans the reads (`DirectRead`, `BounceRead`); `execute()`
runs them on ``ReadOptions.thread_count`` threads (``os.preadv`` and the S3 client release the
GIL), which take them from a queue while later ones are still being planned. Each thread owns a
bounce buffer (pinned for GPU destinations) and checks the bytes of checked reads piece by
piece, right after each piece is read (see `ReadCheck`).

Every byte still goes through [`read_into()`][dist_ckpt.backends.safetensors.io.read_into], called
through its module so that a test that counts reads sees these too.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from dist_ckpt.backends.safetensors import io as safetensors_io
from dist_ckpt.backends.safetensors.io import (
    BounceRead,
    DirectRead,
    ReadCheck,
    ReadOp,
    ReadOptions,
    row_major_strides,
    slabs,
    src_span,
)
from dist_ckpt.errors import CorruptCheckpointError
from dist_ckpt.model.dtype_cast import copy_cast
from dist_ckpt.storage import ObjectReader

__all__ = ["execute"]


class _Worker:
    """Runs reads; owns one bounce buffer, allocated on first use (pinned for GPU targets)."""

    def __init__(self, options: ReadOptions) -> None:
        self.options = options
        self._buffer: Optional[torch.Tensor] = None
        self._edges = bytearray()  # the extra bytes of widened direct reads

    def buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes or (pinned and not self._buffer.is_pinned()):
            size = max(nbytes, min(self.options.bounce_buffer_bytes, 1 << 20))
            self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        return self._buffer

    def run(self, op: ReadOp) -> None:
        try:
            if isinstance(op, DirectRead):
                if op.check is None:
                    safetensors_io.read_into(op.fd, op.buffers, op.offset)
                else:
                    self._checked_direct(op, op.check)
            else:
                self._bounce(op)
        except EOFError as e:
            raise CorruptCheckpointError(
                f"tensor {op.key!r}: safetensors file {str(op.path)!r} is truncated: {e}"
            ) from e

    def _checked_direct(self, op: DirectRead, check: ReadCheck) -> None:
        """A direct read widened to whole blocks: the extra bytes before and after go to scratch
        buffers in the same ``preadv``, then every byte is checked."""
        start, stop = check.widen(op.offset, op.offset + op.nbytes)
        head, tail = op.offset - start, stop - op.offset - op.nbytes
        if len(self._edges) < head + tail:
            self._edges = bytearray(head + tail)
        edges = memoryview(self._edges)
        self._read_checked(op.fd, [edges[:head], *op.buffers, edges[head : head + tail]], start, check)

    def _read_checked(self, fd: ObjectReader, buffers: Sequence[memoryview], offset: int, check: ReadCheck) -> None:
        """Fill ``buffers`` from byte ``offset`` of ``fd`` (a range of whole blocks) and check
        every byte: with positional reads (a local file) in pieces of whole blocks, each checked
        right after it is read (still in the CPU cache); from an object in one request, checked
        after."""
        if not fd.positional:
            safetensors_io.read_into(fd, buffers, offset)
            check.after_read(offset, buffers)
            return
        step = max(1, self.options.checked_piece_bytes // check.block_bytes) * check.block_bytes
        for piece_offset, piece in _pieces(buffers, offset, step):
            safetensors_io.read_into(fd, piece, piece_offset)
            check.after_read(piece_offset, piece)

    def _bounce(self, op: BounceRead) -> None:
        itemsize = op.stored_dtype.itemsize
        limit = max(1, self.options.bounce_buffer_bytes // itemsize)
        src_strides = row_major_strides(op.src_box.shape)
        pinned = op.target.is_cuda and torch.cuda.is_available()
        for slab in slabs(op.inter, op.src_box, limit):
            first, count = src_span(slab, op.src_box)
            lo = op.src_offset + first * itemsize
            start, stop = (lo, lo + count * itemsize) if op.check is None else op.check.widen(lo, lo + count * itemsize)
            # the values must start at a multiple of their size in the buffer, wherever the
            # widened read starts
            pad = -(lo - start) % itemsize
            whole = self.buffer(pad + stop - start, pinned)[pad : pad + stop - start]
            if op.check is None:
                safetensors_io.read_into(op.fd, [whole.numpy().data], start)
            else:
                self._read_checked(op.fd, [whole.numpy().data], start, op.check)
            buf = whole[lo - start : lo - start + count * itemsize]
            values = buf.view(op.stored_dtype)
            stored = values.as_strided(slab.shape, tuple(src_strides), values.storage_offset())
            copy_cast(op.target[slab.slices_within(op.inter)], stored)


def _pieces(buffers: Sequence[memoryview], offset: int, step: int) -> Iterator[Tuple[int, List[memoryview]]]:
    """``buffers`` (holding a file's bytes from ``offset`` on) cut at every ``step`` bytes:
    ``(file offset, views)`` of each piece, in order."""
    piece: List[memoryview] = []
    room = step
    for buf in buffers:
        while len(buf):
            take = min(room, len(buf))
            piece.append(buf[:take])
            buf = buf[take:]
            room -= take
            if room == 0:
                yield offset, piece
                offset += step
                piece, room = [], step
    if piece:
        yield offset, piece


def execute(ops: Iterable[ReadOp], options: ReadOptions) -> int:
    """Run ``ops`` on ``options.thread_count`` threads as they are produced; return the bytes copied.

    ``ops`` may be a generator: the threads start reading the first operations while the caller
    is still planning later ones, so planning overlaps I/O. Each thread takes the next operation
    from a shared queue, which balances the load. After a failure no further operation starts;
    the first failure is raised once every thread has stopped.

    Example:

    ```python
    copied = execute(ops, ReadOptions(thread_count=4))
    ```
    """
    total = 0
    if options.thread_count == 1:
        worker = _Worker(options)
        for op in ops:
            worker.run(op)
            total += op.nbytes
        return total
    pending: "queue.SimpleQueue[Optional[ReadOp]]" = queue.SimpleQueue()
    errors: List[BaseException] = []
    failed = threading.Event()

    def work() -> None:
        worker = _Worker(options)
        while True:
            op = pending.get()
            if op is None:
                return
            if failed.is_set():
                continue
            try:
                worker.run(op)
            except BaseException as e:  # noqa: BLE001 -- re-raised by the calling thread
                errors.append(e)
                failed.set()

    threads = [
        threading.Thread(target=work, name=f"dist_ckpt_read_{i}", daemon=True) for i in range(options.thread_count)
    ]
    for t in threads:
        t.start()
    try:
        for op in ops:
            if failed.is_set():
                break
            pending.put(op)
            total += op.nbytes
    finally:
        for _ in threads:
            pending.put(None)
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return total
