"""ShardedTensors that DCP saves and loads as they are: Megatron-Core's ``strategies.checkpointable``.

DCP asks each value of a state dict how to save and load it through its ``_Checkpointable``
protocol (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``): a
value that answers is neither flattened nor copied. `CheckpointableShardedTensor` answers for one
ShardedTensor (its chunk is `layout.write_chunk()`'s, so a save through DCP's own planners stores
what the ``torch_dist`` strategy stores); `LocalShardsContainer` holds the several shards one rank
has of one tensor (DCP allows one value per key and rank). Both are tensor *wrappers* of the
global shape that carry no storage: DCP reads their protocol methods, never their elements, and
any tensor operation on them raises [`ArgumentTypeError`][dist_ckpt.errors.ArgumentTypeError].

Example:

```python
sh = ShardedTensor.from_rank_offsets("w", torch.ones(2, 4), (0, 0, 2))
state = {"w": CheckpointableShardedTensor.from_sh_ten(sh)}
torch.distributed.checkpoint.save(state, storage_writer=FileSystemWriter(path), no_dist=True)
```
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from dist_ckpt.backends.torch_dist.layout import chunk_data, write_chunk
from dist_ckpt.errors import ArgumentTypeError, InvalidShardedTensorError
from dist_ckpt.model.sharded import ShardedTensor

__all__ = ["CheckpointableShardedTensor", "LocalShardsContainer"]


class _CheckpointContainer(torch.Tensor):
    """A tensor subclass that only carries values for DCP's ``_Checkpointable`` protocol: every
    tensor operation on it is refused."""

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's stub omits func
        cls, func: Any, types: Sequence[type], args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None
    ) -> Any:
        raise ArgumentTypeError(
            f"{cls.__name__} is a container that torch.distributed.checkpoint saves and loads; it supports no tensor "
            f"operation (called: {func}); use its ShardedTensor's data instead"
        )


class CheckpointableShardedTensor(_CheckpointContainer):
    """One ShardedTensor as a value DCP saves and loads in place (its ``_Checkpointable`` protocol).

    The wrapper has the ShardedTensor's global shape; its one chunk is at ``global_offset`` (prepended
    axes included) with the ShardedTensor's full local shape, and loading writes into ``sh_ten.data``.

    Args:
        data: the ShardedTensor's data (kept for Megatron-Core's signature; the ShardedTensor's own
            ``data`` is what is saved and loaded into).
        sh_ten: the ShardedTensor (with data; not a flattened one).

    Raises:
        InvalidShardedTensorError: ``sh_ten`` has no data, or a ``flattened_range`` (those are stored
            reformulated: save them with the ``torch_dist`` strategy).
    """

    _sh_ten: ShardedTensor

    @staticmethod
    def __new__(cls, data: Optional[torch.Tensor], sh_ten: ShardedTensor) -> "CheckpointableShardedTensor":
        if sh_ten.data is None or sh_ten.flattened_range is not None:
            what = "has no data" if sh_ten.data is None else "has a flattened_range"
            raise InvalidShardedTensorError(
                f"{sh_ten.key!r}: a CheckpointableShardedTensor needs a ShardedTensor with data and no flattened_range "
                f"(this one {what}); flattened tensors are saved by the torch_dist strategy"
            )
        return torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(sh_ten.global_shape), dtype=sh_ten.data.dtype, device=sh_ten.data.device
        )

    def __init__(self, data: Optional[torch.Tensor], sh_ten: ShardedTensor) -> None:
        self._sh_ten = sh_ten

    @classmethod
    def from_sh_ten(cls, sh_ten: ShardedTensor) -> "CheckpointableShardedTensor":
        """Wrap ``sh_ten`` (Megatron-Core's constructor)."""
        if not isinstance(sh_ten, ShardedTensor):
            raise ArgumentTypeError(f"from_sh_ten expects a ShardedTensor, got {type(sh_ten).__name__}")
        return cls(sh_ten.data, sh_ten)

    def _chunk(self) -> Tuple[torch.Size, torch.Size, torch.Size]:
        offsets, sizes, size = write_chunk(self._sh_ten)
        return torch.Size(offsets), torch.Size(sizes), torch.Size(size)

    def __create_write_items__(
        self, fqn: str, sh_ten: "CheckpointableShardedTensor", index: Optional[int] = None
    ) -> List[WriteItem]:
        """The one DCP ``WriteItem`` of the chunk (``index``: its position in a `LocalShardsContainer`)."""
        offsets, sizes, size = sh_ten._chunk()
        data = sh_ten.__get_tensor_shard__(MetadataIndex(fqn, offsets))
        properties = TensorProperties.create_from_tensor(data)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets, index),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes), properties, size),
            )
        ]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        """The chunk DCP loads into (the same box the save wrote)."""
        offsets, sizes, _ = self._chunk()
        return [ChunkStorageMetadata(offsets=offsets, sizes=sizes)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The ShardedTensor's data shaped like its chunk (a view: a load fills ``data`` in place)."""
        return chunk_data(self._sh_ten)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self._sh_ten})"


