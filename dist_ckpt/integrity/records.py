"""Integrity records: the files that vouch for a checkpoint's bytes, and their own digests.

A checkpoint's data is verified against *integrity records*: the checksum manifests
(``common.checksums.json``, ``objects/checksums.json``, ``zarr/checksums.json``) and the
safetensors ``index.json``, whose version 2 carries block checksums. A record that is missing or
replaced by an older version would switch verification off -- "saved without checksums" -- so
``metadata.json``, written last, lists every record the save wrote with its size, crc32c and
format version ([`dist_ckpt.record.commit`][dist_ckpt.record.commit]). Loaders read records through
`dist_ckpt.record.records.read_recorded()`, which checks them against that list: a missing,
truncated, tampered or downgraded record is a [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError].

This module holds the data model and the pure checks (no I/O):

```text
"integrity_records": {
  "safetensors/index.json": {"size": 1834, "crc32c": "1a2b3c4d", "version": 2},
  "common.checksums.json":  {"size": 201,  "crc32c": "5e6f7a8b", "version": 1}
}
```

Example:

```python
record = record_of(raw_index_bytes)      # IntegrityRecord(size=1834, crc32c=..., version=2)
check_record(raw_index_bytes, record, "ckpt/safetensors/index.json")   # passes
```
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from dist_ckpt.errors import ChecksumMismatchError, CorruptCheckpointError
from dist_ckpt.integrity.checksums import crc32c, crc_from_hex, crc_to_hex
from dist_ckpt.integrity.safe_json import want_int, want_object

__all__ = ["RECORDS_FIELD", "IntegrityRecord", "check_record", "parse_records", "record_of", "records_json"]

#: the field of ``metadata.json`` that lists the records; its absence marks a checkpoint saved
#: before records existed (format version 1: loaded unverified, with a warning), and is
#: corruption in a later format version (``dist_ckpt.record.commit.RECORDS_REQUIRED_SINCE``)
RECORDS_FIELD = "integrity_records"


@dataclass(frozen=True)
class IntegrityRecord:
    """Size, crc32c and format version (when the record is a JSON document with an integer
    ``version``) of one integrity record, as the save wrote it."""

    size: int
    crc32c: int
    version: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        doc: Dict[str, Any] = {"size": self.size, "crc32c": crc_to_hex(self.crc32c)}
        if self.version is not None:
            doc["version"] = self.version
        return doc


def _version_of(data: bytes) -> Optional[int]:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return None
    version = doc.get("version") if isinstance(doc, dict) else None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def record_of(data: bytes) -> IntegrityRecord:
    """The record of a file whose bytes are ``data`` (read back at commit, on rank 0).

    Example:

    ```python
    record_of(b'{"version": 2}')   # IntegrityRecord(size=14, crc32c=..., version=2)
    ```
    """
    return IntegrityRecord(len(data), crc32c(data), _version_of(data))


def records_json(records: Mapping[str, IntegrityRecord]) -> Dict[str, Any]:
    """The ``metadata.json`` form of ``records`` (sorted by key)."""
    return {key: records[key].to_json() for key in sorted(records)}


def parse_records(value: Any, where: str) -> Dict[str, IntegrityRecord]:
    """Validate the ``integrity_records`` field of ``metadata.json`` (``where`` names the file).

    Raises:
        CorruptCheckpointError: a malformed entry, naming it.
    """
    out: Dict[str, IntegrityRecord] = {}
    for key, entry in want_object(value, f"{where}: field {RECORDS_FIELD!r}").items():
        at = f"{where}: {RECORDS_FIELD!r} entry {key!r}"
        fields = want_object(entry, at)
        version = fields.get("version")
        out[key] = IntegrityRecord(
            want_int(fields.get("size"), f"{at} field 'size'"),
            crc_from_hex(fields.get("crc32c"), f"{at} field 'crc32c'"),
            None if version is None else want_int(version, f"{at} field 'version'"),
        )
    return out


def check_record(data: bytes, expected: IntegrityRecord, where: str) -> None:
    """Raise unless ``data`` (the record file's bytes, read from ``where``) is what the save wrote.

    Raises:
        CorruptCheckpointError: another size or format version (truncated, or replaced by an
            older version: a downgrade that would switch verification off).
        ChecksumMismatchError: same size, other bytes.
    """
    found = record_of(data)
    if expected.version is not None and found.version != expected.version:
        raise CorruptCheckpointError(
            f"{where} has format version {found.version!r}, but metadata.json recorded version {expected.version} "
            "at save time: the file was replaced (a downgrade would switch its checks off); the checkpoint is corrupt"
        )
    if found.size != expected.size:
        raise CorruptCheckpointError(
            f"{where} has {found.size} bytes, metadata.json recorded {expected.size} at save time "
            "(truncated or replaced): the checkpoint is corrupt"
        )
    if found.crc32c != expected.crc32c:
        raise ChecksumMismatchError(
            f"{where} has crc32c {crc_to_hex(found.crc32c)}, metadata.json recorded {crc_to_hex(expected.crc32c)} "
            "at save time: the file was modified; the checkpoint is corrupt"
        )
