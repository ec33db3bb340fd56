"""crc32c checksums of stored bytes: per block of a byte range, per file, and file manifests.

Every backend records, at save time, a crc32c (Castagnoli; hardware-accelerated by
``google-crc32c``) of what it stores, and checks it when the bytes are read back:

* **Blocks** (the ``safetensors`` backend): a stored shard's byte range is cut into blocks of
  ``block_bytes`` (the last one shorter), each with its own crc, so a load that reads part of a
  shard verifies only the blocks it touches. [`BlockChecksums`][dist_ckpt.integrity.checksums.BlockChecksums] computes
  them while the bytes stream past; [`encode_block_crcs()`][dist_ckpt.integrity.checksums.encode_block_crcs] /
  [`decode_block_crcs()`][dist_ckpt.integrity.checksums.decode_block_crcs] store them as one hex string.
* **Files** (zarr chunk files, ``common.pt``, ShardedObject files): one crc and size per file,
  listed in a *manifest*: a JSON document ``{"format": "dist_ckpt.checksums", "version": 1,
  "algorithm": "crc32c", "files": {"<relative path>": {"size": n, "crc32c": "8 hex digits"}}}``
  (`write_manifest()`, `read_manifest()`).

A checkpoint written before checksums existed has none: its loads skip verification, and
``dist-ckpt verify`` says so. [`IntegrityProblem`][dist_ckpt.integrity.checksums.IntegrityProblem] and
[`IntegrityReport`][dist_ckpt.integrity.checksums.IntegrityReport] are what each strategy's ``verify_integrity`` returns
to [`dist_ckpt.tools.verify`][dist_ckpt.tools.verify].

Example:

```python
crc = crc32c(b"hello")                       # 0x9a71bb4c
blocks = BlockChecksums(block_bytes=4)
blocks.update(b"abcdefghij"); blocks.finish()  # three crcs: "abcd", "efgh", "ij"
```
"""

from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import google_crc32c
import numpy as np

from dist_ckpt.errors import ChecksumMismatchError, CorruptCheckpointError, IncompatibleStrategyError
from dist_ckpt.integrity.safe_json import loads, shown
from dist_ckpt.storage.object_path import ObjectPath

__all__ = [
    "ALGORITHM",
    "DEFAULT_BLOCK_BYTES",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "BlockChecksums",
    "FileDigest",
    "IntegrityProblem",
    "IntegrityReport",
    "block_count",
    "block_spans",
    "bytes_digest",
    "check_file",
    "crc32c",
    "file_problem",
    "crc_from_hex",
    "crc_to_hex",
    "decode_block_crcs",
    "encode_block_crcs",
    "file_digest",
    "manifest_bytes",
    "manifest_document",
    "parse_manifest",
    "parse_manifest_bytes",
    "read_manifest",
    "write_manifest",
]

#: a file: a local path, or an object of a storage (:class:`~dist_ckpt.storage.object_path.ObjectPath`)
FileLike = Union[str, "os.PathLike[str]", ObjectPath]

ALGORITHM = "crc32c"
#: block size of the safetensors backend: a partial read verifies at most this many extra bytes
#: at each end of a contiguous range it reads
DEFAULT_BLOCK_BYTES = 1 << 20
MANIFEST_FORMAT = "dist_ckpt.checksums"
MANIFEST_VERSION = 1
_READ_CHUNK = 8 << 20
_BE32 = struct.Struct(">I")

if google_crc32c.implementation != "c":  # pragma: no cover -- depends on the installed wheel
    logging.getLogger(__name__).warning(
        "google-crc32c is using its pure-Python fallback (no C extension for this platform): "
        "checksumming saves and loads will be far slower; reinstall google-crc32c from a wheel"
    )

Bytes = Union[bytes, bytearray, memoryview, np.ndarray]


def _as_array(data: Bytes) -> Any:
    """google_crc32c takes read-only buffers without a release hook: numpy arrays and bytes qualify
    (a memoryview or bytearray does not), so wrap others in a zero-copy numpy view."""
    if isinstance(data, (bytes, np.ndarray)):
        return data
    return np.frombuffer(data, dtype=np.uint8)


def crc32c(data: Bytes, crc: int = 0) -> int:
    """crc32c of ``data``, continuing from ``crc`` (the crc of the bytes before it).

    Example:

    ```python
    crc32c(b"hello world") == crc32c(b" world", crc32c(b"hello"))   # True
    ```
    """
    if len(data) == 0:
        return crc
    return int(google_crc32c.extend(crc, _as_array(data)))


