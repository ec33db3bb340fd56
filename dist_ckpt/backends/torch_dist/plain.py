"""Plain DCP directories: what ``torch.distributed.checkpoint.save`` writes (torchtitan, OLMo-core).

A directory with DCP's ``.metadata`` and no ``metadata.json`` is loaded with the backend
``("dcp", 1)`` (see [`dist_ckpt.record.commit.detect_config()`][dist_ckpt.record.commit.detect_config]), as HuggingFace
folders are with ``("hf", 1)``:

* tensors are requested by their DCP key -- the state dict's flattened path, ``model.layers.0.w``
  -- with ShardedTensors describing the part each rank wants, in any layout (DTensor and
  ShardedTensor checkpoints are stored as chunks like any other);
* the state dict's other values (``step``, ``param_groups``, ``io.BytesIO`` blobs) are DCP bytes
  entries: they form the *common state*, nested again along the paths DCP recorded in its
  ``planner_data`` (lists where a path has integer components; a key without a recorded path
  stays flat), unpickled with
  ``torch.load(weights_only=True)`` (`PLAIN_DATA_TYPES`
  allowed) unless ``allow_pickle``;
* there are no ShardedObjects: requesting one raises [`KeyMismatchError`][dist_ckpt.errors.KeyMismatchError].

Example:

```python
sd = {"w": ShardedTensor.from_rank_offsets("model.layers.0.w", local, (0, rank, world))}
state = dc.load(sd, "torchtitan/step-1000")          # state["step"] comes from the bytes entries
```
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, Tuple

from dist_ckpt.backends.base import LoadCommonStrategy
from dist_ckpt.backends.request_checks import refuse_sharded_objects
from dist_ckpt.backends.torch_dist.load import (
    TorchDistLoadShardedStrategy,
    local_storage,
    open_checkpoint,
    unpickle_item,
)
from dist_ckpt.integrity.checksums import IntegrityReport
from dist_ckpt.model.sharded import ShardedStateDict, StateDict
from dist_ckpt.storage import RangeRead, Storage

__all__ = ["DCP_BACKEND", "DCPCommonLoadStrategy", "DCPLoadShardedStrategy"]

#: the backend of plain DCP directories (read only)
DCP_BACKEND: Tuple[str, int] = ("dcp", 1)
_OPT_IN = "common_strategy=DCPCommonLoadStrategy(allow_pickle=True)"


class DCPLoadShardedStrategy(TorchDistLoadShardedStrategy):
    """The tensors of a plain DCP directory, in any sharding (see
    [`TorchDistLoadShardedStrategy`][dist_ckpt.backends.torch_dist.load.TorchDistLoadShardedStrategy] for the
    arguments); its bytes entries are common state, not ShardedObjects."""

    supported_backends: ClassVar[Tuple[str, ...]] = (DCP_BACKEND[0],)
    supported_versions: ClassVar[Tuple[int, ...]] = (DCP_BACKEND[1],)
    megatron_objects: ClassVar[bool] = False


def _path_of(planner_data: Any, key: str) -> Tuple[Any, ...]:
    path = planner_data.get(key) if isinstance(planner_data, dict) else None
    if isinstance(path, (tuple, list)) and path and all(isinstance(p, (str, int)) for p in path):
        return tuple(path)
    return (key,)


def _slot(node: Any, part: Any) -> bool:
    """Whether ``part`` can index ``node`` (a list grows to hold it)."""
    if isinstance(node, list) and isinstance(part, int) and part >= 0:
        node.extend([None] * (part + 1 - len(node)))
        return True
    return isinstance(node, dict)


def _insert(state: Dict[Any, Any], path: Tuple[Any, ...], value: Any, key: str) -> None:
    """Put ``value`` at ``path`` of ``state``, creating lists for integer components and dicts for
    the others (as DCP's unflattening does); a path that clashes keeps it under its flat key."""
    node: Any = state
    for part, following in zip(path[:-1], path[1:]):
        empty: Any = [] if isinstance(following, int) else {}
        if not _slot(node, part):
            state[key] = value
            return
        child = node[part] if isinstance(node, list) else node.setdefault(part, empty)
        if child is None:
            child = node[part] = empty
        node = child
    if not _slot(node, path[-1]):
        state[key] = value
        return
    node[path[-1]] = value


class DCPCommonLoadStrategy(LoadCommonStrategy):
    """The common state of a plain DCP directory: every bytes entry, unpickled safely.

    Args:
        allow_pickle: unpickle with full pickle (runs code from the checkpoint; trusted only).
    """

    supported_backends: ClassVar[Tuple[str, ...]] = (DCP_BACKEND[0],)
    supported_versions: ClassVar[Tuple[int, ...]] = (DCP_BACKEND[1],)

    def __init__(self, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def load_common(self, checkpoint_dir: Storage) -> StateDict:
        storage = local_storage(checkpoint_dir)
        opened = open_checkpoint(storage, self.allow_pickle)
        planner_data = opened.layout.metadata.planner_data
        entries = sorted(opened.layout.byte_items.items(), key=lambda e: (e[1].file, e[1].offset))
        buffers = [bytearray(item.length) for _, item in entries]
        storage.read_ranges([RangeRead.into(item.file, item.offset, buf) for (_, item), buf in zip(entries, buffers)])
        state: Dict[Any, Any] = {}
        for (key, item), data in zip(entries, buffers):
            where = storage.url_of(item.file)
            value = unpickle_item(bytes(data), where, f"value {key!r}", self.allow_pickle, _OPT_IN)
            _insert(state, _path_of(planner_data, key), value, key)
        return state

    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> StateDict:
        return refuse_sharded_objects(
            sharded_objects_state_dict,
            f"DCP checkpoint {checkpoint_dir.url!r} holds no ShardedObjects "
            "(its non-tensor values are its common state)",
        )

    def load_sharded_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        return {}

    def verify_integrity(self, checkpoint_dir: Storage) -> IntegrityReport:
        """Nothing of its own: the bytes entries are checked with the DCP files."""
        return IntegrityReport()
