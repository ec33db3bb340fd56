"""Sharded state dicts as DCP state dicts: Megatron-Core's translation helpers of ``strategies.torch``.

Megatron-Core saves and loads a sharded state dict through torch.distributed.checkpoint by
translating it first: `flatten_state_dict()` gives it one level of dotted keys (ShardedTensors
and ShardedObjects are leaves), the ShardedBase objects are grouped by their key, and
`mcore_to_pyt_state_dict()` turns each group into a value DCP understands -- a
`CheckpointableShardedTensor` (or a `LocalShardsContainer` of several) or the ``torch.save``
bytes of a ShardedObject's values. `sharded_tensor_to_torch_sharded_tensor()` builds the PyTorch
``ShardedTensor`` Megatron-Core used for tensors with prepended axes before 0.14 (it needs a
process group; the checkpointable value stores the same chunk without one, so the translation
uses that for every tensor). Whatever the value, DCP stores the chunks the ``torch_dist`` strategy
stores (`layout`), so either reads what the other wrote.

Example:

```python
flat, paths = flatten_state_dict(sharded_state_dict)
grouped = {sh.key: [sh] for sh in flat.values()}
dcp_state = mcore_to_pyt_state_dict(grouped)            # is_loading=True before a load
torch.distributed.checkpoint.save(dcp_state, storage_writer=writer, planner=MCoreSavePlanner(flatten_state_dict=False))
```
"""

from __future__ import annotations

import io
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.api import ShardedTensor as TorchShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as ShardTensorProperties
from torch.distributed._shard.sharded_tensor.shard import Shard

from dist_ckpt.backends.torch_dist.checkpointable import CheckpointableShardedTensor, LocalShardsContainer
from dist_ckpt.backends.torch_dist.layout import chunk_data, write_chunk
from dist_ckpt.collectives.distributed import get_rank, get_world_size
from dist_ckpt.errors import ArgumentTypeError, InvalidShardedTensorError, StateDictStructureError
from dist_ckpt.model.sharded import ShardedBase, ShardedObject, ShardedTensor

__all__ = ["flatten_state_dict", "mcore_to_pyt_state_dict", "sharded_tensor_to_torch_sharded_tensor"]

#: the path of a leaf: dict keys (as strings) and list positions, DCP's ``OBJ_PATH``
ObjPath = Tuple[Union[str, int], ...]


def _is_leaf(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, ShardedBase))


def _holds_leaf(value: Any) -> bool:
    """A dict, or a list with a tensor, a ShardedBase or such a container inside (DCP descends into those)."""
    if isinstance(value, Mapping):
        return True
    if isinstance(value, list):
        return any(_is_leaf(v) or _holds_leaf(v) for v in value)
    return False