def crc_to_hex(crc: int) -> str:
    """The 8-hex-digit form of a crc stored in JSON (big-endian, lowercase).

    Example:

    ```python
    crc_to_hex(0x9A71BB4C)   # "9a71bb4c"
    ```
    """
    return f"{crc:08x}"


def crc_from_hex(text: Any, where: str) -> int:
    """Parse an 8-hex-digit crc; ``where`` names the file and field for the error.

    Example:

    ```python
    crc_from_hex("9a71bb4c", "index.json, file entry 'a' field 'header_crc32c'")   # 0x9A71BB4C
    ```

    Raises:
        CorruptCheckpointError: ``text`` is not 8 hex digits.
    """
    if not isinstance(text, str) or len(text) != 8:
        raise CorruptCheckpointError(f"{where}: a crc32c must be 8 hex digits, found {shown(text)}")
    try:
        return int(text, 16)
    except ValueError:
        raise CorruptCheckpointError(f"{where}: a crc32c must be 8 hex digits, found {shown(text)}") from None


def block_count(nbytes: int, block_bytes: int) -> int:
    """Number of blocks of a byte range of ``nbytes`` (0 for an empty range).

    Example:

    ```python
    block_count(10, 4)   # 3
    ```
    """
    return -(-nbytes // block_bytes)


def block_spans(begin: int, end: int, block_bytes: int) -> List[Tuple[int, int]]:
    """``[(start, stop), ...]`` absolute byte spans of the blocks of the range ``[begin, end)``.

    Example:

    ```python
    block_spans(100, 110, 4)   # [(100, 104), (104, 108), (108, 110)]
    ```
    """
    return [(s, min(s + block_bytes, end)) for s in range(begin, end, block_bytes)]


class BlockChecksums:
    """Computes one crc per ``block_bytes`` of a byte stream fed in pieces of any size.

    Example:

    ```python
    blocks = BlockChecksums(1 << 20)
    for piece in pieces:
        blocks.update(piece)
    crcs = blocks.finish()     # one per started block
    ```
    """

    def __init__(self, block_bytes: int) -> None:
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.block_bytes = block_bytes
        self.crcs: List[int] = []
        self._crc = 0
        self._filled = 0

    def update(self, data: Bytes) -> None:
        """Feed the next bytes of the stream."""
        array = _as_array(data)
        pos, n = 0, len(array)
        while pos < n:
            take = min(self.block_bytes - self._filled, n - pos)
            self._crc = int(google_crc32c.extend(self._crc, array[pos : pos + take]))
            self._filled += take
            pos += take
            if self._filled == self.block_bytes:
                self.crcs.append(self._crc)
                self._crc = self._filled = 0

    def finish(self) -> List[int]:
        """The crcs of every block, the last (short) one included; the stream ends here."""
        if self._filled:
            self.crcs.append(self._crc)
            self._crc = self._filled = 0
        return self.crcs


def encode_block_crcs(crcs: Sequence[int]) -> str:
    """Block crcs as one string of 8 hex digits per block (compact in JSON).

    Example:

    ```python
    encode_block_crcs([1, 0xFFFFFFFF])   # "00000001ffffffff"
    ```
    """
    return b"".join(_BE32.pack(c) for c in crcs).hex()


def decode_block_crcs(text: Any, blocks: int, where: str) -> Tuple[int, ...]:
    """Inverse of [`encode_block_crcs()`][dist_ckpt.integrity.checksums.encode_block_crcs], checking there is one crc
    per block.

    Example:

    ```python
    decode_block_crcs("00000001ffffffff", 2, "index.json (tensor 'w')")   # (1, 4294967295)
    ```

    Raises:
        CorruptCheckpointError: not a hex string of ``8 * blocks`` digits (``where`` names the
            file and the key).
    """
    if not isinstance(text, str) or len(text) != 8 * blocks:
        raise CorruptCheckpointError(
            f"{where}: 'crc32c' must be a string of {8 * blocks} hex digits ({blocks} blocks), found {shown(text)}"
        )
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise CorruptCheckpointError(f"{where}: 'crc32c' holds characters that are not hex digits") from None
    return tuple(c for (c,) in _BE32.iter_unpack(raw))


# --------------------------------------------------------------------------- files and manifests


@dataclass(frozen=True)
class FileDigest:
    """Size and crc32c of a whole file."""

    size: int
    crc32c: int

    def to_json(self) -> Dict[str, Any]:
        return {"size": self.size, ALGORITHM: crc_to_hex(self.crc32c)}


def file_digest(path: FileLike) -> FileDigest:
    """Read ``path`` once and return its size and crc32c.

    With positional reads (a local file) the file streams through a buffer of a few MiB; an
    object on an object store is downloaded in one request.

    Example:

    ```python
    file_digest(ckpt / "common.pt").crc32c
    ```
    """
    node = ObjectPath.of(path)
    if not node.storage.positional_reads:
        return bytes_digest(node.read_bytes())
    crc = size = 0
    buf = bytearray(_READ_CHUNK)
    with node.storage.open_reader(node.key) as reader:
        total = reader.size()
        while size < total:
            n = min(_READ_CHUNK, total - size)
            reader.read_into([memoryview(buf)[:n]], size)
            crc = crc32c(np.frombuffer(buf, dtype=np.uint8, count=n), crc)
            size += n
    return FileDigest(size, crc)


def bytes_digest(data: Bytes) -> FileDigest:
    """Size and crc32c of bytes already in memory (what was just written, or just read).

    Example:

    ```python
    bytes_digest(b"hello")   # FileDigest(size=5, crc32c=0x9a71bb4c)
    ```
    """
    size = data.nbytes if isinstance(data, (memoryview, np.ndarray)) else len(data)
    return FileDigest(int(size), crc32c(data))


def manifest_document(files: Mapping[str, FileDigest]) -> Dict[str, Any]:
    """The JSON document of a manifest listing ``files`` (relative paths, ``/``-separated).

    Example:

    ```python
    manifest_document({"common.pt": FileDigest(3, 0x12345678)})["files"]   # {"common.pt": {...}}
    ```
    """
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "algorithm": ALGORITHM,
        "files": {name: files[name].to_json() for name in sorted(files)},
    }


