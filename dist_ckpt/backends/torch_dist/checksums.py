"""crc32c checksums of the DCP files dist_ckpt writes, and their manifest.

DCP's own files carry no checksum of their bytes. When dist_ckpt writes a torch_dist checkpoint
it computes a crc32c of every *item* (one tensor chunk's ``torch.save`` archive, or one
ShardedObject's bytes) while the bytes pass on their way to the file -- no second read -- and
rank 0 records them, with every file's size, in ``torch_dist.checksums.json`` beside
``.metadata``:

```python
{"format": "dist_ckpt.torch_dist.checksums", "version": 1, "algorithm": "crc32c",
 "files": {"__0_0.distcp": {"size": 5120, "spans": [[0, 1488, "8 hex digits"], ...]},
           ".metadata":    {"size": 7490, "spans": [[0, 7490, "..."]]}}}
```

A file's *spans* tile it from byte 0 to its size, each with its crc. Every item is tiled by
whole spans, so a load checks exactly the spans of the items it reads, and ``dist-ckpt verify``
checks every span of every file. Megatron-Core and DCP ignore the file. Checkpoints written by
other tools have none: they load unverified and verify says so.

The manifest is a file no other reader needs, and so is ``dist_ckpt.json``, which lists it: both
can be deleted and the checkpoint still loads everywhere. So that it then does not pass for one
written by another tool (loaded unverified), the save also marks ``.metadata`` -- the one file
every reader needs -- as checksummed (`mark_checksummed()`: an attribute of DCP's ``Metadata``
that DCP and Megatron-Core ignore, as they ignore ``mcore_data``), and a reader of a marked
checkpoint without its manifest refuses it (`require_manifest()`).

How the spans are found: DCP's file writer asks the stream for its position (``tell()``) right
before and right after each item; `RecordingStream` starts a new span at every ``tell()``, and
gives every large write (`OWN_SPAN_BYTES` or more: a tensor's data record, which
``torch.save`` writes in one call) a span of its own. The load reads that record in one call too,
so it checks the record's crc on the bytes it has just read, into the tensor they fill (see
`SpanChecker`): no second read of the data at save or at load. Small writes (an archive's
headers, its pickle) are gathered and passed on, with one crc, as one write: the per-write cost
of the checksums does not grow with the dozens of small writes of each ``torch.save``.

Example:

```python
fs = ChecksummingFileSystem()
with fs.create_stream(Path("ckpt/__0_0.distcp"), "wb") as stream:
    stream.tell(); stream.write(b"item"); stream.tell()
fs.digests["__0_0.distcp"].spans          # ((0, 4, crc32c(b"item")),)
```
"""

from __future__ import annotations

import io
import json
import threading
from bisect import bisect_left
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Dict, Generator, List, Mapping, Optional, Sequence, Tuple, Union

from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata

from dist_ckpt.backends.torch_dist.metadata import DCP_METADATA_FILENAME
from dist_ckpt.errors import ChecksumMismatchError, CorruptCheckpointError, IncompatibleStrategyError
from dist_ckpt.integrity.checksums import ALGORITHM, crc32c, crc_from_hex, crc_to_hex
from dist_ckpt.integrity.safe_json import loads
from dist_ckpt.record.commit import DCP_CHECKSUMS_FILENAME
from dist_ckpt.storage import Storage

__all__ = [
    "CHECKSUMS_FILENAME",
    "OWN_SPAN_BYTES",
    "ChecksummingFileSystem",
    "FileSpans",
    "RecordingStream",
    "check_bytes",
    "item_spans",
    "manifest_json",
    "mark_checksummed",
    "parse_manifest",
    "require_manifest",
    "spans_within",
]

#: the manifest of a torch_dist checkpoint written by dist_ckpt
CHECKSUMS_FILENAME = DCP_CHECKSUMS_FILENAME
_FORMAT = "dist_ckpt.torch_dist.checksums"
_VERSION = 1

#: the attribute of the pickled DCP ``Metadata`` that says its checkpoint has a manifest (a plain
#: dict: the restricted unpickler needs no class for it; DCP and Megatron-Core ignore it)
MARK_ATTRIBUTE = "dist_ckpt_checksums"
_MARK = {"manifest": CHECKSUMS_FILENAME, "algorithm": ALGORITHM, "version": _VERSION}

#: writes of at least this many bytes get a span of their own (a tensor's data record: the load
#: checks it on the bytes it reads); smaller ones are gathered into one write
OWN_SPAN_BYTES = 64 << 10

#: ``(offset, length, crc32c)`` of a byte range of a file
Span = Tuple[int, int, int]


@dataclass(frozen=True)
class FileSpans:
    """A file's size and the crc32c of each span of it (the spans tile ``[0, size)``)."""

    size: int
    spans: Tuple[Span, ...]

    def to_json(self) -> Dict[str, Any]:
        return {"size": self.size, "spans": [[o, n, crc_to_hex(c)] for o, n, c in self.spans]}


