"""Integrity records on disk: digested at commit, checked at every read (fails closed).

The records a save writes (checksum manifests, the safetensors index; see
`dist_ckpt.integrity.records`) are declared by its strategies
(``SaveStrategyBase.integrity_records``). At commit, rank 0 digests the ones present
(`digest_records()`) and [`save_config()`][dist_ckpt.record.commit.save_config] lists them in
``metadata.json``. Every reader of a record goes through `read_recorded()`:

* the record is listed: it must exist with the recorded size, crc32c and version, else
  [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError] (deleting ``zarr/checksums.json`` or rewriting
  ``safetensors/index.json`` as version 1 no longer switches verification off);
* ``metadata.json`` lists records but not this one: the save did not write it (e.g. saved
  without checksums); a file found there anyway was not written by the save and is refused;
* a checkpoint saved before records existed (``metadata.json`` of format version 1 without the
  list): the record is read as it is (unverified; the engine logs that once per load). A record
  of a later format version without the list is corrupt: the list was removed
  ([`read_integrity_records()`][dist_ckpt.record.commit.read_integrity_records]).

Tools that change a committed checkpoint (``remove_sharded_tensors``) rewrite the record and
then its entry (`refresh_record()`).

Example:

```python
raw = read_recorded(LocalStorage("ckpt/iter_10"), "zarr/checksums.json")   # None: none was written
```
"""

from __future__ import annotations

import json
import logging
from typing import Dict, Iterable, Optional, Union

from dist_ckpt.errors import CorruptCheckpointError
from dist_ckpt.integrity.records import RECORDS_FIELD, IntegrityRecord, check_record, record_of, records_json
from dist_ckpt.integrity.safe_json import MAX_SMALL_JSON_BYTES, loads, want_object
from dist_ckpt.record.commit import METADATA_FILENAME, RECORD_FILENAME, read_integrity_records
from dist_ckpt.storage import ObjectNotFoundError, Storage
from dist_ckpt.storage.object_path import ObjectPath

__all__ = ["digest_records", "location_of_node", "read_recorded", "refresh_record"]

logger = logging.getLogger(__name__)


def location_of_node(node: Union[Storage, ObjectPath]) -> Storage:
    """The storage of a checkpoint root given as a storage or as a node (an object path) of one."""
    if isinstance(node, ObjectPath):
        return node.storage.child(node.key) if node.key else node.storage
    return node


def digest_records(storage: Storage, names: Iterable[str]) -> Dict[str, IntegrityRecord]:
    """The records of the files ``names`` that exist in the checkpoint ``storage`` (rank 0, at commit).

    Example:

    ```python
    digest_records(LocalStorage("ckpt"), ["safetensors/index.json", "zarr/checksums.json"])
    ```
    """
    records: Dict[str, IntegrityRecord] = {}
    for name in sorted(set(names)):
        try:
            records[name] = record_of(storage.read(name))
        except ObjectNotFoundError:
            continue
    return records


def read_recorded(checkpoint_dir: Union[Storage, ObjectPath], key: str) -> Optional[bytes]:
    """The bytes of integrity record ``key``, checked against ``metadata.json``; None when the
    save wrote no such record (see the module docstring).

    Raises:
        CorruptCheckpointError: the record is listed but missing or different (its subclass
            ``ChecksumMismatchError`` for other bytes of the same size), or present but not
            listed.
    """
    storage = location_of_node(checkpoint_dir)
    where = storage.url_of(key)
    records = read_integrity_records(storage)
    try:
        data: Optional[bytes] = storage.read(key)
    except ObjectNotFoundError:
        data = None
    if records is None:  # saved before records existed: nothing to check against
        return data
    expected = records.get(key)
    if expected is None:
        if data is not None:
            raise CorruptCheckpointError(
                f"{where} is not one of the integrity records {METADATA_FILENAME} lists: the save did not write it "
                "(it was added later); the checkpoint is corrupt"
            )
        return None
    if data is None:
        raise CorruptCheckpointError(
            f"{where} is missing, but {METADATA_FILENAME} records it ({expected.size} bytes): the integrity record "
            "was deleted; the checkpoint is corrupt ('dist-ckpt verify' lists every problem)"
        )
    check_record(data, expected, where)
    return data


def refresh_record(storage: Storage, key: str) -> None:
    """Update the entry of record ``key`` in ``metadata.json`` (``dist_ckpt.json`` for a
    Megatron-format checkpoint) after a tool rewrote the record (one process). Nothing to do for
    a checkpoint saved before records existed, or without ``metadata.json``.

    Example:

    ```python
    refresh_record(LocalStorage("ckpt"), "safetensors/index.json")   # after remove_sharded_tensors
    ```
    """
    for name in (METADATA_FILENAME, RECORD_FILENAME):
        try:
            raw = storage.read(name)
        except ObjectNotFoundError:  # not a committed checkpoint, or no side record: nothing to update
            if name == METADATA_FILENAME:
                return
            continue
        doc = want_object(loads(raw, storage.url_of(name), MAX_SMALL_JSON_BYTES), storage.url_of(name))
        if RECORDS_FIELD in doc:
            break
    else:
        return
    records = read_integrity_records(storage) or {}
    try:
        records[key] = record_of(storage.read(key))
    except ObjectNotFoundError:
        records.pop(key, None)
    doc[RECORDS_FIELD] = records_json(records)
    storage.write(name, json.dumps(doc, indent=2, sort_keys=True).encode("utf-8"))  # atomic
    logger.debug("%s: record of %s updated", storage.url_of(name), key)
