"""Writing an async save's snapshot into its files while the snapshot is still being taken.

An async save blocks the caller for a copy of the shards (the snapshot) and writes the copy in a
background process. Written only after the copy, the save takes the copy's time plus the disk's,
where a sync save takes the disk's alone. So, on a local file system that takes ``O_DIRECT``
writes, the training process hands each stretch of the snapshot to the disk as soon as it is
copied: `EarlyWriter` runs a thread that writes it with ``O_DIRECT``
(`dist_ckpt.storage.direct_io`: the disk reads the memory itself, the CPU copies nothing, and
the thread needs the GIL only between writes of `STREAM_CHUNK_BYTES`), and that keeps going
after ``save`` returns until every byte is written.

Meanwhile the background process computes the checksums from the snapshot. Before it fsyncs the
files, it waits (`wait_for_early_writes()`) for the thread's word on a pipe whose read end
travels with the request (`PassedFd`): a line saying ``ok`` or the error that stopped the
writes, or end-of-file if the training process ended first -- so a save is durable and
committed only once every byte of it was written. Before that line the thread sends a mark
for each piece written, which the waiting process notes as progress
(`dist_ckpt.asynchronous.progress`): however long the disk takes, it is not taken for a hung one.

Where a file system takes ``O_DIRECT`` opens but refuses the writes, `direct_io.write_at()`
writes through the page cache instead, from this thread: correct, at the CPU cost of a
buffered write.

Example:

```python
early = EarlyWriter(regions, slot_regions)
snapshot = pool.take(tensors, in_use=lambda: not outcome.done or early.busy,
                     layout=layout, on_copied=early.copied)
early.finish()                           # the copy is done: the thread drains and reports
...                                         # in the background process:
wait_for_early_writes(early.status, "ckpt/safetensors")
```
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

from dist_ckpt.asynchronous.channel import PassedFd
from dist_ckpt.asynchronous.progress import note_progress
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.storage import direct_io
from dist_ckpt.storage.direct_io import DIRECT_IO_ALIGN, open_direct
from dist_ckpt.storage.errors import StorageError, write_failed

__all__ = ["STREAM_CHUNK_BYTES", "EarlyRegion", "EarlyWriter", "wait_for_early_writes"]

logger = logging.getLogger(__name__)

#: the thread writes once this many bytes of a region are copied (and not yet written): large
#: enough that the disk is busy while the thread waits for the GIL, small enough that the disk
#: starts early in the copy
STREAM_CHUNK_BYTES = 16 << 20

#: the thread's report, one line: this, or the error; before it, this mark for each piece written
#: (a control character no report contains)
_OK = "ok"
_PIECE_MARK = b"\x06"
#: the longest report sent (a pipe write of up to PIPE_BUF bytes is atomic and never blocks)
_MAX_REPORT = 4000
#: how a report starts that tells of a write the file system refused, followed by its ``errno``
_FAILED_WRITE = "write failed: errno "

#: the writers whose thread may still report: a forked child closes its copy of their pipes, so
#: that the end-of-file the waiting process relies on is the training process's alone
_LIVE: "weakref.WeakSet[EarlyWriter]" = weakref.WeakSet()


def _close_pipes_in_child() -> None:
    for writer in list(_LIVE):
        writer._close_report_pipe()


@functools.lru_cache(maxsize=None)
def _close_pipes_in_forked_children() -> None:
    """Have every later fork of this process run `_close_pipes_in_child()` (registered once, by
    the first `EarlyWriter`, not when the module is imported)."""
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_close_pipes_in_child)


@dataclass(frozen=True)
class EarlyRegion:
    """Bytes ``begin:end`` of the snapshot buffer, which go to ``path`` from ``file_offset`` on."""

    path: Path
    file_offset: int
    begin: int
    end: int


class EarlyWriter:
    """A thread that writes regions of a snapshot to their files as the copy reports each tensor
    done (`copied()`), then reports on `status` (a pipe).

    The files are opened here, before the copy starts: the thread writes only into this save's
    files, even if they are later replaced under the same name.

    Args:
        regions: where each region of the buffer goes; each region's file exists already.
        slot_regions: per snapshot slot (tensor), the index of its region and the buffer offset
            where it ends.
    """

    def __init__(self, regions: Sequence[EarlyRegion], slot_regions: Sequence[Tuple[int, int]]) -> None:
        self._regions = list(regions)
        self._slot_regions = list(slot_regions)
        self._sent = [r.begin for r in self._regions]
        self._jobs: "queue.SimpleQueue[Optional[Tuple[int, int, int]]]" = queue.SimpleQueue()
        self._view: Optional[memoryview] = None
        self._aborted: Optional[str] = None
        self._fds: List[Tuple[int, Optional[int]]] = []
        try:
            for region in self._regions:
                fd = os.open(region.path, os.O_WRONLY)
                self._fds.append((fd, None))
                self._fds[-1] = (fd, open_direct(region.path))
        except BaseException:
            self._close_files()
            raise
        _close_pipes_in_forked_children()
        read_end, self._report_fd = os.pipe()
        #: the pipe's read end, for the process that waits for the writes (see the module)
        self.status = PassedFd(read_end)
        _LIVE.add(self)
        self._thread = threading.Thread(target=self._run, name="dist_ckpt_early_writes", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether the thread may still read the snapshot buffer."""
        return self._thread.is_alive()

    def copied(self, buffer: torch.Tensor, slot: int) -> None:
        """Tensor ``slot`` is in ``buffer``: queue what of its region is ready to be written (at
        least `STREAM_CHUNK_BYTES`, ending at a block boundary of the file, or the region's rest)."""
        if self._view is None:
            self._view = buffer.numpy().data
        r, end = self._slot_regions[slot]
        region = self._regions[r]
        if end >= region.end:
            stop = region.end
        else:
            stop = end - (region.file_offset + end - region.begin) % DIRECT_IO_ALIGN
            if stop - self._sent[r] < STREAM_CHUNK_BYTES:
                return
        if stop > self._sent[r]:
            self._jobs.put((r, self._sent[r], stop))
            self._sent[r] = stop

    def finish(self) -> None:
        """Every tensor is copied: the thread writes what is queued, reports, and ends."""
        self._jobs.put(None)

    def abort(self, reason: str) -> None:
        """The snapshot was not completed: the thread writes nothing more and reports ``reason``."""
        self._aborted = reason
        self._jobs.put(None)

    def _run(self) -> None:
        error: Optional[str] = None
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    break
                if error is not None or self._aborted is not None:
                    continue  # drained: nothing more is written after a failure
                r, start, stop = job
                region = self._regions[r]
                offset = region.file_offset + start - region.begin
                try:
                    assert self._view is not None
                    direct_io.write_at(*self._fds[r], self._view[start:stop], offset)
                except OSError as e:  # the file system refused: the waiter raises a StorageError
                    failed = write_failed(e, str(region.path), stop - start, offset=offset)
                    error = f"{_FAILED_WRITE}{failed.errno or 0} {failed}"
                except Exception as e:  # noqa: BLE001 -- reported on the pipe, raised by the waiter
                    error = f"{type(e).__name__} writing {region.path}: {e}"
                else:
                    self._send(_PIECE_MARK)
        finally:
            closing = self._close_files()  # always: an open descriptor keeps a deleted file's space
            error = error or closing or self._aborted
            self._view = None
            self._send(_report_line(error or _OK))
            self._close_report_pipe()

    def _close_files(self) -> Optional[str]:
        problem = None
        for fds in self._fds:
            for fd in fds:
                if fd is None:
                    continue
                try:
                    os.close(fd)
                except OSError as e:
                    problem = problem or f"{type(e).__name__} closing a file of the snapshot: {e}"
        self._fds = []
        return problem

    def _send(self, data: bytes) -> None:
        try:
            os.write(self._report_fd, data)
        except OSError:  # nobody waits any more (the request was dropped), or a forked child
            pass

    def _close_report_pipe(self) -> None:
        fd, self._report_fd = self._report_fd, -1
        _LIVE.discard(self)
        if fd >= 0:
            os.close(fd)


