"""A run's checkpoint directories: their names, format and completeness, and the latest one.

The rules (which names carry a step, how checkpoints are ordered, what makes one complete) are
the contract written in [`dist_ckpt.training.checkpoints`][dist_ckpt.training.checkpoints], which
re-exports the public names of this module; `dist_ckpt.training.rotation` and
`dist_ckpt.training.hf_links` build on them.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from enum import Enum
from typing import List, Mapping, Optional, Tuple, Union

from dist_ckpt.backends.torch_common.strategy import COMMON_STATE_FNAME
from dist_ckpt.errors import CheckpointingException, CheckpointManagementError
from dist_ckpt.record.commit import HF_WEIGHT_FILES, METADATA_FILENAME, CheckpointingConfig, maybe_load_config
from dist_ckpt.storage import Storage, StorageError
from dist_ckpt.storage.location import LocationLike, resolve_location
from dist_ckpt.training.hf_weights import index_shards, weights_file_whole
from dist_ckpt.training.metrics import load_checkpoint_metrics

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_NAME_PATTERNS",
    "CheckpointFormat",
    "CheckpointMeta",
    "RunCheckpoint",
    "checkpoint_names",
    "find_latest_checkpoint",
    "get_checkpoint_metadata",
    "list_checkpoints",
    "next_checkpoint_path",
    "parse_checkpoint_step",
    "validate_checkpoint",
]

#: Regular expressions (matched against the whole directory name) whose group is the step.
CHECKPOINT_NAME_PATTERNS: Tuple[str, ...] = (
    r"checkpoint-([0-9]+)",
    r"checkpoint_([0-9]+)",
    r"iter_([0-9]+)",
    r"step-([0-9]+)",
    r"step_([0-9]+)",
    r"global_step([0-9]+)",
)
_NAME_RES = tuple(re.compile(p) for p in CHECKPOINT_NAME_PATTERNS)


class CheckpointFormat(str, Enum):
    """On-disk format of a checkpoint directory (compares equal to its string value)."""

    DIST_CKPT = "dist_ckpt"
    HF = "hf"


@dataclass(frozen=True)
class CheckpointMeta:
    """What [`get_checkpoint_metadata()`][dist_ckpt.training.checkpoints.get_checkpoint_metadata] found in a directory.

    Attributes:
        file_name: HF: the index file if there is one, else the weights file; dist_ckpt:
            ``"metadata.json"``.
        is_index: ``file_name`` is an HF index of shard files (always False for dist_ckpt).
        safetensors: the HF weights are safetensors, else torch pickles (False for dist_ckpt).
        format: ``CheckpointFormat.DIST_CKPT`` or ``CheckpointFormat.HF``.
        complete: the checkpoint is committed (see
            [`dist_ckpt.training.checkpoints`][dist_ckpt.training.checkpoints]); False for a corrupt
            ``metadata.json`` or an index whose shards are missing or truncated.
        step: the step parsed from the directory name, or None if the name carries none.
        backend / backend_version: the sharded backend recorded in ``metadata.json`` (dist_ckpt).
        config: the whole record of ``metadata.json`` (complete dist_ckpt checkpoints only).
    """

    file_name: str
    is_index: bool
    safetensors: bool
    format: CheckpointFormat
    complete: bool
    step: Optional[int] = None
    backend: Optional[str] = None
    backend_version: Optional[int] = None
    config: Optional[CheckpointingConfig] = None


@dataclass(frozen=True)
class RunCheckpoint:
    """One complete checkpoint of a run, as [`list_checkpoints()`][dist_ckpt.training.checkpoints.list_checkpoints]
    found it.

    Attributes:
        path: the checkpoint's path (a URL on an object store), named as
            [`find_latest_checkpoint()`][dist_ckpt.training.checkpoints.find_latest_checkpoint] names it.
        name: the directory name, e.g. ``"checkpoint-1000"``.
        step: the step its name carries.
        format: ``CheckpointFormat.DIST_CKPT`` or ``CheckpointFormat.HF``.
        metrics: what [`save_checkpoint_metrics()`][dist_ckpt.training.metrics.save_checkpoint_metrics] stored
            beside it, or None if nothing was (e.g. a crash between the commit and the metrics).
    """

    path: str
    name: str
    step: int
    format: CheckpointFormat
    metrics: Optional[Mapping[str, float]]


# --------------------------------------------------------------------------- names


def parse_checkpoint_step(name: str) -> Optional[int]:
    """The step a checkpoint directory name carries, or None if it matches no pattern.

    Example:

    ```python
    parse_checkpoint_step("iter_0001000")   # 1000
    parse_checkpoint_step("final")          # None
    ```
    """
    for pattern in _NAME_RES:
        match = pattern.fullmatch(name)
        if match:
            return int(match.group(1))
    return None


def next_checkpoint_path(model_dir: LocationLike, checkpoint_id: Union[int, str]) -> str:
    """The directory to save the checkpoint of a step (or of a given name) into.

    Creates nothing. An int (or a string of digits) gives ``model_dir/checkpoint-<step>``; any
    other string must be a recognised checkpoint name and is used as it is.

    Example:

    ```python
    path = next_checkpoint_path("runs/gpt", 1000)        # "runs/gpt/checkpoint-1000"
    dist_ckpt.save(sharded_state_dict, path)
    next_checkpoint_path("runs/gpt", "iter_0001000")     # "runs/gpt/iter_0001000"
    ```

    Raises:
        CheckpointManagementError: a negative step, or a name that carries no step (it would
            be invisible to find_latest_checkpoint and rotation).
    """
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, (int, str)):
        raise CheckpointManagementError(
            f"checkpoint_id must be a step (int) or a checkpoint name (str), got {checkpoint_id!r}"
        )
    if isinstance(checkpoint_id, str) and checkpoint_id.isascii() and checkpoint_id.isdigit():
        checkpoint_id = int(checkpoint_id)
    if isinstance(checkpoint_id, int):
        if checkpoint_id < 0:
            raise CheckpointManagementError(f"checkpoint step must be >= 0, got {checkpoint_id}")
        name = f"checkpoint-{checkpoint_id}"
    elif parse_checkpoint_step(checkpoint_id) is not None:
        name = checkpoint_id
    else:
        raise CheckpointManagementError(
            f"checkpoint name {checkpoint_id!r} carries no step: use a step or a name matching one of "
            f"{', '.join(CHECKPOINT_NAME_PATTERNS)} (other names are not managed checkpoints)"
        )
    return resolve_location(model_dir).url_of(name)


def checkpoint_names(storage: Storage) -> List[Tuple[int, str]]:
    """``(step, name)`` of the directories directly under ``storage`` whose names carry a step,
    oldest first (one listing of one level).

    Example:

    ```python
    checkpoint_names(open_storage("runs/gpt"))   # [(1000, "checkpoint-1000"), (2000, "iter_0002000")]
    ```
    """
    entries = []
    for name in storage.list_dirs():
        step = parse_checkpoint_step(name)
        if step is not None:
            entries.append((step, name))
    return sorted(entries)


# --------------------------------------------------------------------------- completeness


def _hf_meta(storage: Storage, step: Optional[int]) -> Optional[CheckpointMeta]:
    for file_name, is_index, safetensors in HF_WEIGHT_FILES:
        if not storage.exists(file_name):
            continue
        if is_index:
            shards = index_shards(storage, file_name)
            complete = shards is not None and all(weights_file_whole(storage, s) for s in shards)
        else:
            complete = weights_file_whole(storage, file_name)
        return CheckpointMeta(file_name, is_index, safetensors, CheckpointFormat.HF, complete, step)
    return None


def _dir_name(storage: Storage) -> str:
    """The last component of the storage's location (of the absolute path, for a local one)."""
    return storage.local_dir.name if storage.local_paths else storage.url.rstrip("/").rsplit("/", 1)[-1]


