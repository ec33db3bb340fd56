"""Writing a rank's safetensors files, in parts, with a crc32c per block of every tensor.

The synchronous and the asynchronous save of the ``safetensors`` backend share this module:

* `plan_file()` fixes, before any byte is written, each file's header and the byte range of
  every tensor in it (a safetensors header needs dtypes and shapes, not data). A file can then be
  written in *parts* -- the header and the first tensors by the training process, the rest by a
  background process -- each at its planned offsets;
* `write_part()` writes one part: the header if the part starts the file, then each tensor's
  bytes, computing the crc32c of every ``block_bytes`` block of each tensor's byte range while the
  bytes stream past (no second pass over the data), and fsyncs the file if asked;
* `write_parts()` writes several parts at once, one thread each (``os.write`` and the crc
  computation run while other threads write);
* `write_snapshot_parts()` is the function a background worker runs: `write_parts()` with
  tensors that are views of a shared-memory `Snapshot` -- or, where the training process wrote
  the snapshot into the files itself as it was taken (`early_writes`), the crcs computed from
  the snapshot, a wait for those writes, and the fsyncs.

What was written is then described to rank 0 by `index_parts` and indexed by
`index_write`.

Local files are written by path (the storage's ``local_paths`` capability): a file can be written
in parts by two processes at planned offsets, with early writeback and one fsync per file.

On an object store a file is one object, written whole by one process: `write_objects()`
uploads each planned file from its tensors' memory (a multipart upload, parts in parallel, when
it is larger than the storage's part size), one file per thread, with the same checksums;
`write_snapshot_objects()` is its background-worker counterpart (the worker opens its own
client: a pickled storage carries its location and options, not its connection).

Every data byte goes through `SequentialWriter`, or for an early-written snapshot through
`direct_io.write_at()` (called through its module), so tests can slow down or count writes there.
"""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import torch

from dist_ckpt.asynchronous.channel import PassedFd
from dist_ckpt.asynchronous.snapshot import Snapshot
from dist_ckpt.backends.safetensors.early_writes import wait_for_early_writes
from dist_ckpt.backends.safetensors.format import StagingBuffer, encode_header, storage_layout, tensor_bytes
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.integrity.checksums import BlockChecksums, crc32c, crc_to_hex, encode_block_crcs
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.storage import ObjectWriter, Storage, fsync_dir
from dist_ckpt.storage.files import SequentialWriter
from dist_ckpt.storage.host_memory import DEFAULT_STAGING_BYTES, needs_staging, piece_bytes

__all__ = [
    "FILE_METADATA",
    "PartResult",
    "PlannedFile",
    "PlannedFiles",
    "SnapshotPart",
    "WritePart",
    "create_with_header",
    "partial_name",
    "plan_file",
    "publish",
    "stream_tensor",
    "write_object",
    "write_objects",
    "write_part",
    "write_parts",
    "write_snapshot_objects",
    "write_snapshot_parts",
]

logger = logging.getLogger(__name__)

#: bytes handed to one ``os.write`` (and one crc update) at a time: large enough for few system
#: calls, small enough that the crc reads bytes the write just brought into the CPU cache
_PIECE_BYTES = 16 << 20
#: the ``__metadata__`` of every file the backend writes (safetensors readers see a ``"pt"`` file)
FILE_METADATA = {"format": "pt", "dist_ckpt": "safetensors backend v1; see index.json for the layout"}


@dataclass(frozen=True)
class PlannedFile:
    """A safetensors file whose layout is fixed before it is written.

    Attributes:
        name: file name (within the backend's directory).
        prefix: the bytes before the data section (length + JSON header).
        names: tensor names in file order.
        ranges: absolute ``(begin, end)`` byte range of each tensor.
    """

    name: str
    prefix: bytes
    names: Tuple[str, ...]
    ranges: Tuple[Tuple[int, int], ...]

    @property
    def size(self) -> int:
        """Size of the complete file."""
        return self.ranges[-1][1] if self.ranges else len(self.prefix)


