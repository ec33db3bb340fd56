"""Checkpoint configuration and the ``metadata.json`` commit record.

``metadata.json`` is the last file of a save, written by rank 0 after every rank has flushed its
files. Its presence (with valid content) is what makes a directory (or an object-store prefix) a
checkpoint. Schema (format version 2):

```python
{
  "sharded_backend": "zarr",          # str: format of the sharded tensors
  "sharded_backend_version": 1,       # int
  "common_backend": "torch",          # str: format of the common (non-sharded) state
  "common_backend_version": 1,        # int
  "dist_ckpt": {                      # optional; written by dist_ckpt
    "format_version": 2,
    "library_version": "0.1.0",
    "world_size": 4,
    "save_id": "3f2a..."              # random id of the save that committed it
  },
  "integrity_records": {              # every integrity record the save wrote (from format version 2 on)
    "safetensors/index.json": {"size": 1834, "crc32c": "1a2b3c4d", "version": 2}
  }
}
```

``integrity_records`` (see `dist_ckpt.integrity.records`) makes integrity fail closed: a
record it lists that is missing, modified or downgraded is corruption, never "saved without
checksums". The format version moves whenever a field becomes mandatory: from version 2
(`RECORDS_REQUIRED_SINCE`) on, ``integrity_records`` is, so a record of version 2 without it (or
without a version at all) is a [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError]: the field was
removed. A checkpoint of version 1 without the field was saved before records existed and loads unverified, with a
warning.

Megatron-Core reads ``metadata.json`` with ``CheckpointingConfig(**json)`` and refuses any key it
does not know. For the backends Megatron-Core loads (`MEGATRON_BACKENDS`: ``torch_dist``)
``metadata.json`` therefore holds exactly its four keys, as Megatron-Core writes them, and the
``"dist_ckpt"`` record and the ``integrity_records`` go to ``dist_ckpt.json``
(`RECORD_FILENAME`) beside it, written before the commit;
[`read_save_record()`][dist_ckpt.record.commit.read_save_record] and
[`read_integrity_records()`][dist_ckpt.record.commit.read_integrity_records] find them in either place. (Such a
checkpoint written by Megatron-Core itself has no ``dist_ckpt.json``, so there a deleted ``dist_ckpt.json`` cannot be
told from one never written: it loads unverified, with the warning.)
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from dist_ckpt._version import __version__
from dist_ckpt.errors import CheckpointExistsError, CheckpointingException, CorruptCheckpointError, NotACheckpointError
from dist_ckpt.integrity.records import RECORDS_FIELD, IntegrityRecord, parse_records, records_json
from dist_ckpt.integrity.safe_json import MAX_SMALL_JSON_BYTES, loads, want_object
from dist_ckpt.storage.base import Storage
from dist_ckpt.storage.errors import ObjectExistsError, ObjectNotFoundError, StorageError
from dist_ckpt.storage.location import LocationLike, resolve_location

logger = logging.getLogger(__name__)

__all__ = [
    "BIN_WEIGHTS_INDEX_NAME",
    "BIN_WEIGHTS_NAME",
    "CheckpointingConfig",
    "CheckpointingException",
    "DCP_CHECKSUMS_FILENAME",
    "DCP_CONFIG",
    "MEGATRON_BACKENDS",
    "METADATA_FILENAME",
    "HF_CONFIG",
    "HF_WEIGHT_FILES",
    "RECORD_FILENAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "check_is_distributed_checkpoint",
    "detect_config",
    "is_plain_dcp_directory",
    "lacks_dist_ckpt_record",
    "maybe_load_config",
    "new_save_id",
    "read_config",
    "read_integrity_records",
    "read_save_record",
    "save_config",
]

METADATA_FILENAME = "metadata.json"
#: where dist_ckpt's record of a save goes when ``metadata.json`` must hold Megatron-Core's keys only
RECORD_FILENAME = "dist_ckpt.json"
#: sharded backends whose ``metadata.json`` Megatron-Core reads (and refuses with unknown keys)
MEGATRON_BACKENDS = frozenset({"torch_dist"})
#: the format version of the record dist_ckpt writes (see the module docstring)
FORMAT_VERSION = 2
#: the first format version whose record must list its integrity records
RECORDS_REQUIRED_SINCE = 2
LIBRARY_VERSION = __version__  # the version of the dist_ckpt that writes metadata.json


@dataclass(frozen=True)
class CheckpointingConfig:
    """The backends (formats) a checkpoint was written with.

    The version describes the on-disk format of a backend, not the checkpoint's content.
    """

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1


_FIELD_TYPES = {
    "sharded_backend": str,
    "sharded_backend_version": int,
    "common_backend": str,
    "common_backend_version": int,
}


def new_save_id() -> str:
    """A random identifier of one save, recorded in ``metadata.json`` (see
    [`save_config()`][dist_ckpt.record.commit.save_config])."""
    return uuid.uuid4().hex


def save_config(
    config: CheckpointingConfig,
    checkpoint_dir: LocationLike,
    world_size: Optional[int] = None,
    save_id: Optional[str] = None,
    records: Optional[Mapping[str, IntegrityRecord]] = None,
) -> None:
    """Write ``metadata.json`` atomically and durably: the commit of a checkpoint (rank 0 only).

    ``records`` are the integrity records the save wrote (see
    `dist_ckpt.record.records.digest_records()`); None: it wrote none (an empty list is recorded,
    so that a record file found later is refused).

    The marker is created only if absent ([`put_if_absent()`][dist_ckpt.storage.base.Storage.put_if_absent]:
    on a local disk a fsynced temporary file hard-linked into place, then the directory fsynced;
    on an object store a put with ``If-None-Match: *``), so a commit never overwrites another
    save's marker. If the marker is already there -- e.g. the server applied a first attempt
    whose response was lost, and the client retried -- it is read back and accepted only if it
    carries this save's ``save_id``; otherwise [`CheckpointExistsError`][dist_ckpt.errors.CheckpointExistsError]
    is raised.

    Example:

    ```python
    save_config(CheckpointingConfig("safetensors"), "s3://bucket/ckpt/iter_10", world_size=8)
    ```
    """
    location = resolve_location(checkpoint_dir)
    writer: Dict[str, Any] = {"format_version": FORMAT_VERSION, "library_version": LIBRARY_VERSION}
    if world_size is not None:
        writer["world_size"] = world_size
    save_id = save_id or new_save_id()
    writer["save_id"] = save_id
    record: Dict[str, Any] = asdict(config)
    if config.sharded_backend in MEGATRON_BACKENDS:
        # Megatron-Core's exact metadata.json; dist_ckpt's records in their own file, written whole before the commit
        data = json.dumps(record).encode("utf-8")
        side: Dict[str, Any] = {"dist_ckpt": writer, RECORDS_FIELD: records_json(records or {})}
        location.write(RECORD_FILENAME, json.dumps(side, indent=2, sort_keys=True).encode("utf-8"))
    else:
        record["dist_ckpt"] = writer
        record[RECORDS_FIELD] = records_json(records or {})
        data = json.dumps(record, indent=2, sort_keys=True).encode("utf-8")
    try:
        location.put_if_absent(METADATA_FILENAME, data)
    except ObjectExistsError as e:
        try:
            found = read_save_record(location).get("save_id")
        except (AttributeError, CheckpointingException):
            found = None
        if found != save_id:
            raise CheckpointExistsError(
                f"{location.url_of(METADATA_FILENAME)} was committed by another save while this one was running "
                f"(its save_id is {found!r}, ours {save_id!r}); this save is not committed: save to a new location"
            ) from e
        logger.info(
            "%s: the commit marker is ours (a retried put had already landed)", location.url_of(METADATA_FILENAME)
        )


def read_save_record(checkpoint_dir: LocationLike) -> Dict[str, Any]:
    """dist_ckpt's record of the save that committed ``checkpoint_dir`` (``format_version``,
    ``library_version``, ``world_size``, ``save_id``): the ``"dist_ckpt"`` entry of
    ``metadata.json``, or of ``dist_ckpt.json`` for Megatron-format checkpoints; {} when there is
    none (a checkpoint written by another tool) or it is damaged.

    Raises:
        StorageError: an object store refused the request (credentials, missing bucket, ...).

    Example:

    ```python
    read_save_record("ckpt/iter_10").get("world_size")     # 8
    ```
    """
    location = resolve_location(checkpoint_dir)
    for name in (METADATA_FILENAME, RECORD_FILENAME):
        try:
            found = _read_record(location, name)
        except CorruptCheckpointError:  # damaged: not recorded there
            continue
        writer = None if found is None else found[0].get("dist_ckpt")
        if isinstance(writer, dict):
            return writer
    return {}


def _parse_record(raw: bytes, where: str) -> Dict[str, Any]:
    """A JSON object of the commit (any damage: [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError])."""
    return want_object(loads(raw, where, MAX_SMALL_JSON_BYTES), where)


def _read_record(location: Storage, name: str = METADATA_FILENAME) -> Optional[Tuple[Dict[str, Any], str]]:
    """The parsed ``name`` (``metadata.json`` or ``dist_ckpt.json``) of a location and where it
    is, or None if absent (a link out of the checkpoint is refused by the storage, like every read)."""
    try:
        raw = location.read(name)
    except ObjectNotFoundError:
        return None
    where = location.url_of(name)
    return _parse_record(raw, where), where


def _parse_config(record: Dict[str, Any], where: str) -> CheckpointingConfig:
    values: Dict[str, Any] = {}
    for name, expected in _FIELD_TYPES.items():
        if name not in record:
            if name == "sharded_backend":
                raise CorruptCheckpointError(f"{where} has no {name!r} field")
            continue
        value = record[name]
        if not isinstance(value, expected) or isinstance(value, bool):
            raise CorruptCheckpointError(
                f"{where}: field {name!r} must be {expected.__name__}, found {type(value).__name__} ({value!r})"
            )
        values[name] = value
    return CheckpointingConfig(
        sharded_backend=str(values["sharded_backend"]),
        sharded_backend_version=int(values.get("sharded_backend_version", 1)),
        common_backend=str(values.get("common_backend", "torch")),
        common_backend_version=int(values.get("common_backend_version", 1)),
    )


def maybe_load_config(checkpoint_dir: LocationLike) -> Optional[CheckpointingConfig]:
    """The checkpoint's config, or None if ``checkpoint_dir`` holds no ``metadata.json``.

    Raises:
        CorruptCheckpointError: if ``metadata.json`` exists but is not a valid config.
        StorageError: an object store refused the request (credentials, missing bucket, ...).
    """
    found = _read_record(resolve_location(checkpoint_dir))
    return None if found is None else _parse_config(*found)


def read_integrity_records(checkpoint_dir: LocationLike) -> Optional[Dict[str, IntegrityRecord]]:
    """The integrity records ``metadata.json`` lists (for Megatron-format checkpoints,
    ``dist_ckpt.json``; see `dist_ckpt.integrity.records`), or None for a checkpoint saved
    before records existed (format version 1, or written by another tool; or without ``metadata.json``).

    Raises:
        CorruptCheckpointError: ``metadata.json`` or its records are malformed, or a record of
            a format version that requires them lists none (the field was removed).

    Example:

    ```python
    read_integrity_records("ckpt/iter_10")["safetensors/index.json"].version   # 2
    ```
    """
    location = resolve_location(checkpoint_dir)
    found = _read_record(location)
    if found is None:
        return None
    if RECORDS_FIELD not in found[0] and "dist_ckpt" not in found[0]:
        # a Megatron-format checkpoint keeps them beside metadata.json
        found = _read_record(location, RECORD_FILENAME) or found
    doc, where = found
    if RECORDS_FIELD in doc:
        return parse_records(doc[RECORDS_FIELD], where)
    _check_records_optional(doc, where)
    return None


def lacks_dist_ckpt_record(checkpoint_dir: LocationLike) -> bool:
    """Whether the checkpoint has a ``metadata.json`` but neither it nor ``dist_ckpt.json`` holds
    the ``dist_ckpt`` record that every dist_ckpt save writes: written by another tool, or the
    record was removed. A backend only dist_ckpt writes refuses such a checkpoint.

    Example:

    ```python
    lacks_dist_ckpt_record("ckpt/iter_10")   # False for a checkpoint dist_ckpt saved
    ```
    """
    location = resolve_location(checkpoint_dir)
    found = _read_record(location)
    if found is None:  # not committed: nothing to say
        return False
    if isinstance(found[0].get("dist_ckpt"), dict):
        return False
    side = _read_record(location, RECORD_FILENAME)
    return side is None or not isinstance(side[0].get("dist_ckpt"), dict)


def _check_records_optional(doc: Dict[str, Any], where: str) -> None:
    """Raise [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError] if the record ``doc`` (read from
    ``where``, without integrity records) was written by a dist_ckpt format that always lists them: the list was
    removed, and reading the checkpoint as one saved before records existed would switch verification off."""
    writer = doc.get("dist_ckpt")
    if not isinstance(writer, dict):  # written by another tool (Megatron-Core, a test): nothing was recorded
        return
    version = writer.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CorruptCheckpointError(
            f"{where}: the 'dist_ckpt' record has no integer 'format_version' (found {version!r}) and no "
            f"{RECORDS_FIELD!r}: both were removed or damaged; the checkpoint is corrupt ('dist-ckpt verify' lists "
            "every problem)"
        )
    if version >= RECORDS_REQUIRED_SINCE:
        raise CorruptCheckpointError(
            f"{where} was written with format version {version}, which always lists the save's integrity records, "
            f"but has no {RECORDS_FIELD!r} field: it was removed, and the checkpoint's checksum manifests and index "
            "cannot be checked; the checkpoint is corrupt ('dist-ckpt verify' lists every problem)"
        )


def read_config(checkpoint_dir: LocationLike) -> CheckpointingConfig:
    """The checkpoint's config; raises a clear error if the location is not a checkpoint."""
    location = resolve_location(checkpoint_dir)
    config = maybe_load_config(location)
    if config is None:
        if location.local_paths and not location.dir_exists():
            # unquoted, as Megatron-Core words it: callers match on "directory <path> does not exist"
            raise NotACheckpointError(
                f"checkpoint directory {location.url} does not exist; pass a committed checkpoint"
            )
        where = "directory" if location.local_paths else "location"
        # starts as Megatron-Core words it (callers match "<dir> is not a distributed checkpoint")
        raise NotACheckpointError(
            f"{location.url} is not a distributed checkpoint: it is not a committed dist_ckpt checkpoint, "
            f"{METADATA_FILENAME} is missing (the save did not finish, or this is not a checkpoint {where})"
        )
    return config


