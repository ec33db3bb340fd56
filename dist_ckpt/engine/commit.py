"""Checkpoint configuration and the ``metadata.json`` commit record.

``metadata.json`` is the last file of a save, written by rank 0 after every rank has flushed its
files. Its presence (with valid content) is what makes a directory (or an object-store prefix) a
checkpoint. Schema (format version 1)::

    {
      "sharded_backend": "zarr",          # str: format of the sharded tensors
      "sharded_backend_version": 1,       # int
      "common_backend": "torch",          # str: format of the common (non-sharded) state
      "common_backend_version": 1,        # int
      "dist_ckpt": {                      # optional; written by dist_ckpt
        "format_version": 1,
        "library_version": "0.1.0",
        "world_size": 4,
        "save_id": "3f2a..."              # random id of the save that committed it
      }
    }

Megatron-Core reads ``metadata.json`` with ``CheckpointingConfig(**json)`` and refuses any key it
does not know. For the backends Megatron-Core loads (:data:`MEGATRON_BACKENDS`: ``torch_dist``)
``metadata.json`` therefore holds exactly its four keys, as Megatron-Core writes them, and the
``"dist_ckpt"`` record goes to ``dist_ckpt.json`` (:data:`RECORD_FILENAME`) beside it, written
before the commit; :func:`read_save_record` finds it in either place.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from dist_ckpt.errors import CheckpointExistsError, CheckpointingException, CorruptCheckpointError, NotACheckpointError
from dist_ckpt.storage import write_bytes_atomic
from dist_ckpt.storage.errors import ObjectExistsError, ObjectNotFoundError, StorageError
from dist_ckpt.storage.location import CheckpointLocation, LocationLike, location_str, resolve_location

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointingConfig",
    "CheckpointingException",
    "DCP_CONFIG",
    "MEGATRON_BACKENDS",
    "METADATA_FILENAME",
    "HF_CONFIG",
    "RECORD_FILENAME",
    "check_is_distributed_checkpoint",
    "detect_config",
    "is_plain_dcp_directory",
    "maybe_load_config",
    "new_save_id",
    "read_config",
    "read_save_record",
    "save_config",
]

METADATA_FILENAME = "metadata.json"
#: where dist_ckpt's record of a save goes when ``metadata.json`` must hold Megatron-Core's keys only
RECORD_FILENAME = "dist_ckpt.json"
#: sharded backends whose ``metadata.json`` Megatron-Core reads (and refuses with unknown keys)
MEGATRON_BACKENDS = frozenset({"torch_dist"})
FORMAT_VERSION = 1
LIBRARY_VERSION = "0.1.0"


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
    """A random identifier of one save, recorded in ``metadata.json`` (see :func:`save_config`)."""
    return uuid.uuid4().hex


def save_config(
    config: CheckpointingConfig,
    checkpoint_dir: LocationLike,
    world_size: Optional[int] = None,
    save_id: Optional[str] = None,
) -> None:
    """Write ``metadata.json`` atomically and durably: the commit of a checkpoint (rank 0 only).

    A local directory gets it by atomic rename (temporary file, fsync, rename, fsync of the
    directory). An object store gets it with a create-if-absent put (``If-None-Match: *``), so a
    commit never overwrites another save's marker. If that put finds an object already there --
    e.g. the server applied a first attempt whose response was lost, and the client retried --
    the marker is read back and accepted only if it carries this save's ``save_id``; otherwise
    :class:`~dist_ckpt.errors.CheckpointExistsError` is raised.

    Example::

        save_config(CheckpointingConfig("safetensors"), "s3://bucket/ckpt/iter_10", world_size=8)
    """
    location = resolve_location(checkpoint_dir)
    writer: Dict[str, Any] = {"format_version": FORMAT_VERSION, "library_version": LIBRARY_VERSION}
    if world_size is not None:
        writer["world_size"] = world_size
    save_id = save_id or new_save_id()
    writer["save_id"] = save_id
    record: Dict[str, Any] = asdict(config)
    beside = config.sharded_backend in MEGATRON_BACKENDS
    if beside:  # Megatron-Core's exact metadata.json; the record in its own file, before the commit
        data = json.dumps(record).encode("utf-8")
        _write_record(location, json.dumps({"dist_ckpt": writer}, indent=2, sort_keys=True).encode("utf-8"))
    else:
        record["dist_ckpt"] = writer
        data = json.dumps(record, indent=2, sort_keys=True).encode("utf-8")
    if isinstance(location, Path):
        write_bytes_atomic(location / METADATA_FILENAME, data)
        return
    try:
        location.put_if_absent(METADATA_FILENAME, data)
    except ObjectExistsError as e:
        try:
            found = read_save_record(location).get("save_id")
        except (ValueError, AttributeError, CheckpointingException):
            found = None
        if found != save_id:
            raise CheckpointExistsError(
                f"{location.url_of(METADATA_FILENAME)} was committed by another save while this one was running "
                f"(its save_id is {found!r}, ours {save_id!r}); this save is not committed: save to a new location"
            ) from e
        logger.info(
            "%s: the commit marker is ours (a retried put had already landed)", location.url_of(METADATA_FILENAME)
        )


def _write_record(location: CheckpointLocation, data: bytes) -> None:
    if isinstance(location, Path):
        write_bytes_atomic(location / RECORD_FILENAME, data)
    else:
        location.write(RECORD_FILENAME, data)


def read_save_record(checkpoint_dir: LocationLike) -> Dict[str, Any]:
    """dist_ckpt's record of the save that committed ``checkpoint_dir`` (``format_version``,
    ``library_version``, ``world_size``, ``save_id``): the ``"dist_ckpt"`` entry of
    ``metadata.json``, or of ``dist_ckpt.json`` for Megatron-format checkpoints; {} when there is
    none (a checkpoint written by another tool) or it is unreadable.

    Example::

        read_save_record("ckpt/iter_10").get("world_size")     # 8
    """
    location = resolve_location(checkpoint_dir)
    for name in (METADATA_FILENAME, RECORD_FILENAME):
        try:
            raw = (location / name).read_bytes() if isinstance(location, Path) else location.read(name)
            doc = json.loads(raw.decode("utf-8"))
        except (OSError, ValueError, CheckpointingException):  # absent or damaged: not recorded there
            continue
        found = doc.get("dist_ckpt") if isinstance(doc, dict) else None
        if isinstance(found, dict):
            return found
    return {}


def _parse_config(raw: bytes, where: str) -> CheckpointingConfig:
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{where} is not valid JSON ({e}); the checkpoint metadata is corrupt") from e
    if not isinstance(record, dict):
        raise CorruptCheckpointError(f"{where} must hold a JSON object, found {type(record).__name__}")
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
    location = resolve_location(checkpoint_dir)
    if isinstance(location, Path):
        path = location / METADATA_FILENAME
        if not path.is_file():
            return None
        return _parse_config(path.read_bytes(), str(path))
    try:
        raw = location.read(METADATA_FILENAME)
    except ObjectNotFoundError:
        return None
    return _parse_config(raw, location.url_of(METADATA_FILENAME))


def read_config(checkpoint_dir: LocationLike) -> CheckpointingConfig:
    """The checkpoint's config; raises a clear error if the location is not a checkpoint."""
    location = resolve_location(checkpoint_dir)
    if isinstance(location, Path) and not location.is_dir():
        raise NotACheckpointError(f"checkpoint directory {str(location)!r} does not exist")
    config = maybe_load_config(location)
    if config is None:
        where = "directory" if isinstance(location, Path) else "location"
        raise NotACheckpointError(
            f"{location_str(location)!r} is not a committed dist_ckpt checkpoint: {METADATA_FILENAME} is missing "
            f"(the save did not finish, or this is not a checkpoint {where})"
        )
    return config