class LocalShardsContainer(_CheckpointContainer):
    """The several shards one rank has of one tensor, as one DCP value.

    DCP takes one value per key on each rank; this container answers its protocol for all of its
    `CheckpointableShardedTensor` s, finding the one DCP asks for by its offset (with the position
    DCP was given at save as a hint).

    Args:
        local_shards: the shards (at least one), each a `CheckpointableShardedTensor` of the same key.

    Raises:
        ArgumentTypeError: no shards, or a shard that is not a `CheckpointableShardedTensor`.
    """

    _local_shards: List[CheckpointableShardedTensor]

    @staticmethod
    def __new__(cls, local_shards: List[torch.Tensor]) -> "LocalShardsContainer":
        if not local_shards or not all(isinstance(s, CheckpointableShardedTensor) for s in local_shards):
            raise ArgumentTypeError(
                "LocalShardsContainer needs a non-empty list of CheckpointableShardedTensor, got "
                f"{[type(s).__name__ for s in local_shards]}"
            )
        first = local_shards[0]
        return torch.Tensor._make_wrapper_subclass(cls, first.size(), dtype=first.dtype, device=first.device)

    def __init__(self, local_shards: List[torch.Tensor]) -> None:
        self._local_shards = [s for s in local_shards if isinstance(s, CheckpointableShardedTensor)]

    def __create_write_items__(self, fqn: str, local_shards_cont: "LocalShardsContainer") -> List[WriteItem]:
        """Every shard's write item, each with its position in the container as DCP's index hint."""
        return [
            item
            for position, shard in enumerate(local_shards_cont._local_shards)
            for item in shard.__create_write_items__(fqn, shard, index=position)
        ]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        """Every shard's chunk."""
        return [chunk for shard in self._local_shards for chunk in shard.__create_chunk_list__()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The shard at ``index.offset`` (tried first at the position ``index.index``).

        Raises:
            InvalidShardedTensorError: no offset given, or no shard of this rank starts there.
        """
        if index.offset is None:
            raise InvalidShardedTensorError(f"{index.fqn!r}: a shard of a LocalShardsContainer is found by its offset")
        shards = self._local_shards
        if index.index is not None and index.index < len(shards):
            hinted = shards[index.index]
            if hinted._chunk()[0] == index.offset:
                return hinted.__get_tensor_shard__(index)
        for shard in shards:
            if shard._chunk()[0] == index.offset:
                return shard.__get_tensor_shard__(index)
        raise InvalidShardedTensorError(
            f"{index.fqn!r}: this rank has no shard at offset {tuple(index.offset)} "
            f"(its shards start at {[tuple(s._chunk()[0]) for s in shards]})"
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({[s._sh_ten for s in self._local_shards]})"