#: how a HuggingFace folder (safetensors weights and no metadata.json) is loaded: with the
#: built-in read-only "hf" strategies (dist_ckpt.hf.strategy)
HF_CONFIG = CheckpointingConfig("hf", 1, "hf", 1)
#: how a plain torch.distributed.checkpoint directory (DCP's ``.metadata``, no metadata.json) is
#: loaded: with the built-in read-only "dcp" strategies (dist_ckpt.backends.torch_dist.plain)
DCP_CONFIG = CheckpointingConfig("dcp", 1, "dcp", 1)
#: DCP's metadata file, written last by its save: what makes a directory a DCP checkpoint
DCP_METADATA_FILENAME = ".metadata"
#: the crc32c manifest that dist_ckpt writes beside DCP's files (torch_dist backend, dist_ckpt.dcp.StorageWriter);
#: defined here so that a DCP directory holding it is still told to be one
DCP_CHECKSUMS_FILENAME = "torch_dist.checksums.json"

# HuggingFace weight file names (transformers' names), defined here, where a location is told
# to be a dist_ckpt checkpoint or an HF folder, for every package above (hf/, training/)
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
BIN_WEIGHTS_NAME = "pytorch_model.bin"
BIN_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
#: ``(file name, is_index, safetensors)`` of every HF weight file, in the order that decides a
#: directory's format (the first one present)
HF_WEIGHT_FILES: Tuple[Tuple[str, bool, bool], ...] = (
    (SAFE_WEIGHTS_INDEX_NAME, True, True),
    (SAFE_WEIGHTS_NAME, False, True),
    (BIN_WEIGHTS_INDEX_NAME, True, False),
    (BIN_WEIGHTS_NAME, False, False),
)