def plan_file(
    name: str, tensors: Sequence[Tuple[str, torch.dtype, Sequence[int]]], metadata: Mapping[str, str]
) -> PlannedFile:
    """The layout of a file holding ``(name, dtype, shape)`` tensors in this order.

    Example:

    ```python
    plan = plan_file("rank00000_0.safetensors", [("w@0.0", torch.float32, (2, 3))], {"format": "pt"})
    plan.ranges[0]   # (len(plan.prefix), len(plan.prefix) + 24)
    ```
    """
    entries = [(n, *storage_layout(dtype, shape), math.prod(shape) * dtype.itemsize) for n, dtype, shape in tensors]
    prefix, ranges = encode_header(entries, metadata)
    return PlannedFile(name, prefix, tuple(n for n, _, _ in tensors), tuple(ranges))


#: each planned file with the shards it holds, in file order
PlannedFiles = List[Tuple[PlannedFile, List[ShardedTensor]]]


@dataclass(frozen=True)
class WritePart:
    """Tensors ``first, first + 1, ...`` of a planned file, to be written at their offsets.

    Attributes:
        plan: the file.
        first: index (in ``plan``) of the first tensor this part writes; 0 also writes the header
            and creates the file, otherwise the file exists already.
        tensors: the data of tensors ``first .. first + len(tensors) - 1``: any CPU tensor with
            the planned byte size (row-major bytes), or tensors on another device.
        fsync: make the whole file durable at the end (the last part of a file does it).
    """

    plan: PlannedFile
    first: int
    tensors: Tuple[torch.Tensor, ...]
    fsync: bool = True


@dataclass(frozen=True)
class PartResult:
    """What writing a part produced.

    Attributes:
        file: the file name.
        first: index of the part's first tensor.
        crcs: per tensor written, its block crcs encoded with
            [`encode_block_crcs()`][dist_ckpt.integrity.checksums.encode_block_crcs] (empty strings without checksums).
        header_crc: crc32c of the file's prefix (hex), for a part that wrote it with checksums on.
    """

    file: str
    first: int
    crcs: Tuple[str, ...]
    header_crc: Optional[str]


def write_part(
    directory: Path,
    part: WritePart,
    *,
    block_bytes: Optional[int],
    early_writeback: bool = True,
    staging: Optional[StagingBuffer] = None,
) -> PartResult:
    """Write one part of a planned file (see `WritePart`).

    Args:
        directory: where the file is.
        part: what to write.
        block_bytes: checksum block size, or None to compute no checksums.
        early_writeback: see `SequentialWriter`.
        staging: pinned buffer for tensors not on the CPU (one is made if needed).

    Example:

    ```python
    result = write_part(root, WritePart(plan, 0, (t,)), block_bytes=1 << 20)
    ```
    """
    plan = part.plan
    path = Path(directory) / plan.name
    if part.first + len(part.tensors) > len(plan.names):
        raise CheckpointingException(
            f"{path}: a part of {len(part.tensors)} tensors from {part.first} exceeds the plan"
        )
    start = (
        len(plan.prefix)
        if part.first == 0
        else plan.ranges[part.first][0]
        if part.first < len(plan.ranges)
        else plan.size
    )
    header_crc = crc_to_hex(crc32c(plan.prefix)) if block_bytes and part.first == 0 else None
    if part.first == 0:
        fd = _open_new_with_header(Path(directory), plan)
    else:
        fd = os.open(Path(directory) / partial_name(plan.name), os.O_WRONLY)
    try:
        os.lseek(fd, start, os.SEEK_SET)  # after the header, or where this part's first tensor starts
        writer = SequentialWriter(fd, early_writeback, start=start, url=str(Path(directory) / partial_name(plan.name)))
        crcs = []
        for i, tensor in enumerate(part.tensors):
            begin, end = plan.ranges[part.first + i]
            if writer.position != begin:
                raise CheckpointingException(
                    f"{path}: tensor {plan.names[part.first + i]!r} would start at byte {writer.position}, planned "
                    f"{begin}"
                )
            crcs.append(_write_tensor(writer, tensor, block_bytes, staging))
            if writer.position != end:
                raise CheckpointingException(
                    f"{path}: tensor {plan.names[part.first + i]!r} has {writer.position - begin} bytes, planned "
                    f"{end - begin}"
                )
        if part.fsync:
            writer.finish()
    finally:
        os.close(fd)
    return PartResult(plan.name, part.first, tuple(crcs), header_crc)


