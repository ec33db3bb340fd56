"""Evaluation metrics stored beside a checkpoint: ``eval_metrics.json``, a dict of finite numbers.

Part of [`dist_ckpt.training.checkpoints`][dist_ckpt.training.checkpoints] (which re-exports both functions): written
atomically and durably on disk, as one object on an object store; rejected on save and on load when a name is
not a string or a value is not a finite number, so ``maybe_delete_oldest_checkpoint`` can rank
checkpoints by a metric without surprises.

Example:

```python
save_checkpoint_metrics("runs/gpt/checkpoint-1000", {"eval_loss": 2.31})
load_checkpoint_metrics("runs/gpt/checkpoint-1000")   # {"eval_loss": 2.31}
```
"""

from __future__ import annotations

import json
import logging
import math
import numbers
from typing import Any, Callable, Dict, Optional

from dist_ckpt.errors import (
    CheckpointingException,
    CheckpointManagementError,
    CorruptCheckpointError,
    NotACheckpointError,
)
from dist_ckpt.integrity.safe_json import MAX_SMALL_JSON_BYTES, loads
from dist_ckpt.storage.errors import ObjectNotFoundError
from dist_ckpt.storage.location import LocationLike, resolve_location

__all__ = ["METRICS_FILENAME", "load_checkpoint_metrics", "save_checkpoint_metrics"]

logger = logging.getLogger(__name__)

#: Evaluation metrics file inside a checkpoint directory (the reference's name).
METRICS_FILENAME = "eval_metrics.json"


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


def save_checkpoint_metrics(checkpoint_path: LocationLike, metrics: Dict[str, float]) -> None:
    """Store evaluation metrics in ``checkpoint_path/eval_metrics.json`` (atomically, durably).

    Example:

    ```python
    save_checkpoint_metrics("runs/gpt/checkpoint-1000", {"eval_loss": 2.31, "accuracy": 0.58})
    ```

    Raises:
        NotACheckpointError: ``checkpoint_path`` is not a directory (on an object store: no object
            lives under it).
        CheckpointManagementError: a name is not a string, or a value is not a finite number.
    """
    storage = resolve_location(checkpoint_path)
    clean = _checked_metrics(metrics, lambda msg: CheckpointManagementError(f"metrics for {storage.url}: {msg}"))
    data = json.dumps(clean, indent=2, sort_keys=True, allow_nan=False).encode("utf-8")
    if not storage.dir_exists():
        missing = (
            f"checkpoint directory {storage.url!r} does not exist"
            if storage.local_paths
            else f"no checkpoint at {storage.url!r} (no object under it)"
        )
        raise NotACheckpointError(f"cannot save metrics: {missing}")
    storage.write(METRICS_FILENAME, data)  # appears whole or not at all
    logger.debug("saved metrics to %s", storage.url_of(METRICS_FILENAME))


def load_checkpoint_metrics(checkpoint_path: LocationLike) -> Optional[Dict[str, float]]:
    """The metrics stored by [`save_checkpoint_metrics()`][dist_ckpt.training.metrics.save_checkpoint_metrics], or None
    if there are none.

    Example:

    ```python
    metrics = load_checkpoint_metrics("runs/gpt/checkpoint-1000")   # {"eval_loss": 2.31, ...}
    ```

    Raises:
        CorruptCheckpointError: the metrics file is not valid JSON or not a dict of finite numbers.
    """
    storage = resolve_location(checkpoint_path)
    file = storage.url_of(METRICS_FILENAME)
    try:
        data = storage.read(METRICS_FILENAME)
    except ObjectNotFoundError:
        return None
    try:
        raw = loads(data, f"metrics file {file}", MAX_SMALL_JSON_BYTES)
    except CorruptCheckpointError as e:  # not UTF-8 JSON, NaN, too deep, too large
        raise CorruptCheckpointError(f"{e}; delete or rewrite it") from e
    return _checked_metrics(raw, lambda msg: CorruptCheckpointError(f"metrics file {file} is corrupt: {msg}"))
