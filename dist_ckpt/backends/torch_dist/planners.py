"""Megatron-Core's DCP planners (``strategies.torch``) and its metadata-caching reader.

* `MCoreSavePlanner` -- DCP's default save planner for a state dict made by
  `pyt_state_dict.mcore_to_pyt_state_dict()`: every rank writes its own bytes entries
  (ShardedObjects are per rank, not replicated), written as they are (already serialized), and the
  global plan can be made on each rank alone ("decentralized": every rank's items are final,
  which `state_dict_saver.save_state_dict_async_plan()` uses to skip a scatter of plans);
* `MCoreLoadPlanner` -- DCP's default load planner that first checks every ShardedTensor's
  global shape against the checkpoint (a clear error instead of a silent partial read), lets the
  ShardedTensors marked ``allow_shape_mismatch`` load whatever overlaps, unpickles bytes entries
  without running code from the checkpoint (unless ``allow_pickle``), and reads into a
  contiguous buffer when the target is not contiguous (Megatron-Core needs it for FP8 tensors);
* `CachedMetadataFileSystemReader` -- DCP's ``FileSystemReader`` that reads ``.metadata`` once
  per reader, with dist_ckpt's restricted unpickler (nothing from the file runs).

Example:

```python
dcp.save(dcp_state, storage_writer=FileSystemWriter(path), planner=MCoreSavePlanner(flatten_state_dict=False))
dcp.load(dcp_state, storage_reader=CachedMetadataFileSystemReader(path),
         planner=MCoreLoadPlanner(shapes_validation_sharded_tensors=sharded_tensors))
```
"""

from __future__ import annotations

import io
import os
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem
from torch.distributed.checkpoint.planner_helpers import _create_write_items

from dist_ckpt.backends.torch_dist.load import unpickle_item
from dist_ckpt.backends.torch_dist.metadata import read_metadata
from dist_ckpt.errors import ArgumentTypeError, KeyMismatchError, LoadMismatchError
from dist_ckpt.model.sharded import ShardedTensor

__all__ = ["CachedMetadataFileSystemReader", "MCoreLoadPlanner", "MCoreSavePlanner"]

_OPT_IN = "MCoreLoadPlanner(allow_pickle=True)"


class MCoreSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with every rank writing its own bytes entries as they are.

    Args:
        *args: DCP's ``DefaultSavePlanner`` arguments.
        **kwargs: DCP's ``DefaultSavePlanner`` keyword arguments (``flatten_state_dict`` must be
            False for a decentralized plan: the state dict is flat already).
        dedup_replicated_tensors: DCP's deduplication (deprecated in DCP; must be falsy for a
            decentralized plan: the ShardedTensors' ``replica_id`` already decides who saves).
        can_run_decentralized_global_plan: every rank may turn its local plan into its global plan
            alone (`create_decentralized_global_plan()`).

    Raises:
        ArgumentTypeError: a decentralized plan asked for with flattening or deduplication on.
    """

    def __init__(
        self,
        *args: Any,
        dedup_replicated_tensors: Optional[bool] = None,
        can_run_decentralized_global_plan: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.can_run_decentralized_global_plan = can_run_decentralized_global_plan
        if can_run_decentralized_global_plan and (dedup_replicated_tensors or self.flatten_state_dict):
            raise ArgumentTypeError(
                "MCoreSavePlanner: a decentralized global plan needs flatten_state_dict=False and "
                f"dedup_replicated_tensors falsy (got flatten_state_dict={self.flatten_state_dict}, "
                f"dedup_replicated_tensors={dedup_replicated_tensors}); pass them, or "
                "can_run_decentralized_global_plan=False"
            )

    def create_local_plan(self) -> SavePlan:
        """One write request per tensor chunk and per bytes entry of this rank (on every rank)."""
        items: List[WriteItem] = []
        for fqn, obj in self.state_dict.items():
            items += _create_write_items(fqn, obj)
        self.plan = SavePlan(items=items, planner_data=self.mappings)
        return self.plan

    def create_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """The global plan of this rank, made without the other ranks: its local plan, unchanged.

        Raises:
            ArgumentTypeError: the plan carries flattening mappings (they need the coordinator).
        """
        if self.flatten_state_dict or local_plan.planner_data:
            raise ArgumentTypeError(
                "MCoreSavePlanner: a decentralized global plan cannot carry flatten_state_dict's mappings; "
                "flatten the state dict before planning (flatten_state_dict=False)"
            )
        return local_plan

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 -- DCP's name
        """Bytes entries are already serialized (``io.BytesIO``): written as they are."""
        return object


class MCoreLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner with Megatron-Core's checks of global shapes.

    Args:
        *args: DCP's ``DefaultLoadPlanner`` arguments.
        **kwargs: DCP's ``DefaultLoadPlanner`` keyword arguments.
        shapes_validation_sharded_tensors: ShardedTensors whose key must be in the checkpoint with
            exactly their global shape.
        allow_shape_mismatch_sharded_tensors: key -> ShardedTensor whose stored shape may differ
            (what overlaps is read; the rest is left as it is).
        allow_pickle: bytes entries (ShardedObjects) may need full pickle, which runs code from
            the checkpoint: only for checkpoints you trust. By default they are read with
            ``torch.load(weights_only=True)`` (DCP's default planner uses full pickle).
    """

    def __init__(
        self,
        *args: Any,
        shapes_validation_sharded_tensors: Iterable[ShardedTensor] = (),
        allow_shape_mismatch_sharded_tensors: Optional[Dict[str, ShardedTensor]] = None,
        allow_pickle: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.allow_pickle = allow_pickle
        self.shapes_validation_sharded_tensors = shapes_validation_sharded_tensors
        self.allow_shape_mismatch_sharded_tensors = allow_shape_mismatch_sharded_tensors
        self._intermediate_read_item_and_target: Optional[Tuple[ReadItem, torch.Tensor]] = None

    def _validate_global_shapes(self, metadata: Metadata, sharded_tensors: Iterable[ShardedTensor]) -> None:
        stored = metadata.state_dict_metadata
        for sh in sharded_tensors:
            if sh.key not in stored:
                raise KeyMismatchError(f"{sh.key!r} from the model is not in the checkpoint (it has {sorted(stored)})")
            entry = stored[sh.key]
            found = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None
            if found != tuple(sh.global_shape):
                raise LoadMismatchError(
                    f"global shape mismatch for {sh.key!r}: the checkpoint holds {found}, the model expects "
                    f"{tuple(sh.global_shape)} (mark it allow_shape_mismatch=True to load what overlaps)"
                )

    @contextmanager
    def _temporarily_bypass_shape_validation(self) -> Iterator[None]:
        """DCP refuses a target whose size differs from the stored one: for the tensors allowed to
        differ, the stored size is the expected one while the local plan is made."""
        allowed = self.allow_shape_mismatch_sharded_tensors or {}
        assert self.metadata is not None
        stored = self.metadata.state_dict_metadata
        saved: List[Tuple[TensorStorageMetadata, torch.Size, ShardedTensor]] = []
        for key, sh in allowed.items():
            entry = stored.get(key)
            if isinstance(entry, TensorStorageMetadata):
                saved.append((entry, entry.size, sh))
        try:
            for entry, _, sh in saved:
                entry.size = torch.Size(sh.global_shape)
            yield
        finally:
            for entry, size, _ in saved:
                entry.size = size

    def create_local_plan(self) -> LoadPlan:
        """Check the global shapes, then DCP's local plan (see `_temporarily_bypass_shape_validation`).

        Raises:
            KeyMismatchError: a ShardedTensor's key is not in the checkpoint.
            LoadMismatchError: its stored global shape differs.
        """
        assert self.metadata is not None  # set by DCP before planning
        self._validate_global_shapes(self.metadata, self.shapes_validation_sharded_tensors)
        with self._temporarily_bypass_shape_validation():
            return super().create_local_plan()

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Set a bytes entry's value, unpickled without running code from the checkpoint unless
        ``allow_pickle``.

        Raises:
            UnsafeObjectError: the value needs full pickle (names the key and the opt-in).
        """
        fqn = read_item.dest_index.fqn
        where = (
            str(self.metadata.storage_meta.checkpoint_id)
            if self.metadata and self.metadata.storage_meta
            else "the checkpoint"
        )
        loaded = unpickle_item(value.getvalue(), where, f"bytes entry {fqn!r}", self.allow_pickle, _OPT_IN)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The tensor DCP reads ``read_item`` into: a contiguous copy of a non-contiguous target
        (copied back in `commit_tensor()`), since not every tensor type copies into a strided view."""
        target: torch.Tensor = super().resolve_tensor(read_item)
        if target.is_contiguous():
            return target
        self._intermediate_read_item_and_target = (read_item, target)
        return target.contiguous()

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Copy a tensor read into a contiguous buffer back into its target."""
        pending = self._intermediate_read_item_and_target
        if pending is not None:
            if pending[0] is not read_item:
                raise LoadMismatchError(
                    f"MCoreLoadPlanner: commit_tensor for {read_item.dest_index.fqn!r} came before the read of "
                    f"{pending[0].dest_index.fqn!r} was committed (DCP commits each tensor right after resolving it)"
                )
            pending[1].copy_(tensor)
            tensor = pending[1]
            self._intermediate_read_item_and_target = None
        super().commit_tensor(read_item, tensor)


class CachedMetadataFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that reads ``.metadata`` once and keeps it.

    ``.metadata`` is read with dist_ckpt's restricted unpickler (it holds only DCP's and
    Megatron-Core's metadata classes; nothing from the file runs), so a planner and the strategy
    that made the reader share one parse.

    Args:
        path: the checkpoint directory.

    Example:

    ```python
    reader = CachedMetadataFileSystemReader("ckpt/iter_10")
    dcp.load(state, storage_reader=reader)
    reader.read_metadata()        # the metadata of the load, not read again
    ```
    """

    def __init__(self, path: Union[str, "os.PathLike[str]"]) -> None:
        super().__init__(path=path)
        self._cached_metadata: Optional[Metadata] = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata (read on the first call only)."""
        if self._cached_metadata is None:
            metadata = read_metadata(str(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            assert metadata.storage_meta is not None
            metadata.storage_meta.load_id = self.load_id
            self._cached_metadata = metadata
        return self._cached_metadata