def flatten_state_dict(state_dict: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, ObjPath]]:
    """A one-level copy of ``state_dict`` and the path of each of its keys (to rebuild the nesting).

    As DCP's own flattening, with ShardedTensors and ShardedObjects as leaves: dicts are entered,
    lists are entered when they hold a tensor, a ShardedBase or a dict, any other value is a leaf.
    A key is the path joined with dots. DCP's ``unflatten_state_dict(flat, paths)`` inverts it.

    Raises:
        StateDictStructureError: two paths give the same dotted key (e.g. ``{"a.b": x, "a": {"b": y}}``).

    Example:

    ```python
    flatten_state_dict({"layer": {"w": sh_w}, "opt": [sh_m, sh_v]})
    # ({"layer.w": sh_w, "opt.0": sh_m, "opt.1": sh_v}, {"layer.w": ("layer", "w"), ...})
    ```
    """
    flat: Dict[str, Any] = {}
    paths: Dict[str, ObjPath] = {}

    def visit(path: ObjPath, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit(path + (str(k),), v)
            return
        if isinstance(value, list) and _holds_leaf(value):
            for i, v in enumerate(value):
                visit(path + (i,), v)
            return
        key = ".".join(map(str, path))
        if key in flat:
            raise StateDictStructureError(
                f"flatten_state_dict: two entries of the state dict flatten to the key {key!r} "
                f"(paths {paths[key]} and {path}); rename one"
            )
        flat[key] = value
        paths[key] = path

    for k, v in state_dict.items():
        visit((str(k),), v)
    return flat, paths


def _placement(rank: int, tensor: torch.Tensor) -> str:
    return f"rank:{rank}/{tensor.device}"


def sharded_tensor_to_torch_sharded_tensor(
    sh_tens: List[ShardedTensor], rank: Optional[int] = None, load_legacy_1d_flatten_tensors: bool = False
) -> TorchShardedTensor:
    """A PyTorch ``ShardedTensor`` holding this rank's shards of one tensor, built without communication.

    Each shard is the ShardedTensor's data viewed with its prepended axes (the chunk the
    ``torch_dist`` strategy stores); the global metadata lists the other ranks' shards of the
    regular grid of ``axis_fragmentations`` (placed on another rank: PyTorch discards them). The
    ShardedTensors themselves are left unchanged; a non-contiguous ``data`` is made contiguous (a
    copy, saved from; load into a contiguous tensor to load in place). The result carries
    ``mcore_sh_ten`` (the first ShardedTensor without data) and ``key``.

    Args:
        sh_tens: this rank's shards of one tensor (same key), with data.
        rank: the rank named in the shards' placement (default: this process's).
        load_legacy_1d_flatten_tensors: accepted for Megatron-Core's signature; flattened
            ShardedTensors are refused whatever its value (the ``torch_dist`` strategy stores them).

    Raises:
        InvalidShardedTensorError: no shards, a shard without data or with a ``flattened_range``,
            or a tensor without a regular grid (``axis_fragmentations=None``: use
            `CheckpointableShardedTensor`).
    """
    if not sh_tens:
        raise InvalidShardedTensorError("sharded_tensor_to_torch_sharded_tensor needs at least one ShardedTensor")
    rank = get_rank() if rank is None else rank
    first = sh_tens[0]
    for sh in sh_tens:
        if sh.data is None or sh.flattened_range is not None or sh.axis_fragmentations is None:
            raise InvalidShardedTensorError(
                f"[rank {rank}] {sh.key!r}: a PyTorch ShardedTensor is built from ShardedTensors with data, on a "
                f"regular grid and without flattened_range (got data={'None' if sh.data is None else 'set'}, "
                f"axis_fragmentations={sh.axis_fragmentations}, flattened_range={sh.flattened_range})"
            )
    local_shards: List[Shard] = []
    local_offsets: Dict[Tuple[int, ...], List[torch.Tensor]] = {}
    for sh in sh_tens:
        assert sh.data is not None  # checked above
        source = sh if sh.data.is_contiguous() else _with_data(sh, sh.data.contiguous())
        data = chunk_data(source)
        offsets, _, _ = write_chunk(sh)
        local_shards.append(Shard.from_tensor_and_offsets(data, list(offsets), rank))
        local_offsets.setdefault(offsets, []).append(data)
    example = local_shards[0].tensor
    block = tuple(example.shape)
    other = (rank + 1) % max(get_world_size(), 1)
    shards_metadata: List[ShardMetadata] = []
    grid = first.axis_fragmentations
    assert grid is not None  # checked above
    for position in _grid_positions(grid):
        offset = tuple(i * n for i, n in zip(position, block))
        if offset in local_offsets:
            for data in local_offsets[offset]:
                shards_metadata.append(ShardMetadata(list(offset), list(data.shape), _placement(rank, data)))
        else:  # another rank's shard: PyTorch keeps only its own, but needs the whole grid described
            shards_metadata.append(ShardMetadata(list(offset), list(block), _placement(other, example)))
    metadata = ShardedTensorMetadata(
        shards_metadata=shards_metadata,
        size=torch.Size(first.global_shape),
        tensor_properties=ShardTensorProperties(
            dtype=example.dtype,
            layout=example.layout,
            requires_grad=example.requires_grad,
            memory_format=torch.contiguous_format,
            pin_memory=example.is_pinned(),
        ),
    )
    result = TorchShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, sharded_tensor_metadata=metadata, process_group=None
    )
    result.mcore_sh_ten = first.without_data()  # type: ignore[attr-defined]  # Megatron-Core's attributes
    result.key = first.key  # type: ignore[attr-defined]
    return result


def _grid_positions(grid: Sequence[int]) -> List[Tuple[int, ...]]:
    positions: List[Tuple[int, ...]] = [()]
    for n in grid:
        positions = [p + (i,) for p in positions for i in range(n)]
    return positions