def write_manifest(path: FileLike, files: Mapping[str, FileDigest]) -> None:
    """Write a manifest atomically and durably.

    Example:

    ```python
    write_manifest(ckpt / "common.checksums.json", {"common.pt": file_digest(ckpt / "common.pt")})
    ```
    """
    ObjectPath.of(path).write_bytes(manifest_bytes(files))


def manifest_bytes(files: Mapping[str, FileDigest]) -> bytes:
    """The serialized manifest of ``files`` (what `write_manifest()` writes).

    Example:

    ```python
    storage.write("common.checksums.json", manifest_bytes({"common.pt": bytes_digest(data)}))
    ```
    """
    return json.dumps(manifest_document(files), indent=1, sort_keys=True).encode("utf-8")


def parse_manifest(doc: Any, path: Union[str, Path]) -> Dict[str, FileDigest]:
    """Validate a manifest document; every error names ``path`` and the offending entry.

    Example:

    ```python
    files = parse_manifest(json.loads(raw), Path("ckpt/zarr/checksums.json"))
    ```

    Raises:
        CorruptCheckpointError: malformed document or entry.
        IncompatibleStrategyError: a manifest version this dist_ckpt does not read.
    """
    where = f"checksum manifest {str(path)!r}"
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where} must hold a JSON object, found {type(doc).__name__}")
    if doc.get("format") != MANIFEST_FORMAT:
        raise CorruptCheckpointError(f"{where}: 'format' is {shown(doc.get('format'))}, expected {MANIFEST_FORMAT!r}")
    if doc.get("version") != MANIFEST_VERSION:
        raise IncompatibleStrategyError(
            f"{where} has version {shown(doc.get('version'))}; this dist_ckpt reads version {MANIFEST_VERSION}: "
            "upgrade dist_ckpt"
        )
    if doc.get("algorithm") != ALGORITHM:
        raise CorruptCheckpointError(f"{where}: 'algorithm' is {shown(doc.get('algorithm'))}, expected {ALGORITHM!r}")
    entries = doc.get("files")
    if not isinstance(entries, dict):
        raise CorruptCheckpointError(f"{where}: 'files' must be a JSON object, found {shown(entries)}")
    files: Dict[str, FileDigest] = {}
    for name, entry in entries.items():
        parts = name.split("/")
        if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise CorruptCheckpointError(f"{where}: file name {name!r} is not a plain relative path")
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"{where}: entry {name!r} must be a JSON object, found {shown(entry)}")
        size = entry.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise CorruptCheckpointError(
                f"{where}: entry {name!r} field 'size' must be an int >= 0, found {shown(size)}"
            )
        files[name] = FileDigest(
            size, crc_from_hex(entry.get(ALGORITHM), f"{where}, entry {name!r} field {ALGORITHM!r}")
        )
    return files


