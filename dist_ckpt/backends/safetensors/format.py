"""The safetensors file format: headers, zero-copy writes, and validated header reads.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON (padded
with spaces so that the data starts at a multiple of 8), then the data section. The JSON maps
each tensor name to ``{"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}`` with
offsets relative to the data section, and may hold ``"__metadata__": {str: str}``. Tensors tile
the data section exactly, without gaps, and the file ends where the last one ends.

This module is shared by the ``safetensors`` backend, [`dist_ckpt.hf`][dist_ckpt.hf] and the completeness
checks of `dist_ckpt.training`: it is the one parser of safetensors headers. It writes files
that any safetensors reader opens, straight from each tensor's own memory (no serialized copy),
and reads headers defensively: every field is checked before any tensor byte is read, so a
truncated or damaged file raises [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError] naming the
file and the tensor instead of a raw ``json`` / ``struct`` / safetensors error
(`read_header()`); `is_whole()` only asks whether a file is as long as its header says.
Files are read through a storage's [`ObjectReader`][dist_ckpt.storage.base.ObjectReader] (a local file
or an object).
"""

from __future__ import annotations

import json
import math
import os
import struct
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, Union

import torch

from dist_ckpt.backends.safetensors import io as safetensors_io
from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError
from dist_ckpt.integrity.checksums import crc32c
from dist_ckpt.integrity.safe_json import loads, shown
from dist_ckpt.model.dtypes import TENSOR_ALIGN, dtype_from_safetensors_name, dtype_info
from dist_ckpt.storage import FileReader, ObjectNotFoundError, ObjectReader, fsync_dir
from dist_ckpt.storage.files import SequentialWriter
from dist_ckpt.storage.host_memory import DEFAULT_STAGING_BYTES, host_pieces, needs_staging, piece_bytes

__all__ = [
    "DATA_ALIGN",
    "MAX_HEADER_BYTES",
    "HeaderEntry",
    "SafetensorsFileWriter",
    "SafetensorsHeader",
    "StagingBuffer",
    "data_end",
    "encode_header",
    "is_whole",
    "read_header",
    "read_header_at",
    "storage_layout",
    "write_safetensors_file",
]

#: the largest header a safetensors file may declare: the safetensors library's own limit
#: (``MAX_HEADER_SIZE`` in its ``tensor.rs``), so that every file accepted here is one that
#: ``safe_open`` also opens; checked before anything is allocated
MAX_HEADER_BYTES = 100_000_000
#: the data section starts at a multiple of this many bytes (the JSON header is padded with
#: spaces, as the format allows): a tensor there, and each after it while sizes are multiples of
#: it, sits at a cache-line-aligned file offset, so a snapshot laid out in file order (async
#: saves) copies into aligned memory
DATA_ALIGN = TENSOR_ALIGN
_LEN = struct.Struct("<Q")

Shape = Tuple[int, ...]


def storage_layout(dtype: torch.dtype, shape: Sequence[int]) -> Tuple[str, Shape]:
    """The safetensors dtype name and shape under which a tensor's bytes are stored.

    Every dtype maps to its own safetensors name, except ``complex128``, which safetensors cannot
    name: it is stored as ``F64`` with a trailing axis of 2 (real, imaginary), its exact bytes, so
    the file stays readable by every safetensors reader.

    Example:

    ```python
    storage_layout(torch.bfloat16, (4, 8))    # ("BF16", (4, 8))
    storage_layout(torch.complex128, (3,))    # ("F64", (3, 2))
    ```
    """
    if dtype == torch.complex128:
        return "F64", tuple(shape) + (2,)
    return dtype_info(dtype).safetensors_name, tuple(shape)


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors file.

    Attributes:
        name: tensor name in the file.
        dtype: torch dtype of the stored name (``F64`` for a stored complex128).
        shape: stored shape.
        begin: absolute file offset of the first byte.
        end: absolute file offset past the last byte.
    """

    name: str
    dtype: torch.dtype
    shape: Shape
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed, validated safetensors header.

    Attributes:
        path: the file (a path, or an object's URL).
        data_start: absolute offset of the data section.
        file_size: size of the file in bytes (equal to the end of the data section).
        entries: tensors by name.
        metadata: the ``__metadata__`` map (empty if absent).
        prefix_crc: crc32c of the bytes before the data section (length and JSON header).
    """

    path: Union[str, Path]
    data_start: int
    file_size: int
    entries: Dict[str, HeaderEntry]
    metadata: Dict[str, str] = field(default_factory=dict)
    prefix_crc: int = 0