def create_with_header(directory: Path, plan: PlannedFile) -> None:
    """Create ``plan``'s file (under its `partial_name()`) with its header written, for a writer
    of its tensors that opens it later (an async save's `early_writes`)."""
    os.close(_open_new_with_header(directory, plan))


def _open_new_with_header(directory: Path, plan: PlannedFile) -> int:
    """Create ``plan``'s file under its `partial_name()` (it must not exist), write its header
    and return the open descriptor, positioned after the header."""
    fd = os.open(directory / partial_name(plan.name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        SequentialWriter(fd, url=str(directory / partial_name(plan.name))).write(memoryview(plan.prefix))
    except BaseException:
        os.close(fd)
        raise
    return fd


def partial_name(name: str) -> str:
    """The name file ``name`` has while it is written: hidden, and not its final name, so a
    save that fails or is killed never leaves a data file under a name the index uses. Every
    part of a file (the caller's and the background process's) writes this same name;
    `publish()` renames it once all are written.

    Example:

    ```python
    partial_name("rank00000_0.safetensors")   # ".partial-rank00000_0.safetensors"
    ```
    """
    return f".partial-{name}"


def publish(directory: Path, names: Sequence[str]) -> None:
    """Rename the written files ``names`` from their `partial_name()` to their final names
    and fsync ``directory`` (after every part of them is durable).

    Example:

    ```python
    publish(root, [plan.name for plan, _ in files])
    ```
    """
    directory = Path(directory)
    for name in names:
        os.replace(directory / partial_name(name), directory / name)
    if names:
        fsync_dir(directory)


def _write_tensor(
    writer: SequentialWriter, tensor: torch.Tensor, block_bytes: Optional[int], staging: Optional[StagingBuffer]
) -> str:
    blocks = BlockChecksums(block_bytes) if block_bytes else None
    if not needs_staging(tensor):
        data = tensor_bytes(tensor)
        for s in range(0, len(data), _PIECE_BYTES):
            piece = data[s : s + _PIECE_BYTES]
            writer.write(piece)
            if blocks is not None:
                blocks.update(piece)
    else:
        (staging or StagingBuffer(piece_bytes(DEFAULT_STAGING_BYTES))).write_device_tensor(
            writer, tensor, blocks.update if blocks else None
        )
    return encode_block_crcs(blocks.finish()) if blocks is not None else ""


def write_parts(
    directory: Path,
    parts: Sequence[WritePart],
    *,
    block_bytes: Optional[int],
    early_writeback: bool = True,
    staging: Optional[Sequence[StagingBuffer]] = None,
) -> List[PartResult]:
    """Write ``parts`` (of distinct files) on one thread each; fsync ``directory`` if any part
    created a file. Returns the results in the order of ``parts``.

    Example:

    ```python
    parts = [WritePart(plan_a, 0, tensors_a), WritePart(plan_b, 0, tensors_b)]
    results = write_parts(root, parts, block_bytes=1 << 20)
    ```
    """
    directory = Path(directory)
    buffers = list(staging) if staging else [None] * len(parts)

    def one(i: int) -> PartResult:
        return write_part(
            directory,
            parts[i],
            block_bytes=block_bytes,
            early_writeback=early_writeback,
            staging=buffers[i % max(1, len(buffers))],
        )

    if len(parts) <= 1:
        results = [one(i) for i in range(len(parts))]
    else:
        with ThreadPoolExecutor(len(parts), thread_name_prefix="dist_ckpt_write") as pool:
            results = list(pool.map(one, range(len(parts))))
    if any(p.first == 0 for p in parts):
        fsync_dir(directory)
    logger.debug("wrote %d file parts in %s", len(parts), directory)
    return results


@dataclass(frozen=True)
class SnapshotPart:
    """A `WritePart` whose tensors are slots of a snapshot (picklable without the data)."""

    plan: PlannedFile
    first: int
    slots: Tuple[int, ...]  # indices into Snapshot.slots


def write_snapshot_parts(
    directory: str,
    parts: Sequence[SnapshotPart],
    snapshot: Snapshot,
    block_bytes: Optional[int],
    early_writeback: bool,
    written_early: Optional[PassedFd] = None,
) -> List[PartResult]:
    """Write ``parts`` from ``snapshot`` and fsync every file: the background half of an async save.

    With ``written_early`` the training process writes the parts' bytes itself
    (`early_writes`, which created the files and wrote their headers too): this computes the
    crcs from the snapshot meanwhile, waits for its word on ``written_early`` and fsyncs the
    files.

    Runs in the async worker process; it calls no collective and needs no process group.

    Example:

    ```python
    request = AsyncRequest(write_snapshot_parts, (str(root), parts, snapshot, 1 << 20, True))
    ```
    """
    write = [WritePart(p.plan, p.first, tuple(snapshot.view(i) for i in p.slots), fsync=True) for p in parts]
    if written_early is None:
        return write_parts(Path(directory), write, block_bytes=block_bytes, early_writeback=early_writeback)
    results = [_checksums(part, block_bytes) for part in write]
    wait_for_early_writes(written_early, directory)
    for part in write:
        _fsync_written(Path(directory) / partial_name(part.plan.name), drop=early_writeback)
    if write:
        fsync_dir(directory)
    return results


def _checksums(part: WritePart, block_bytes: Optional[int]) -> PartResult:
    """What `write_part()` returns for ``part``, for bytes written by someone else."""
    crcs = tuple(_block_crcs(tensor_bytes(t), block_bytes) for t in part.tensors)
    header_crc = crc_to_hex(crc32c(part.plan.prefix)) if block_bytes and part.first == 0 else None
    return PartResult(part.plan.name, part.first, crcs, header_crc)


def _fsync_written(path: Path, drop: bool) -> None:
    """fsync ``path``; with ``drop``, then drop its (clean) pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        SequentialWriter(fd, early_writeback=drop, start=os.fstat(fd).st_size, url=str(path)).finish()
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- object stores


def _run_threads(count: int, fn: "Callable[[int], PartResult]") -> List[PartResult]:
    if count <= 1:
        return [fn(i) for i in range(count)]
    with ThreadPoolExecutor(count, thread_name_prefix="dist_ckpt_upload") as pool:
        return list(pool.map(fn, range(count)))


def write_object(
    storage: Storage, part: WritePart, *, block_bytes: Optional[int], staging: Optional[StagingBuffer] = None
) -> PartResult:
    """Upload a whole planned file as object ``part.plan.name`` of ``storage``.

    CPU tensors are sent from their own memory (``Storage.write_buffers``: one PUT, or a
    multipart upload with concurrent parts above the storage's part size), after one pass that
    computes their block checksums; tensors on other devices go through ``staging`` and a
    streaming upload. The object appears whole when the upload completes, or not at all.

    Example:

    ```python
    result = write_object(storage, WritePart(plan, 0, tensors), block_bytes=1 << 20)
    ```
    """
    plan = part.plan
    if part.first != 0 or len(part.tensors) != len(plan.names):
        raise CheckpointingException(
            f"{storage.url_of(plan.name)}: an object is written whole, got tensors {part.first}.."
            f"{part.first + len(part.tensors)} of {len(plan.names)}"
        )
    for tensor, name, (begin, end) in zip(part.tensors, plan.names, plan.ranges):
        if tensor.numel() * tensor.element_size() != end - begin:
            raise CheckpointingException(
                f"{storage.url_of(plan.name)}: tensor {name!r} has {tensor.numel() * tensor.element_size()} bytes, "
                f"planned {end - begin}"
            )
    header_crc = crc_to_hex(crc32c(plan.prefix)) if block_bytes else None
    if not any(needs_staging(t) for t in part.tensors):
        views = [tensor_bytes(t) for t in part.tensors]
        crcs = [_block_crcs(v, block_bytes) for v in views]
        storage.write_buffers(plan.name, [memoryview(plan.prefix), *views])
        return PartResult(plan.name, 0, tuple(crcs), header_crc)
    with storage.open_writer(plan.name) as writer:
        writer.write(plan.prefix)
        crcs = [stream_tensor(writer, t, block_bytes, staging) for t in part.tensors]
    return PartResult(plan.name, 0, tuple(crcs), header_crc)


def _block_crcs(data: memoryview, block_bytes: Optional[int]) -> str:
    if not block_bytes:
        return ""
    blocks = BlockChecksums(block_bytes)
    for s in range(0, len(data), _PIECE_BYTES):
        blocks.update(data[s : s + _PIECE_BYTES])
    return encode_block_crcs(blocks.finish())


def stream_tensor(
    writer: ObjectWriter, tensor: torch.Tensor, block_bytes: Optional[int], staging: Optional[StagingBuffer]
) -> str:
    """Append ``tensor``'s bytes to an object upload (a device tensor through ``staging``, or a
    temporary staging buffer); return its block crcs, encoded ("" without checksums)."""
    blocks = BlockChecksums(block_bytes) if block_bytes else None
    if not needs_staging(tensor):
        data = tensor_bytes(tensor)
        for s in range(0, len(data), _PIECE_BYTES):
            writer.write(data[s : s + _PIECE_BYTES])
            if blocks is not None:
                blocks.update(data[s : s + _PIECE_BYTES])
    else:
        (staging or StagingBuffer(piece_bytes(DEFAULT_STAGING_BYTES))).write_device_tensor(
            writer, tensor, blocks.update if blocks else None
        )
    return encode_block_crcs(blocks.finish()) if blocks is not None else ""


def write_objects(
    storage: Storage,
    parts: Sequence[WritePart],
    *,
    block_bytes: Optional[int],
    staging: Optional[Sequence[StagingBuffer]] = None,
) -> List[PartResult]:
    """Upload whole planned files (``parts``), one thread each; results in the order of ``parts``.

    Example:

    ```python
    results = write_objects(storage.child("safetensors"), [WritePart(plan, 0, tensors)], block_bytes=1 << 20)
    ```
    """
    buffers = list(staging) if staging else [None] * len(parts)

    def one(i: int) -> PartResult:
        return write_object(storage, parts[i], block_bytes=block_bytes, staging=buffers[i % max(1, len(buffers))])

    results = _run_threads(len(parts), one)
    logger.debug("uploaded %d objects to %s", len(parts), storage.url)
    return results


def write_snapshot_objects(
    storage: Storage, parts: Sequence[SnapshotPart], snapshot: Snapshot, block_bytes: Optional[int]
) -> List[PartResult]:
    """Upload whole files from ``snapshot``: the background half of an asynchronous save to an
    object store. Runs in the async worker process, which opens its own client when it unpickles
    ``storage``; it calls no collective.

    Example:

    ```python
    request = AsyncRequest(write_snapshot_objects, (storage.child("safetensors"), parts, snapshot, 1 << 20))
    ```
    """
    write = [WritePart(p.plan, p.first, tuple(snapshot.view(i) for i in p.slots)) for p in parts]
    return write_objects(storage, write, block_bytes=block_bytes)