def read_manifest(path: FileLike) -> Optional[Dict[str, FileDigest]]:
    """The manifest at ``path``, or None if there is none (a checkpoint saved without checksums).

    Raises:
        CorruptCheckpointError: the file exists but is not a valid manifest (names the file and
            the entry).

    Example:

    ```python
    digests = read_manifest(ckpt / "zarr" / "checksums.json") or {}
    ```
    """
    node = ObjectPath.of(path)
    try:
        raw = node.read_bytes()
    except FileNotFoundError:  # ObjectNotFoundError is one
        return None
    return parse_manifest_bytes(raw, str(node))


def parse_manifest_bytes(raw: bytes, where: str) -> Dict[str, FileDigest]:
    """[`parse_manifest()`][dist_ckpt.integrity.checksums.parse_manifest] of a serialized manifest; ``where`` names it
    (path or URL) in errors.

    Example:

    ```python
    files = parse_manifest_bytes(storage.read("zarr/checksums.json"), storage.url_of("zarr/checksums.json"))
    ```
    """
    return parse_manifest(loads(raw, f"checksum manifest {where!r}"), where)


def file_problem(path: FileLike, expected: FileDigest, data: Optional[Bytes] = None) -> Optional[Tuple[str, bool]]:
    """What is wrong with the file at ``path`` (or ``data``, its bytes already read) compared with
    ``expected``: ``(problem, is_checksum_mismatch)``, or None if it matches.

    Example:

    ```python
    file_problem(ckpt / "common.pt", manifest["common.pt"])   # None, or ("missing", False), ...
    ```
    """
    if data is None:
        try:
            found = file_digest(path)
        except FileNotFoundError:
            return "missing", False
    else:
        found = FileDigest(len(data), crc32c(data))
    if found.size != expected.size:
        return f"has {found.size} bytes, {expected.size} were recorded at save time (truncated or replaced)", False
    if found.crc32c != expected.crc32c:
        recorded = crc_to_hex(expected.crc32c)
        return f"crc32c {crc_to_hex(found.crc32c)} differs from the {recorded} recorded at save time (corrupt)", True
    return None


def check_file(path: FileLike, expected: FileDigest, what: str, data: Optional[Bytes] = None) -> None:
    """Raise if the file at ``path`` (or ``data``, its already-read bytes) does not match ``expected``.

    Example:

    ```python
    check_file(ckpt / "common.pt", manifest["common.pt"], "the common state", data=raw_bytes)
    ```

    Raises:
        CorruptCheckpointError: missing or of another size.
        ChecksumMismatchError: same size, other crc.
    """
    found = file_problem(path, expected, data)
    if found is not None:
        problem, mismatch = found
        cls = ChecksumMismatchError if mismatch else CorruptCheckpointError
        raise cls(f"{what}: {str(path)!r} {problem}")


# --------------------------------------------------------------------------- verification results


@dataclass(frozen=True)
class IntegrityProblem:
    """One missing, damaged or inconsistent file of a checkpoint.

    Attributes:
        path: the file, relative to the checkpoint directory (``/``-separated).
        problem: what is wrong, one line.
        key: the tensor or object key the file holds, when known.
    """

    path: str
    problem: str
    key: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        return {"path": self.path, "problem": self.problem, "key": self.key}

    def __str__(self) -> str:
        where = f" (key {self.key!r})" if self.key is not None else ""
        return f"{self.path}{where}: {self.problem}"


@dataclass
class IntegrityReport:
    """What a strategy found when it verified its part of a checkpoint.

    Attributes:
        problems: every problem found (empty when healthy).
        files_checked: files read whole or checked against recorded checksums.
        bytes_checked: bytes whose checksum was recomputed.
        notes: remarks that are not problems (e.g. "saved without checksums").
    """

    problems: List[IntegrityProblem] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0
    notes: List[str] = field(default_factory=list)

    def add(self, path: str, problem: str, key: Optional[str] = None) -> None:
        """Record a problem."""
        self.problems.append(IntegrityProblem(path, problem, key))