def encode_header(
    tensors: Sequence[Tuple[str, str, Sequence[int], int]], metadata: Optional[Mapping[str, str]] = None
) -> Tuple[bytes, List[Tuple[int, int]]]:
    """The bytes before the data section, and each tensor's absolute byte range.

    Args:
        tensors: ``(name, safetensors dtype name, shape, nbytes)`` in data-section order.
        metadata: the ``__metadata__`` map (strings only, as the format requires).

    Example:

    ```python
    prefix, ranges = encode_header([("w", "F32", (2, 3), 24)])
    # prefix = 8-byte length + JSON; ranges[0] == (len(prefix), len(prefix) + 24)
    ```
    """
    doc: Dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    relative = []
    for name, st_dtype, shape, nbytes in tensors:
        if name in doc or name == "__metadata__":
            raise CheckpointingException(f"tensor name {name!r} appears twice in one safetensors file")
        doc[name] = {"dtype": st_dtype, "shape": [int(s) for s in shape], "data_offsets": [offset, offset + nbytes]}
        relative.append((offset, offset + nbytes))
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(len(text) + _LEN.size) % DATA_ALIGN)
    prefix = _LEN.pack(len(text)) + text
    base = len(prefix)
    return prefix, [(base + b, base + e) for b, e in relative]


# --------------------------------------------------------------------------- reading headers


def _corrupt(path: Union[str, Path], problem: str, name: Optional[str] = None) -> CorruptCheckpointError:
    where = f"tensor {name!r} in " if name is not None else ""
    return CorruptCheckpointError(f"{where}safetensors file {str(path)!r}: {problem}")


