"""Evaluation metrics stored beside a checkpoint: ``eval_metrics.json``, a dict of finite numbers.

Part of :mod:`dist_ckpt.training.checkpoints` (which re-exports both functions): written atomically and
durably on disk, as one object on an object store; rejected on save and on load when a name is
not a string or a value is not a finite number, so ``maybe_delete_oldest_checkpoint`` can rank
checkpoints by a metric without surprises.

Example::

    save_checkpoint_metrics("runs/gpt/checkpoint-1000", {"eval_loss": 2.31})
    load_checkpoint_metrics("runs/gpt/checkpoint-1000")   # {"eval_loss": 2.31}
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

from dist_ckpt.errors import (
    CheckpointingException,
    CheckpointManagementError,
    CorruptCheckpointError,
    NotACheckpointError,
)
from dist_ckpt.storage import Storage, write_bytes_atomic
from dist_ckpt.storage.errors import ObjectNotFoundError
from dist_ckpt.storage.location import remote_storage, require_local, resolve_location
from dist_ckpt.training.object_store_runs import prefix_exists

__all__ = ["METRICS_FILENAME", "load_checkpoint_metrics", "save_checkpoint_metrics"]

logger = logging.getLogger(__name__)

#: Evaluation metrics file inside a checkpoint directory (the reference's name).
METRICS_FILENAME = "eval_metrics.json"

PathLike = Union[str, "os.PathLike[str]", Storage]


def _local_dir(location: PathLike) -> Path:
    """A local checkpoint directory (a LocalStorage's, or the path given)."""
    return (
        require_local(resolve_location(location), "this function") if isinstance(location, Storage) else Path(location)
    )


def _checked_metrics(raw: Any, error: Callable[[str], CheckpointingException]) -> Dict[str, float]:
    if not isinstance(raw, dict):
        raise error(f"metrics must be a dict of name -> finite number, found {type(raw).__name__}")
    clean: Dict[str, float] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise error(f"metric names must be strings, found {key!r}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise error(
                f"metric {key!r} must be a number, found {type(value).__name__} ({value!r}); "
                f"convert tensors with .item()"
            )
        number = float(value)
        if not math.isfinite(number):
            raise error(f"metric {key!r} must be finite, found {number}")
        clean[key] = number
    return clean


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name}")


def save_checkpoint_metrics(checkpoint_path: PathLike, metrics: Dict[str, float]) -> None:
    """Store evaluation metrics in ``checkpoint_path/eval_metrics.json`` (atomically, durably).

    Example::

        save_checkpoint_metrics("runs/gpt/checkpoint-1000", {"eval_loss": 2.31, "accuracy": 0.58})

    Raises:
        NotACheckpointError: ``checkpoint_path`` is not a directory.
        CheckpointManagementError: a name is not a string, or a value is not a finite number.
    """
    store = remote_storage(resolve_location(checkpoint_path))
    where = store.url if store is not None else str(checkpoint_path)
    clean = _checked_metrics(metrics, lambda msg: CheckpointManagementError(f"metrics for {where}: {msg}"))
    data = json.dumps(clean, indent=2, sort_keys=True, allow_nan=False).encode("utf-8")
    if store is not None:
        if not prefix_exists(store):
            raise NotACheckpointError(f"cannot save metrics: no checkpoint at {store.url!r} (no object under it)")
        store.write(METRICS_FILENAME, data)  # an object appears whole or not at all
        return
    directory = _local_dir(checkpoint_path)
    if not directory.is_dir():
        raise NotACheckpointError(f"cannot save metrics: checkpoint directory {str(directory)!r} does not exist")
    write_bytes_atomic(directory / METRICS_FILENAME, data)
    logger.debug("saved metrics to %s", directory / METRICS_FILENAME)


def load_checkpoint_metrics(checkpoint_path: PathLike) -> Optional[Dict[str, float]]:
    """The metrics stored by :func:`save_checkpoint_metrics`, or None if there are none.

    Example::

        metrics = load_checkpoint_metrics("runs/gpt/checkpoint-1000")   # {"eval_loss": 2.31, ...}

    Raises:
        CorruptCheckpointError: the metrics file is not valid JSON or not a dict of finite numbers.
    """
    store = remote_storage(resolve_location(checkpoint_path))
    if store is not None:
        file: Union[str, Path] = store.url_of(METRICS_FILENAME)
        try:
            data = store.read(METRICS_FILENAME)
        except ObjectNotFoundError:
            return None
    else:
        file = _local_dir(checkpoint_path) / METRICS_FILENAME
        if not file.is_file():
            return None
        data = file.read_bytes()
    try:
        raw = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except ValueError as e:  # includes JSONDecodeError and UnicodeDecodeError
        raise CorruptCheckpointError(f"metrics file {file} is not valid JSON ({e}); delete or rewrite it") from e
    return _checked_metrics(raw, lambda msg: CorruptCheckpointError(f"metrics file {file} is corrupt: {msg}"))
