"""Checking the crc32c blocks of safetensors shards as a load reads them.

A version-2 index records a crc per block of each shard's byte range (see
`safetensors_index`). A load hands each read from such a shard a `ShardCheck` (a
`ReadCheck`): the read is widened to whole blocks
(`ShardCheck.widen()` -- the extra bytes land in scratch buffers, never in the destination),
and every block in it is checked from the bytes just read, with no further I/O (from local files
piece by piece, each piece right after its ``preadv``, while it is still in the CPU cache). A load
therefore reads at most the blocks it touches: for each contiguous range, at most one
block's worth of extra bytes at each end; reads that skip gaps shorter than a block read through
the gaps instead (see `plan_copy()`).

Whole checkpoints are checked by `safetensors_verify`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Tuple, Union

import numpy as np

from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import CheckpointingException, ChecksumMismatchError
from dist_ckpt.integrity.checksums import crc32c, crc_to_hex

__all__ = ["ShardCheck"]


@dataclass(frozen=True)
class ShardCheck:
    """Checks the blocks of one stored shard in the bytes of reads from it.

    Attributes:
        path: the file or object (for messages).
        key: the tensor's key (for messages).
        name: the shard's name in the file (for messages).
        begin: start of the shard's byte range in the file.
        end: end of the shard's byte range.
        block_bytes: checksum block size.
        crcs: the recorded crc of each block.

    Example:

    ```python
    check = ShardCheck(path, "w", "w@0.0", 128, 128 + 4096, 1024, crcs)
    check.widen(1000, 2000)            # (128, 2176): blocks 0 and 1
    check.after_read(128, [buffer])    # raises ChecksumMismatchError on a mismatch
    ```
    """

    path: Union[str, Path]
    key: str
    name: str
    begin: int
    end: int
    block_bytes: int
    crcs: Tuple[int, ...]

    def span(self, j: int) -> Tuple[int, int]:
        """Absolute byte span of block ``j``."""
        start = self.begin + j * self.block_bytes
        return start, min(start + self.block_bytes, self.end)

    def widen(self, start: int, stop: int) -> Tuple[int, int]:
        """``[start, stop)`` extended to the blocks it touches."""
        if not self.begin <= start < stop <= self.end:
            raise CheckpointingException(
                f"tensor {self.key!r}: read {start}:{stop} of {str(self.path)!r} lies outside shard "
                f"{self.name!r} ({self.begin}:{self.end})"
            )
        first = (start - self.begin) // self.block_bytes
        last = (stop - 1 - self.begin) // self.block_bytes
        return self.span(first)[0], self.span(last)[1]

    def after_read(self, offset: int, buffers: Sequence[memoryview]) -> None:
        """Check every block of ``[offset, offset + total)``, which must be whole blocks."""
        total = sum(len(b) for b in buffers)
        start, stop = self.widen(offset, offset + total)
        if (start, stop) != (offset, offset + total):
            raise CheckpointingException(
                f"tensor {self.key!r}: read {offset}:{offset + total} of {str(self.path)!r} is not made of whole "
                f"checksum blocks (widen it first)"
            )
        cursor = _Cursor(buffers, offset)
        for j in range((start - self.begin) // self.block_bytes, (stop - 1 - self.begin) // self.block_bytes + 1):
            self.compare(j, cursor.crc(*self.span(j)))

    def compare(self, j: int, found: int) -> None:
        """Raise [`ChecksumMismatchError`][dist_ckpt.errors.ChecksumMismatchError] unless block ``j`` has crc
        ``found``."""
        if found != self.crcs[j]:
            start, stop = self.span(j)
            raise ChecksumMismatchError(
                f"[rank {get_rank()}] tensor {self.key!r}: bytes {start}:{stop} of safetensors file "
                f"{str(self.path)!r} (block {j} of shard {self.name!r}) have crc32c {crc_to_hex(found)}, "
                f"the index recorded {crc_to_hex(self.crcs[j])}: the file is corrupt"
            )


class _Cursor:
    """crcs of consecutive, increasing byte spans of buffers that hold a file's bytes from
    ``offset`` on (one pass over the buffers)."""

    def __init__(self, buffers: Sequence[memoryview], offset: int) -> None:
        self.buffers = buffers
        self.index = 0
        self.base = offset  # file offset of buffers[index]

    def crc(self, start: int, stop: int) -> int:
        crc = 0
        while start < stop:
            buf = self.buffers[self.index]
            end = self.base + len(buf)
            if start >= end:
                self.base = end
                self.index += 1
                continue
            take = min(stop, end) - start
            crc = crc32c(np.frombuffer(buf, dtype=np.uint8, count=take, offset=start - self.base), crc)
            start += take
        return crc