#: how a HuggingFace folder (safetensors weights and no metadata.json) is loaded: with the
#: built-in read-only "hf" strategies (dist_ckpt.hf.strategy)
HF_CONFIG = CheckpointingConfig("hf", 1, "hf", 1)
_HF_WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors")
#: how a plain torch.distributed.checkpoint directory (DCP's ``.metadata``, no metadata.json) is
#: loaded: with the built-in read-only "dcp" strategies (dist_ckpt.backends.torch_dist.plain)
DCP_CONFIG = CheckpointingConfig("dcp", 1, "dcp", 1)
#: DCP's metadata file, written last by its save: what makes a directory a DCP checkpoint
DCP_METADATA_FILENAME = ".metadata"


def detect_config(checkpoint_dir: LocationLike) -> CheckpointingConfig:
    """The config to load ``checkpoint_dir`` with: its ``metadata.json``; for a local folder without
    one, :data:`HF_CONFIG` if it holds HuggingFace weights (``model.safetensors`` or its index), or
    :data:`DCP_CONFIG` if it is a plain DCP directory (:func:`is_plain_dcp_directory`).

    Neither is a committed dist_ckpt checkpoint (:func:`check_is_distributed_checkpoint` stays
    False); this only lets ``load`` read them. Both are read from local disks only.
    """
    location = resolve_location(checkpoint_dir)
    if isinstance(location, Path) and not (location / METADATA_FILENAME).exists():
        if any((location / f).is_file() for f in _HF_WEIGHT_FILES):
            return HF_CONFIG
        if is_plain_dcp_directory(location):
            return DCP_CONFIG
    return read_config(location)


def is_plain_dcp_directory(directory: Path) -> bool:
    """Whether ``directory`` is what ``torch.distributed.checkpoint.save`` writes: DCP's
    ``.metadata`` and nothing but DCP's files (``*.distcp``, per-rank ``__<r>.metadata``).

    A directory that also holds other files -- the ``common.pt`` of Megatron-Core's or
    dist_ckpt's torch_dist saves -- is not: there ``metadata.json`` is the commit record, and
    without it the save did not finish.

    Example::

        is_plain_dcp_directory(Path("torchtitan/step-1000"))   # True
    """
    if not (directory / DCP_METADATA_FILENAME).is_file():
        return False
    for entry in directory.iterdir():
        name = entry.name
        if not (name == DCP_METADATA_FILENAME or name.endswith((".distcp", ".metadata"))):
            return False
    return True


def check_is_distributed_checkpoint(checkpoint_dir: LocationLike) -> bool:
    """True if ``checkpoint_dir`` holds a ``metadata.json`` with a valid config.

    A damaged ``metadata.json`` gives False; on an object store, a refused request (wrong
    credentials, missing bucket, retries exhausted) raises its :class:`StorageError` instead of
    passing for "no checkpoint".
    """
    try:
        return maybe_load_config(checkpoint_dir) is not None
    except StorageError:
        raise
    except CheckpointingException:
        return False