def detect_config(checkpoint_dir: LocationLike) -> CheckpointingConfig:
    """The config to load ``checkpoint_dir`` with: its ``metadata.json``; for a local folder without
    one, `HF_CONFIG` if it holds HuggingFace weights (``model.safetensors`` or its index), or
    `DCP_CONFIG` if it is a plain DCP directory
    ([`is_plain_dcp_directory()`][dist_ckpt.record.commit.is_plain_dcp_directory]).

    Neither is a committed dist_ckpt checkpoint
    ([`check_is_distributed_checkpoint()`][dist_ckpt.record.commit.check_is_distributed_checkpoint] stays False); this
    only lets ``load`` read them. Both are read from local disks only (storages with ``local_paths``: the HF reader and
    DCP's file reader need files).
    """
    location = resolve_location(checkpoint_dir)
    if location.local_paths and not location.exists(METADATA_FILENAME):
        if any(location.exists(f) for f in (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME)):
            return HF_CONFIG
        if is_plain_dcp_directory(location):
            return DCP_CONFIG
    return read_config(location)


def is_plain_dcp_directory(checkpoint_dir: LocationLike) -> bool:
    """Whether ``checkpoint_dir`` is what ``torch.distributed.checkpoint.save`` writes: DCP's
    ``.metadata`` and nothing but DCP's files (``*.distcp``, per-rank ``__<r>.metadata``), no
    subdirectory -- or what ``dist_ckpt.dcp.StorageWriter`` writes: the same and its checksum
    manifest (`DCP_CHECKSUMS_FILENAME`).

    A directory that also holds other files -- the ``common.pt`` of Megatron-Core's or
    dist_ckpt's torch_dist saves -- is not: there ``metadata.json`` is the commit record, and
    without it the save did not finish.

    Example:

    ```python
    is_plain_dcp_directory("torchtitan/step-1000")   # True
    ```
    """
    location = resolve_location(checkpoint_dir)
    if not location.exists(DCP_METADATA_FILENAME) or location.list_dirs():
        return False
    return all(
        o.key in (DCP_METADATA_FILENAME, DCP_CHECKSUMS_FILENAME) or o.key.endswith((".distcp", ".metadata"))
        for o in location.list()
    )


def check_is_distributed_checkpoint(checkpoint_dir: LocationLike) -> bool:
    """True if ``checkpoint_dir`` holds a ``metadata.json`` with a valid config.

    A damaged ``metadata.json`` gives False; on an object store, a refused request (wrong
    credentials, missing bucket, retries exhausted) raises its [`StorageError`][dist_ckpt.storage.errors.StorageError]
    instead of passing for "no checkpoint".
    """
    try:
        return maybe_load_config(checkpoint_dir) is not None
    except StorageError:
        raise
    except CheckpointingException:
        return False