def _report_line(text: str) -> bytes:
    """``text`` as the report: one line, without piece marks, short enough to be sent at once."""
    line = text.replace("\n", " ").replace(_PIECE_MARK.decode(), " ")
    return line.encode("utf-8", "replace")[:_MAX_REPORT] + b"\n"


def wait_for_early_writes(status: PassedFd, where: str) -> None:
    """Block until the training process's `EarlyWriter` reports; raise
    `CheckpointingException` unless it wrote every byte (a `StorageError`, with the ``errno``,
    where the file system refused a write). Notes progress for each piece written.
    ``where``: what was written, for the message."""
    report = b""
    while not report.endswith(b"\n"):
        data = os.read(status.fd, 1 << 16)
        if not data:
            break
        for _ in range(data.count(_PIECE_MARK)):
            note_progress()
        report += data.replace(_PIECE_MARK, b"")
    line = report.decode("utf-8", "replace").strip()
    if line == _OK:
        return
    problem = line or "the training process ended before its writes finished"
    message = f"writing the snapshot into {where} from the training process failed: "
    if problem.startswith(_FAILED_WRITE):
        code, _, text = problem[len(_FAILED_WRITE) :].partition(" ")
        error = StorageError(message + text, url=where, operation="write")
        error.errno = int(code) or None
        raise error
    raise CheckpointingException(message + problem)