def _with_data(sh: ShardedTensor, data: torch.Tensor) -> ShardedTensor:
    copy = sh.without_data()
    copy.data = data
    return copy


def _prepare_tensors(sh_tens: List[ShardedTensor], is_loading: bool, init_device: torch.device) -> None:
    for sh in sh_tens:
        if sh.data is None:
            if not is_loading:
                raise InvalidShardedTensorError(f"[rank {get_rank()}] {sh.key!r}: a ShardedTensor to save has no data")
            sh.init_data(init_device, init_fn=torch.zeros if sh.allow_shape_mismatch else torch.empty)
            continue
        sh.data = sh.data.detach()
        if sh.allow_shape_mismatch and is_loading:  # parts the checkpoint lacks are left zero
            sh.data.zero_()


def _dcp_tensor(sh_tens: List[ShardedTensor]) -> torch.Tensor:
    """The DCP value of one key's ShardedTensors (see the module docstring)."""
    first = sh_tens[0]
    if first.flattened_range is not None:
        raise InvalidShardedTensorError(
            f"[rank {get_rank()}] {first.key!r}: a ShardedTensor with a flattened_range has no DCP value here "
            f"(it is stored reformulated); save it with the torch_dist strategy"
        )
    if len(sh_tens) == 1:
        return CheckpointableShardedTensor.from_sh_ten(first)
    return LocalShardsContainer([CheckpointableShardedTensor.from_sh_ten(sh) for sh in sh_tens])


def _object_bytes(sh_objs: List[ShardedObject]) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save([obj.data for obj in sh_objs], buf)
    buf.seek(0)
    return buf


def mcore_to_pyt_state_dict(
    state_dict: Dict[str, List[ShardedBase]],
    is_loading: bool = False,
    init_device: torch.device = torch.device("cpu"),
    load_legacy_1d_flatten_tensors: bool = False,
) -> Dict[str, Union[torch.Tensor, io.BytesIO]]:
    """The DCP state dict of a flat state dict whose values are lists of one key's ShardedBase objects.

    ShardedTensors become `CheckpointableShardedTensor` (a `LocalShardsContainer` for several: the
    chunks, prepended axes included, that Megatron-Core stores); ShardedObjects become the
    ``torch.save`` bytes of the list of their values (as Megatron-Core stores them). Before a load
    (``is_loading``), a ShardedTensor without data gets an empty tensor on ``init_device`` to load
    into, and one with ``allow_shape_mismatch`` is zeroed (the checkpoint may not cover it). The
    ShardedTensors' data are detached in place; the input dict itself is left as it was.

    Args:
        state_dict: key -> this rank's ShardedTensors, or ShardedObjects, of that key.
        is_loading: prepare for a load instead of a save.
        init_device: where missing tensors are made for a load.
        load_legacy_1d_flatten_tensors: accepted for Megatron-Core's signature (see
            `sharded_tensor_to_torch_sharded_tensor()`).

    Raises:
        InvalidShardedTensorError: a ShardedTensor to save has no data, or one has a ``flattened_range``.
        ArgumentTypeError: a value that is not a non-empty list of ShardedTensors or of ShardedObjects.

    Example:

    ```python
    mcore_to_pyt_state_dict({"w": [sh_w], "rng/shard_0_1": [sh_rng]})
    # {"w": CheckpointableShardedTensor(...), "rng/shard_0_1": io.BytesIO(...)}
    ```
    """
    result: Dict[str, Union[torch.Tensor, io.BytesIO]] = {}
    for key, values in state_dict.items():
        if values and all(isinstance(v, ShardedTensor) for v in values):
            tensors = [v for v in values if isinstance(v, ShardedTensor)]
            _prepare_tensors(tensors, is_loading, init_device)
            result[key] = _dcp_tensor(tensors)
        elif values and all(isinstance(v, ShardedObject) for v in values):
            result[key] = _object_bytes([v for v in values if isinstance(v, ShardedObject)])
        else:
            raise ArgumentTypeError(
                f"[rank {get_rank()}] mcore_to_pyt_state_dict: {key!r} must map to a non-empty list of ShardedTensors "
                f"or of ShardedObjects, got {[type(v).__name__ for v in values]}"
            )
    return result