class RecordingStream(io.RawIOBase):
    """A write-only stream over ``raw`` that computes the crc32c of what passes, one span per
    stretch between two ``tell()`` calls and one per large write; `close()` reports the file's
    `FileSpans`.

    Writes smaller than `OWN_SPAN_BYTES` are gathered (up to that many bytes) and passed to
    ``raw`` as one write; `flush()`, `tell()`, `fileno()` and `close()` pass them on first.

    Args:
        raw: the open binary file.
        name: the file's name, under which the spans are reported.
        report: called once, with ``(name, spans)``, when the stream is closed.
    """

    def __init__(self, raw: IO[bytes], name: str, report: Any) -> None:
        super().__init__()
        self._raw = raw
        self._name = name
        self._report = report
        self._pos = 0  # bytes accepted, the pending ones included
        self._start = 0
        self._crc = 0
        self._pending = bytearray()
        self._spans: List[Span] = []

    def writable(self) -> bool:
        return True

    def _put(self, data: Any, nbytes: int) -> None:
        written = self._raw.write(data)
        if written is None or written != nbytes:  # a regular file writes everything or raises
            raise OSError(f"short write to {self._name}: {written} of {nbytes} bytes")
        self._crc = crc32c(data, self._crc)

    def _drain(self) -> None:
        if self._pending:
            data = bytes(self._pending)
            self._pending.clear()
            self._put(data, len(data))

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        nbytes = view.nbytes
        if nbytes < OWN_SPAN_BYTES:
            self._pending += view
            self._pos += nbytes
            if len(self._pending) >= OWN_SPAN_BYTES:
                self._drain()
            return nbytes
        self._cut()
        self._put(view, nbytes)
        self._pos += nbytes
        self._cut()
        return nbytes

    def _cut(self) -> None:
        self._drain()
        if self._pos > self._start:
            self._spans.append((self._start, self._pos - self._start, self._crc))
        self._start, self._crc = self._pos, 0

    def tell(self) -> int:
        self._cut()
        return self._pos

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        self._drain()
        self._raw.flush()

    def fileno(self) -> int:
        """The file's descriptor, every byte written so far passed on to it (an fsync of it
        then covers them)."""
        self.flush()
        return self._raw.fileno()

    def close(self) -> None:
        if self.closed:
            return
        self._cut()
        self._raw.flush()
        super().close()
        self._report(self._name, FileSpans(self._pos, tuple(self._spans)))