def get_checkpoint_metadata(path: LocationLike) -> Optional[CheckpointMeta]:
    """Detect the format of a checkpoint directory and whether it is complete.

    A ``metadata.json`` makes a dist_ckpt checkpoint (complete if it is valid); otherwise HF
    weight files are looked for (see [`dist_ckpt.training.checkpoints`][dist_ckpt.training.checkpoints]).
    A directory with neither is no checkpoint (None), and so is a dist_ckpt save that has not
    committed yet (``common.pt`` but no ``metadata.json``).

    Example:

    ```python
    meta = get_checkpoint_metadata("runs/gpt/checkpoint-1000")
    if meta is not None and meta.complete and meta.format == "hf":
        print(meta.file_name, meta.is_index, meta.safetensors)
    get_checkpoint_metadata("s3://bucket/runs/gpt/checkpoint-1000")   # the same on S3
    ```

    Returns:
        A [`CheckpointMeta`][dist_ckpt.training.checkpoints.CheckpointMeta] (``complete=False`` for a corrupt
            ``metadata.json`` or an HF
        folder with missing or truncated weights), or None for a missing directory or one that
        is no checkpoint.

    Raises:
        StorageError: an object store refused a request (credentials, missing bucket, retries
            exhausted): never taken for "no checkpoint".
    """
    storage = resolve_location(path)
    step = parse_checkpoint_step(_dir_name(storage))
    try:
        config = maybe_load_config(storage)
    except StorageError:
        raise
    except CheckpointingException as e:
        logger.debug("%s is not committed: %s", storage.url, e)
        return CheckpointMeta(METADATA_FILENAME, False, False, CheckpointFormat.DIST_CKPT, False, step)
    if config is not None:
        return CheckpointMeta(
            METADATA_FILENAME,
            False,
            False,
            CheckpointFormat.DIST_CKPT,
            True,
            step,
            config.sharded_backend,
            config.sharded_backend_version,
            config,
        )
    if storage.exists(COMMON_STATE_FNAME):
        return None  # a dist_ckpt save that has not committed: no checkpoint yet
    return _hf_meta(storage, step)