def _entry(path: Union[str, Path], name: str, raw: object) -> Tuple[str, torch.dtype, Shape, int, int]:
    if not isinstance(raw, dict):
        raise _corrupt(path, f"header entry must be an object, found {shown(raw)}", name)
    st_dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    if not isinstance(st_dtype, str):
        raise _corrupt(path, f"'dtype' must be a string, found {shown(st_dtype)}", name)
    try:
        dtype = dtype_from_safetensors_name(st_dtype)
    except CheckpointingException:
        raise _corrupt(path, f"unsupported dtype {shown(st_dtype)}", name) from None
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise _corrupt(path, f"'shape' must be a list of non-negative ints, found {shown(shape)}", name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _corrupt(
            path, f"'data_offsets' must be [begin, end] with 0 <= begin <= end, found {shown(offsets)}", name
        )
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise _corrupt(
            path,
            f"data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, but {st_dtype} {shape} needs {nbytes}",
            name,
        )
    return st_dtype, dtype, tuple(shape), offsets[0], offsets[1]


def read_header(fd: ObjectReader, path: Union[str, Path]) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file open as ``fd`` (a storage's reader:
    on an object store two ranged reads and one size request; ``path`` names it in messages).

    Checks the length prefix, the JSON, every entry (dtype, shape, byte count), that the tensors
    tile the data section without gaps or overlaps, and that the file is exactly as long as the
    header says (a truncated file is caught here, before any tensor is read).

    Raises:
        CorruptCheckpointError: naming the file (and the tensor) on any inconsistency.

    Example:

    ```python
    with LocalStorage("Llama-3-8B").open_reader("model.safetensors") as reader:
        header = read_header(reader, reader.url)
    entry = header.entries["lm_head.weight"]   # absolute byte range entry.begin:entry.end
    ```
    """
    file_size = fd.size()
    if file_size < _LEN.size:
        raise _corrupt(path, f"the file has {file_size} bytes, too few for a safetensors header (truncated?)")
    length_bytes = safetensors_io.read_bytes(fd, _LEN.size, 0)
    (length,) = _LEN.unpack(length_bytes)
    if length > MAX_HEADER_BYTES or _LEN.size + length > file_size:
        raise _corrupt(
            path, f"the header claims {length} bytes but the file has {file_size} (truncated or not a safetensors file)"
        )
    raw = safetensors_io.read_bytes(fd, length, _LEN.size)
    doc = loads(raw, f"the header of safetensors file {str(path)!r}", MAX_HEADER_BYTES)
    if not isinstance(doc, dict):
        raise _corrupt(path, f"the header must be a JSON object, found {type(doc).__name__}")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _corrupt(path, "'__metadata__' must map strings to strings")
    data_start = _LEN.size + length
    entries: Dict[str, HeaderEntry] = {}
    spans = []
    for name, value in doc.items():
        _, dtype, shape, begin, end = _entry(path, name, value)
        entries[name] = HeaderEntry(name, dtype, shape, data_start + begin, data_start + end)
        spans.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise _corrupt(
                path, f"data starts at byte {begin} of the data section, expected {position} (gap or overlap)", name
            )
        position = end
    if data_start + position != file_size:
        raise _corrupt(
            path,
            f"the header describes {data_start + position} bytes but the file has {file_size} "
            f"({'truncated' if file_size < data_start + position else 'trailing garbage'})",
        )
    return SafetensorsHeader(path, data_start, file_size, entries, dict(metadata), crc32c(raw, crc32c(length_bytes)))


def read_header_at(path: Union[str, Path]) -> SafetensorsHeader:
    """`read_header()` of the local file at ``path`` (opened and closed here).

    Example:

    ```python
    read_header_at("model.safetensors").metadata    # {"format": "pt"}
    ```
    """
    path = Path(path)
    try:
        reader = FileReader.open(path)
    except ObjectNotFoundError:
        raise CorruptCheckpointError(f"safetensors file {str(path)!r} is missing") from None
    with reader:
        return read_header(reader, path)


def data_end(header: object) -> Optional[int]:
    """The end of the data a parsed header describes (bytes after the header), or None if it is
    malformed -- read leniently: only the ``data_offsets`` matter. A whole file is
    ``8 + header length + data_end`` bytes.

    Example:

    ```python
    data_end({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})   # 8
    ```
    """
    if not isinstance(header, dict):
        return None
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            return None
        end = max(end, offsets[1])
    return end


def is_whole(reader: ObjectReader) -> bool:
    """Whether the file's size is exactly what its header describes: a cheap completeness check
    (two small reads), lenient about everything else a loader checks (dtypes, tiling), so that a
    weights file of a dtype this library does not load still counts as complete.

    Example:

    ```python
    with storage.open_reader("model.safetensors") as reader:
        complete = is_whole(reader)
    ```
    """
    try:
        size = reader.size()
        if size < _LEN.size:
            return False
        (header_len,) = _LEN.unpack(safetensors_io.read_bytes(reader, _LEN.size, 0))
        if header_len > min(size - _LEN.size, MAX_HEADER_BYTES):
            return False
        header = loads(safetensors_io.read_bytes(reader, header_len, _LEN.size), reader.url, MAX_HEADER_BYTES)
    except (OSError, EOFError, ValueError):  # a missing object is an OSError, CorruptCheckpointError a ValueError
        return False
    end = data_end(header)
    return end is not None and size == _LEN.size + header_len + end


# --------------------------------------------------------------------------- writing


class ByteSink(Protocol):
    """Anything bytes can be appended to (a `SequentialWriter`, a storage ``ObjectWriter``)."""

    def write(self, data: memoryview) -> Any:
        """Append all of ``data``."""


class StagingBuffer:
    """A reusable pinned host buffer through which non-CPU (and strided CPU) tensors are written.

    Device memory cannot be handed to ``os.write``; each GPU tensor is copied to this buffer in
    pieces (`dist_ckpt.storage.host_memory.host_pieces`) and written from there. Pinned memory
    makes the device-to-host copies fast; the buffer
    is allocated on first use and reused for every tensor of a file.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._buffer: Optional[torch.Tensor] = None

    def write_device_tensor(
        self, writer: "ByteSink", tensor: torch.Tensor, observe: Optional[Callable[[memoryview], None]] = None
    ) -> None:
        """Write ``tensor`` (on any non-CPU device) through the pinned buffer; ``observe`` (e.g. a
        checksum) sees every piece of host bytes after it is written. ``writer`` is a
        `SequentialWriter` or a storage's ``ObjectWriter`` (which copies what it is given,
        so the buffer can be reused right away)."""
        if self._buffer is None:
            self._buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        # piece by piece, never the whole tensor: a strided view is copied row block by row block
        for piece in host_pieces(tensor, self.nbytes, self._buffer, force=True):
            writer.write(piece)  # synchronous: the buffer is reused right after
            if observe is not None:
                observe(piece)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, from its own memory when it is contiguous (no copy)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data


class SafetensorsFileWriter:
    """Writes one safetensors file whose tensors are declared up front and supplied one by one.

    The header needs every tensor's dtype and shape, not its data: with them declared, the
    tensors can be produced one at a time (e.g. assembled from a sharded checkpoint) and each
    freed once written, so writing a file needs memory for one tensor. Used as a context
    manager: the file is complete, fsynced (and renamed into place if ``atomic``) on a clean
    exit, and removed on an error.

    Example:

    ```python
    layout = [("w", torch.float32, (2, 2)), ("b", torch.float32, (2,))]
    with SafetensorsFileWriter("model.safetensors", layout, atomic=True) as writer:
        writer.write(torch.ones(2, 2))
        writer.write(torch.zeros(2))
    ```
    """

    def __init__(
        self,
        path: Union[str, Path],
        layout: Sequence[Tuple[str, torch.dtype, Sequence[int]]],
        metadata: Optional[Mapping[str, str]] = None,
        *,
        atomic: bool = False,
        staging: Optional[StagingBuffer] = None,
        early_writeback: bool = False,
    ) -> None:
        self.path = Path(path)
        self.layout = [(name, dtype, tuple(int(s) for s in shape)) for name, dtype, shape in layout]
        entries = [
            (name, *storage_layout(dtype, shape), math.prod(shape) * dtype.itemsize)
            for name, dtype, shape in self.layout
        ]
        self._prefix, self.ranges = encode_header(entries, metadata)
        self.size = self.ranges[-1][1] if self.ranges else len(self._prefix)
        self.atomic = atomic
        self._staging = staging
        self._early_writeback = early_writeback
        self._target = (
            self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}") if atomic else self.path
        )
        self._fd: Optional[int] = None
        self._writer: Optional[SequentialWriter] = None
        self._next = 0

    def __enter__(self) -> "SafetensorsFileWriter":
        self._fd = os.open(self._target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._writer = SequentialWriter(self._fd, self._early_writeback, url=str(self._target))
        self._writer.write(memoryview(self._prefix))
        return self

    def write(self, tensor: torch.Tensor) -> None:
        """Write the next declared tensor's data (same dtype and shape as declared)."""
        if self._writer is None:
            raise CheckpointingException(f"{self.path}: write() outside the writer's 'with' block")
        if self._next >= len(self.layout):
            raise CheckpointingException(f"{self.path}: every declared tensor is already written")
        name, dtype, shape = self.layout[self._next]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise CheckpointingException(
                f"{self.path}: tensor {name!r} was declared as {dtype} {list(shape)}, got {tensor.dtype} "
                f"{list(tensor.shape)}"
            )
        if not needs_staging(tensor):
            self._writer.write(tensor_bytes(tensor))
        else:
            if self._staging is None:
                self._staging = StagingBuffer(piece_bytes(DEFAULT_STAGING_BYTES))
            self._staging.write_device_tensor(self._writer, tensor)
        self._next += 1

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self._fd is not None and self._writer is not None
        try:
            if exc_type is None:
                if self._next != len(self.layout):
                    missing = [name for name, _, _ in self.layout[self._next :]]
                    raise CheckpointingException(f"{self.path}: tensors {missing} were declared but not written")
                self._writer.finish()
        except BaseException:
            exc_type = True
            raise
        finally:
            os.close(self._fd)
            self._fd = None
            if exc_type is not None:
                self._target.unlink(missing_ok=True)
            elif self.atomic:
                os.replace(self._target, self.path)
                fsync_dir(self.path.parent)


def write_safetensors_file(
    path: Union[str, Path],
    tensors: Sequence[Tuple[str, torch.Tensor]],
    metadata: Optional[Mapping[str, str]] = None,
    *,
    atomic: bool = False,
    staging: Optional[StagingBuffer] = None,
    early_writeback: bool = False,
) -> Tuple[int, List[Tuple[int, int]]]:
    """Write ``tensors`` as one safetensors file, fsync it, and return its size and byte ranges.

    The header is written first, then each tensor's bytes in order, each with as few large
    ``write`` calls as possible, straight from the tensor's memory (CPU) or through ``staging``
    (other devices). The file is fsynced before returning; without ``atomic`` the caller fsyncs
    the directory.

    Args:
        path: the file to create.
        tensors: ``(name, tensor)`` pairs in file order; names must be unique.
        metadata: the ``__metadata__`` map.
        atomic: write to a temporary name and rename it over ``path`` (the file appears whole
            or not at all); otherwise ``path`` must not exist yet.
        staging: the pinned buffer for non-CPU tensors (one is made if needed).
        early_writeback: start writing to the disk while writing (see `SequentialWriter`).

    Returns:
        ``(file size, [(begin, end) absolute byte range of each tensor])``.

    Example:

    ```python
    size, ranges = write_safetensors_file("model.safetensors", [("w", torch.ones(2, 2))])
    ```
    """
    layout = [(name, t.dtype, tuple(t.shape)) for name, t in tensors]
    with SafetensorsFileWriter(
        path, layout, metadata, atomic=atomic, staging=staging, early_writeback=early_writeback
    ) as writer:
        for _, tensor in tensors:
            writer.write(tensor)
    return writer.size, writer.ranges