class ChecksummingFileSystem(FileSystem):
    """DCP's local file system, with every file written through a `RecordingStream`;
    the spans of each file written are in `digests`, by file name (thread-safe: DCP writes
    a rank's files from several threads)."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: Dict[str, FileSpans] = {}
        self._lock = threading.Lock()

    def _record(self, name: str, spans: FileSpans) -> None:
        with self._lock:
            self.digests[name] = spans

    @contextmanager
    def create_stream(self, path: Union[str, Any], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        target = Path(path)
        with target.open(mode) as raw:
            stream = RecordingStream(raw, target.name, self._record)
            try:
                yield stream
            finally:
                stream.close()


def spans_within(spans: Sequence[Span], offset: int, length: int) -> Optional[List[Span]]:
    """The spans that tile ``[offset, offset + length)`` exactly, or None when a span crosses its
    ends (the range cannot be checked on its own) or the spans leave a gap.

    Example:

    ```python
    spans_within([(0, 4, 1), (4, 6, 2)], 4, 6)     # [(4, 6, 2)]
    spans_within([(0, 10, 1)], 4, 6)              # None
    ```
    """
    found = [s for s in spans if s[0] < offset + length and s[0] + s[1] > offset]
    if length == 0:
        return []
    if not found or found[0][0] != offset or found[-1][0] + found[-1][1] != offset + length:
        return None
    position = offset
    for start, n, _ in found:
        if start != position:
            return None
        position += n
    return found


def item_spans(starts: Sequence[int], spans: Sequence[Span], offset: int, length: int) -> Optional[List[Span]]:
    """`spans_within()` for a file's spans sorted by offset, ``starts`` being their offsets:
    found by bisection, however many spans the file has.

    Example:

    ```python
    item_spans([0, 4], [(0, 4, 1), (4, 6, 2)], 4, 6)     # [(4, 6, 2)]
    ```
    """
    first = bisect_left(starts, offset)
    last = bisect_left(starts, offset + length)
    return spans_within(spans[first:last], offset, length)


def check_bytes(data: Union[bytes, memoryview], offset: int, spans: Sequence[Span], where: str, what: str) -> None:
    """Raise [`ChecksumMismatchError`][dist_ckpt.errors.ChecksumMismatchError] unless every span (absolute offsets;
    ``data`` starts at ``offset``) has its recorded crc32c.

    Example:

    ```python
    check_bytes(raw, item_offset, spans, "ckpt/__0_0.distcp", "tensor 'w'")
    ```
    """
    view = memoryview(data)
    for start, n, crc in spans:
        found = crc32c(view[start - offset : start - offset + n])
        if found != crc:
            raise ChecksumMismatchError(
                f"{what}: bytes {start}:{start + n} of {where} have crc32c {crc_to_hex(found)}, {crc_to_hex(crc)} "
                f"was recorded at save time: the file is corrupt"
            )


def manifest_json(files: Mapping[str, FileSpans]) -> bytes:
    """The manifest listing ``files`` (what rank 0 writes as `CHECKSUMS_FILENAME`)."""
    doc = {
        "format": _FORMAT,
        "version": _VERSION,
        "algorithm": ALGORITHM,
        "files": {name: files[name].to_json() for name in sorted(files)},
    }
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode("utf-8")


def _spans(entry: Any, where: str) -> FileSpans:
    if not isinstance(entry, dict) or not isinstance(entry.get("spans"), list):
        raise CorruptCheckpointError(f"{where} must be an object with 'size' and 'spans', found {entry!r}")
    size = entry.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise CorruptCheckpointError(f"{where}: 'size' must be an int >= 0, found {size!r}")
    spans: List[Span] = []
    position = 0
    for span in entry["spans"]:
        if not (isinstance(span, list) and len(span) == 3 and all(isinstance(v, int) for v in span[:2])):
            raise CorruptCheckpointError(f"{where}: a span must be [offset, length, crc32c], found {span!r}")
        if span[0] != position or span[1] <= 0:
            raise CorruptCheckpointError(f"{where}: spans must tile the file from byte 0; {span[:2]} at {position}")
        spans.append((span[0], span[1], crc_from_hex(span[2], f"{where}, span at {span[0]}")))
        position += span[1]
    if position != size:
        raise CorruptCheckpointError(f"{where}: the spans cover {position} bytes of a {size}-byte file")
    return FileSpans(size, tuple(spans))


def parse_manifest(raw: bytes, where: str) -> Dict[str, FileSpans]:
    """Validate a manifest; errors name ``where`` (its path) and the entry.

    Raises:
        CorruptCheckpointError: malformed.
        IncompatibleStrategyError: a newer manifest version.
    """
    doc = loads(raw, f"checksum manifest {where!r}")  # bounded size and depth: damage is a typed error
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT or doc.get("algorithm") != ALGORITHM:
        raise CorruptCheckpointError(f"{where!r} is not a {_FORMAT} manifest of {ALGORITHM} checksums")
    if doc.get("version") != _VERSION:
        raise IncompatibleStrategyError(
            f"checksum manifest {where!r} has version {doc.get('version')!r}; this dist_ckpt reads version "
            f"{_VERSION}: upgrade dist_ckpt"
        )
    files = doc.get("files")
    if not isinstance(files, dict):
        raise CorruptCheckpointError(f"checksum manifest {where!r}: 'files' must be an object")
    out = {}
    for name, entry in files.items():
        if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
            raise CorruptCheckpointError(f"checksum manifest {where!r}: {name!r} is not a file of the checkpoint")
        out[name] = _spans(entry, f"checksum manifest {where!r}, file {name!r}")
    return out


def mark_checksummed(metadata: Metadata) -> None:
    """Record in ``metadata`` (before it is written as ``.metadata``) that the save writes a
    manifest of its checksums (see the module docstring)."""
    setattr(metadata, MARK_ATTRIBUTE, dict(_MARK))


def require_manifest(metadata: Metadata, has_manifest: bool, storage: Storage) -> None:
    """Refuse a checkpoint (in ``storage``) whose ``.metadata`` says it was checksummed but whose
    manifest is gone: it would otherwise load unverified, as one written by another tool.

    Raises:
        CorruptCheckpointError: the manifest is missing, or the mark is not one this dist_ckpt wrote.

    Example:

    ```python
    require_manifest(layout.metadata, manifest is not None, storage)
    ```
    """
    mark = getattr(metadata, MARK_ATTRIBUTE, None)
    if mark is None:
        return
    where = storage.url_of(DCP_METADATA_FILENAME)
    if mark != _MARK:
        raise CorruptCheckpointError(
            f"{where} records checksums as {mark!r}, which this dist_ckpt did not write (expected {_MARK!r}): "
            f"the DCP metadata is corrupt"
        )
    if not has_manifest:
        raise CorruptCheckpointError(
            f"{storage.url_of(CHECKSUMS_FILENAME)} is missing, but {where} records that dist_ckpt checksummed this "
            f"checkpoint: the checksum manifest was deleted, so its files cannot be checked; the checkpoint is "
            f"corrupt ('dist-ckpt verify' checks what it can)"
        )