def validate_checkpoint(checkpoint_path: LocationLike) -> bool:
    """Whether ``checkpoint_path`` is a complete (committed) checkpoint directory.

    Example:

    ```python
    if not validate_checkpoint("runs/gpt/checkpoint-1000"):
        raise SystemExit("that save did not finish")
    ```
    """
    meta = get_checkpoint_metadata(checkpoint_path)
    return meta is not None and meta.complete


def find_latest_checkpoint(model_dir: LocationLike) -> Optional[str]:
    """The complete checkpoint of ``model_dir`` with the highest step, or None.

    Partial directories (a save in progress or a crashed one) are skipped, whatever their step
    or modification time; ties on the step go to the greater name (see
    [`dist_ckpt.training.checkpoints`][dist_ckpt.training.checkpoints]).

    Example:

    ```python
    latest = find_latest_checkpoint("runs/gpt")
    if latest is not None:
        state = dist_ckpt.load(sharded_state_dict, latest)
    ```
    """
    storage = resolve_location(model_dir)
    for step, name in reversed(checkpoint_names(storage)):
        if validate_checkpoint(storage.child(name)):
            logger.debug("latest complete checkpoint in %s: %s (step %d)", storage.url, name, step)
            return storage.url_of(name)
        logger.info("skipping %s: not a complete checkpoint (no valid commit marker)", storage.url_of(name))
    return None


def list_checkpoints(model_dir: LocationLike) -> List[RunCheckpoint]:
    """Every complete checkpoint of ``model_dir``, oldest first, with its step and metrics.

    The run's own record of what it saved (Orbax's ``all_steps()``): the directories whose names
    carry a step (see [`dist_ckpt.training.checkpoints`][dist_ckpt.training.checkpoints]), ordered
    by ``(step, name)``, those that are complete only -- a save in progress or a crashed one is
    left out, as [`find_latest_checkpoint()`][dist_ckpt.training.checkpoints.find_latest_checkpoint]
    leaves it out, so the last entry is the latest checkpoint. On a restart, this is where a
    training loop reads back which checkpoint was its best. A missing ``model_dir`` has none.

    Example:

    ```python
    best = min((c for c in list_checkpoints("runs/gpt") if c.metrics), key=lambda c: c.metrics["eval_loss"])
    print(best.step, best.path, best.metrics)   # 2000 runs/gpt/checkpoint-2000 {'eval_loss': 2.31}
    list_checkpoints("s3://bucket/runs/gpt")    # the same on S3
    ```

    Raises:
        CorruptCheckpointError: a complete checkpoint's metrics file is not a dict of finite
            numbers (the error names the file).
        StorageError: an object store refused a request.
    """
    storage = resolve_location(model_dir)
    found = []
    for step, name in checkpoint_names(storage):
        meta = get_checkpoint_metadata(storage.child(name))
        if meta is None or not meta.complete:
            logger.debug("not listing %s: not a complete checkpoint", storage.url_of(name))
            continue
        path = storage.url_of(name)
        found.append(RunCheckpoint(path, name, step, meta.format, load_checkpoint_metrics(path)))
    return found
