"""Checking a DCP item's recorded crc32c on the bytes DCP reads, as it reads them.

DCP's file reader hands ``torch.load`` a view of each item's bytes; ``torch.load`` reads the
archive's headers and pickle in small pieces, out of order, and the tensor's data record in one
call, straight into the tensor it returns. `CheckedView` sits between the two: every read
feeds an `ItemCheck` with the bytes just read (still in the CPU's cache), which extends the crc
of each span the read continues in order. The save gave the data record a span of its own (see
`checksums`), so the record's bytes are checked where they land -- no second read of the item,
no second copy, no memory map. `ItemCheck.finish()` then reads from the file only what the reads
did not cover in order (the headers' few hundred bytes, from the page cache) and compares every
span with the manifest, before DCP uses the item's values.

Checkpoints whose manifest has one span per item (written before the data record had a span of
its own) are checked the same way: the whole item is then read a second time by `finish()`.

Example:

```python
check = ItemCheck(spans, "ckpt/__0_0.distcp", "item at byte 0")
tensor = torch.load(CheckedView(dcp_view, item_offset, check), weights_only=True)
check.finish(file.fileno())          # raises ChecksumMismatchError on a damaged byte
```
"""

from __future__ import annotations

import io
import os
from typing import Any, List, Sequence

from dist_ckpt.backends.torch_dist.checksums import Span
from dist_ckpt.errors import ChecksumMismatchError, CorruptCheckpointError
from dist_ckpt.integrity.checksums import crc32c, crc_to_hex

__all__ = ["CheckedView", "ItemCheck"]

#: most bytes `ItemCheck.finish` reads at once
_READ_BYTES = 16 << 20


class ItemCheck:
    """The crc32c check of one item's spans (absolute file offsets, tiling the item).

    Reads of the item, in any order, are passed to `feed()`; each span's crc is extended by the
    bytes that continue it in order. `finish()` reads the rest of each span from the file and
    raises if a crc differs from the recorded one.

    Args:
        spans: the item's spans, in file order.
        where: the file's path or URL (for errors).
        what: the item (for errors).
    """

    def __init__(self, spans: Sequence[Span], where: str, what: str) -> None:
        self._spans = list(spans)
        self._done: List[int] = [0] * len(self._spans)
        self._crcs: List[int] = [0] * len(self._spans)
        self._where = where
        self._what = what

    def feed(self, offset: int, data: Any) -> None:
        """Bytes just read from absolute ``offset`` of the file (any buffer)."""
        view = memoryview(data).cast("B")
        end = offset + len(view)
        for i, (start, length, _) in enumerate(self._spans):
            at = start + self._done[i]
            stop = min(end, start + length)
            if offset <= at < stop:
                self._crcs[i] = crc32c(view[at - offset : stop - offset], self._crcs[i])
                self._done[i] = stop - start

    def finish(self, fd: int) -> None:
        """Read from ``fd`` what the reads did not cover, then compare every span.

        Raises:
            CorruptCheckpointError: the file ends inside the item (truncated).
            ChecksumMismatchError: a span's bytes differ from what was saved.
        """
        for i, (start, length, recorded) in enumerate(self._spans):
            while self._done[i] < length:
                at = start + self._done[i]
                chunk = os.pread(fd, min(_READ_BYTES, length - self._done[i]), at)
                if not chunk:
                    raise CorruptCheckpointError(
                        f"{self._what}: {self._where} ends at byte {at}, inside an item recorded at "
                        f"{start}:{start + length} (truncated)"
                    )
                self._crcs[i] = crc32c(chunk, self._crcs[i])
                self._done[i] += len(chunk)
            if self._crcs[i] != recorded:
                raise ChecksumMismatchError(
                    f"{self._what}: bytes {start}:{start + length} of {self._where} have crc32c "
                    f"{crc_to_hex(self._crcs[i])}, {crc_to_hex(recorded)} was recorded at save time: "
                    f"the file is corrupt"
                )


class CheckedView(io.RawIOBase):
    """A read-only, seekable view of one item (DCP's view of it) that feeds an `ItemCheck`
    with every byte read through it.

    Args:
        view: DCP's view of the item (positions relative to the item).
        offset: the item's offset in its file.
        check: the item's check.
    """

    def __init__(self, view: Any, offset: int, check: ItemCheck) -> None:
        super().__init__()
        self._view = view
        self._offset = offset
        self._check = check
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        self._view.seek(pos, whence)
        if whence == os.SEEK_SET:
            self._pos = pos
        elif whence == os.SEEK_CUR:
            self._pos += pos
        else:
            self._pos = self._view.tell()
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = self._view.readinto(buffer)
        if n:
            self._check.feed(self._offset + self._pos, memoryview(buffer).cast("B")[:n])
            self._pos += n
        return int(n or 0)

    def read(self, size: int = -1) -> bytes:
        data: bytes = self._view.read(size)
        self._check.feed(self._offset + self._pos, data)
        self._pos += len(data)
        return data
