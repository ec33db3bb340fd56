"""``dist-ckpt verify`` for the safetensors backend: every file, header and checksum block.

`verify_safetensors()` reads the whole checkpoint once: each file the index lists must exist
with its recorded size, hold a valid header that agrees with the index (and whose bytes have the
recorded crc), and every block of every shard must have its recorded crc32c. Every problem
becomes one line of the report; nothing is raised for a damaged checkpoint.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from dist_ckpt.backends.safetensors.format import read_header
from dist_ckpt.backends.safetensors.index import INDEX_FILENAME, SAFETENSORS_DIR, read_index
from dist_ckpt.backends.safetensors.io import read_into
from dist_ckpt.backends.safetensors.load import default_file_check
from dist_ckpt.backends.safetensors.tensor_index import StoredShard, TensorIndex
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.integrity.checksums import IntegrityReport, crc32c, crc_to_hex
from dist_ckpt.storage import ObjectReader
from dist_ckpt.storage.location import LocationLike

__all__ = ["verify_safetensors"]


def verify_safetensors(checkpoint_dir: LocationLike, read_bytes: int = 16 << 20) -> IntegrityReport:
    """Check every file and every checksum block of a safetensors-backend checkpoint.

    Never raises for a damaged checkpoint: every problem found becomes one line of the report
    (a missing file, a wrong size, a damaged header, a block whose crc differs).

    Example:

    ```python
    report = verify_safetensors("ckpt/iter_1000")
    for problem in report.problems: print(problem)
    ```
    """
    report = IntegrityReport()
    index_rel = f"{SAFETENSORS_DIR}/{INDEX_FILENAME}"
    try:
        index = read_index(checkpoint_dir)
    except CheckpointingException as e:
        report.add(index_rel, str(e))
        return report
    report.files_checked += 1
    if index.block_bytes is None:
        report.notes.append(f"{index_rel} records no checksums: only sizes and headers were checked")
    by_file: Dict[str, List[Tuple[str, StoredShard]]] = {}
    for tensor_key, tensor in index.tensors.items():
        try:
            stored = tensor.shards  # index version 3: reads and checks the tensor's rows of the shard table
        except CheckpointingException as e:
            report.add(index_rel, str(e), tensor_key)
            continue
        for shard in stored:
            by_file.setdefault(shard.file, []).append((tensor_key, shard))
    for name in sorted(index.file_sizes):
        _verify_file(index, name, by_file.get(name, []), report, read_bytes)
    return report


def _verify_file(
    index: TensorIndex, name: str, shards: List[Tuple[str, StoredShard]], report: IntegrityReport, read_bytes: int
) -> None:
    """One file the index lists: present, its header valid and as recorded, every block's crc."""
    rel = f"{SAFETENSORS_DIR}/{name}"
    keys = sorted({k for k, _ in shards})
    key: Optional[str] = keys[0] if len(keys) == 1 else None
    path = index.file_location(name)
    missing = f"missing (holds tensors {keys})" if keys else "missing"
    try:
        reader = index.storage.open_reader(name)
    except FileNotFoundError:
        report.add(rel, missing, key)
        return
    except CheckpointingException as e:  # e.g. a link that leads out of the checkpoint
        report.files_checked += 1
        report.add(rel, str(e), key)
        return
    try:
        with reader as fd:
            try:
                header = read_header(fd, path)
            except FileNotFoundError:  # an object store finds a missing object here
                raise
            except CheckpointingException as e:
                report.files_checked += 1
                report.add(rel, str(e), key)
                return
            report.files_checked += 1
            try:
                default_file_check(index)(header, shards)
            except CheckpointingException as e:
                report.add(rel, str(e), key)
                return
            expected = index.header_crcs.get(name)
            if expected is not None and header.prefix_crc != expected:
                report.add(
                    rel,
                    f"header bytes have crc32c {crc_to_hex(header.prefix_crc)}, the index recorded "
                    f"{crc_to_hex(expected)}",
                    key,
                )
            for k, shard in shards:
                _verify_shard(fd, path, rel, k, shard, index.block_bytes, report, read_bytes)
    except FileNotFoundError:
        report.add(rel, missing, key)


def _verify_shard(
    fd: ObjectReader,
    path: str,
    rel: str,
    key: str,
    shard: StoredShard,
    block_bytes: Optional[int],
    report: IntegrityReport,
    read_bytes: int,
) -> None:
    if shard.crcs is None or block_bytes is None:
        return
    begin, end = shard.byte_range
    step = max(block_bytes, read_bytes // block_bytes * block_bytes)
    buf = bytearray(min(step, max(end - begin, 1)))
    for chunk_start in range(begin, end, step):
        n = min(step, end - chunk_start)
        view = memoryview(buf)[:n]
        try:
            read_into(fd, [view], chunk_start)
        except EOFError as e:
            report.add(rel, f"truncated: {e}", key)
            return
        report.bytes_checked += n
        data = np.frombuffer(buf, dtype=np.uint8, count=n)
        for offset in range(0, n, block_bytes):
            j = (chunk_start + offset - begin) // block_bytes
            found = crc32c(data[offset : offset + block_bytes])
            if found != shard.crcs[j]:
                start = chunk_start + offset
                report.add(
                    rel,
                    f"bytes {start}:{min(start + block_bytes, end)} (block {j} of shard {shard.name!r}) have crc32c "
                    f"{crc_to_hex(found)}, the index recorded {crc_to_hex(shard.crcs[j])}",
                    key,
                )
