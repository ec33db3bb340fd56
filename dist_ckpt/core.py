"""Checkpoint configuration and the ``metadata.json`` commit record.

``metadata.json`` is the last file of a save, written by rank 0 after every rank has flushed its
files. Its presence (with valid content) is what makes a directory a checkpoint. Schema
(format version 1)::

    {
      "sharded_backend": "zarr",          # str: format of the sharded tensors
      "sharded_backend_version": 1,       # int
      "common_backend": "torch",          # str: format of the common (non-sharded) state
      "common_backend_version": 1,        # int
      "dist_ckpt": {                      # optional; written by dist_ckpt
        "format_version": 1,
        "library_version": "0.1.0",
        "world_size": 4
      }
    }
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Union

from .errors import CheckpointingException, CorruptCheckpointError, NotACheckpointError
from .storage import write_bytes_atomic

__all__ = [
    "CheckpointingConfig",
    "CheckpointingException",
    "METADATA_FILENAME",
    "HF_CONFIG",
    "check_is_distributed_checkpoint",
    "detect_config",
    "maybe_load_config",
    "read_config",
    "save_config",
]

METADATA_FILENAME = "metadata.json"
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


def save_config(config: CheckpointingConfig, checkpoint_dir: Union[str, Path], world_size: Optional[int] = None) -> None:
    """Write ``metadata.json`` atomically and durably (the commit of a checkpoint)."""
    record: Dict[str, Any] = asdict(config)
    record["dist_ckpt"] = {"format_version": FORMAT_VERSION, "library_version": LIBRARY_VERSION}
    if world_size is not None:
        record["dist_ckpt"]["world_size"] = world_size
    data = json.dumps(record, indent=2, sort_keys=True).encode("utf-8")
    write_bytes_atomic(Path(checkpoint_dir) / METADATA_FILENAME, data)


def _parse_config(path: Path) -> CheckpointingConfig:
    try:
        raw = path.read_bytes()
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({e}); the checkpoint metadata is corrupt") from e
    if not isinstance(record, dict):
        raise CorruptCheckpointError(f"{path} must hold a JSON object, found {type(record).__name__}")
    values: Dict[str, Any] = {}
    for name, expected in _FIELD_TYPES.items():
        if name not in record:
            if name == "sharded_backend":
                raise CorruptCheckpointError(f"{path} has no {name!r} field")
            continue
        value = record[name]
        if not isinstance(value, expected) or isinstance(value, bool):
            raise CorruptCheckpointError(
                f"{path}: field {name!r} must be {expected.__name__}, found {type(value).__name__} ({value!r})"
            )
        values[name] = value
    return CheckpointingConfig(
        sharded_backend=str(values["sharded_backend"]),
        sharded_backend_version=int(values.get("sharded_backend_version", 1)),
        common_backend=str(values.get("common_backend", "torch")),
        common_backend_version=int(values.get("common_backend_version", 1)),
    )


def maybe_load_config(checkpoint_dir: Union[str, Path]) -> Optional[CheckpointingConfig]:
    """The checkpoint's config, or None if ``checkpoint_dir`` holds no ``metadata.json``.

    Raises:
        CorruptCheckpointError: if ``metadata.json`` exists but is not a valid config.
    """
    path = Path(checkpoint_dir) / METADATA_FILENAME
    if not path.is_file():
        return None
    return _parse_config(path)


def read_config(checkpoint_dir: Union[str, Path]) -> CheckpointingConfig:
    """The checkpoint's config; raises a clear error if the directory is not a checkpoint."""
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        raise NotACheckpointError(f"checkpoint directory {str(directory)!r} does not exist")
    config = maybe_load_config(directory)
    if config is None:
        raise NotACheckpointError(
            f"{str(directory)!r} is not a committed dist_ckpt checkpoint: {METADATA_FILENAME} is missing "
            f"(the save did not finish, or this is not a checkpoint directory)"
        )
    return config


#: how a HuggingFace folder (safetensors weights and no metadata.json) is loaded: with the
#: built-in read-only "hf" strategies (dist_ckpt.hf.strategy)
HF_CONFIG = CheckpointingConfig("hf", 1, "hf", 1)
_HF_WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors")


def detect_config(checkpoint_dir: Union[str, Path]) -> CheckpointingConfig:
    """The config to load ``checkpoint_dir`` with: its ``metadata.json``, or :data:`HF_CONFIG` for
    a folder without one that holds HuggingFace weights (``model.safetensors`` or its index).

    An HF folder is not a committed dist_ckpt checkpoint (:func:`check_is_distributed_checkpoint`
    stays False); this only lets ``load`` read it.
    """
    directory = Path(checkpoint_dir)
    if not (directory / METADATA_FILENAME).exists() and any((directory / f).is_file() for f in _HF_WEIGHT_FILES):
        return HF_CONFIG
    return read_config(directory)


def check_is_distributed_checkpoint(checkpoint_dir: Union[str, Path]) -> bool:
    """True if ``checkpoint_dir`` holds a ``metadata.json`` with a valid config."""
    try:
        return maybe_load_config(checkpoint_dir) is not None
    except CheckpointingException:
        return False
