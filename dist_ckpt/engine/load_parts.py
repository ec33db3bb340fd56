"""Read one part of a checkpoint: common state, metadata, whole tensors, ShardedObjects.

Unlike [`dist_ckpt.load()`][dist_ckpt.engine.load.load], these read what the checkpoint holds rather than a layout the
caller describes, and need no process group. None is collective: any one rank may call them on
its own while a process group is initialized (as with Megatron-Core's), since they run inside
`local_only()`.
"""

from __future__ import annotations

from dist_ckpt.backends.registry import StrategySpec
from dist_ckpt.collectives.distributed import local_only
from dist_ckpt.engine.checks.compatibility import validate_sharded_objects_handling, verify_checkpoint_and_load_strategy
from dist_ckpt.model.dict_utils import dict_list_map_inplace, merge, nested_values
from dist_ckpt.model.sharded import ShardedObject, ShardedStateDict, StateDict
from dist_ckpt.storage.location import LocationLike, resolve_location


def load_common_state_dict(checkpoint_dir: LocationLike, common_strategy: StrategySpec = None) -> StateDict:
    """The common (non-sharded) state of a checkpoint; needs no process group, not collective."""
    with local_only():
        location = resolve_location(checkpoint_dir)
        _, common = verify_checkpoint_and_load_strategy(location, common_strategy=common_strategy)
        return common.load_common(location)


def load_tensors_metadata(checkpoint_dir: LocationLike, sharded_strategy: StrategySpec = None) -> ShardedStateDict:
    """``{key: ShardedTensor}`` with each stored tensor's global shape and dtype (no data).

    The ShardedTensors describe whole, unsharded tensors as they were saved, as Megatron-Core's
    do: ``local_shape == global_shape``, and a tensor saved as flattened ranges (distributed
    optimizer) has a ``flattened_range`` covering all of it. Passed to [`load()`][dist_ckpt.engine.load.load], the
    result reads every tensor whole: with its shape, or flat (1-D) when it was saved flattened
    (`dist_ckpt.model.stored_metadata.shaped()` gives the shaped description instead).
    Needs no process group, not collective.

    Example:

    ```python
    meta = load_tensors_metadata("ckpt/iter_10")
    meta["optimizer.exp_avg"].flattened_range      # slice(0, numel) if saved flattened
    ```
    """
    with local_only():
        location = resolve_location(checkpoint_dir)
        sharded, _ = verify_checkpoint_and_load_strategy(location, sharded_strategy)
        return sharded.load_tensors_metadata(location)


def load_sharded_metadata(
    checkpoint_dir: LocationLike, sharded_strategy: StrategySpec = None, common_strategy: StrategySpec = None
) -> ShardedStateDict:
    """Metadata of every stored ShardedTensor (by key) and ShardedObject (by unique key); not
    collective."""
    with local_only():
        location = resolve_location(checkpoint_dir)
        sharded, common = verify_checkpoint_and_load_strategy(location, sharded_strategy, common_strategy)
        metadata = sharded.load_sharded_metadata(location)
        if not sharded.can_handle_sharded_objects:
            validate_sharded_objects_handling(sharded, common)
            merge(metadata, common.load_sharded_metadata(location))
        return metadata


def load_plain_tensors(checkpoint_dir: LocationLike) -> StateDict:
    """Every stored tensor, whole, keyed by its checkpoint key (the common state is not included):
    [`load()`][dist_ckpt.engine.load.load] of
    [`load_tensors_metadata()`][dist_ckpt.engine.load_parts.load_tensors_metadata], as in Megatron-Core, so a tensor
    saved as flattened ranges comes back flat (1-D); [`dist_ckpt.unshard()`][dist_ckpt.tools.unshard.unshard] returns
    every tensor with its shape.

    Not collective: the calling rank alone reads every tensor, whether or not the other ranks
    call it too.
    """
    with local_only():
        location = resolve_location(checkpoint_dir)
        sharded, _ = verify_checkpoint_and_load_strategy(location)
        return sharded.load(sharded.load_tensors_metadata(location), location)


def load_sharded_objects(sharded_state_dict: ShardedStateDict, checkpoint_dir: LocationLike) -> StateDict:
    """Replace every ShardedObject in ``sharded_state_dict`` by its stored value (in place); other
    values stay as they are.

    The objects are read by the backend that stores them, as in [`load()`][dist_ckpt.engine.load.load]: the sharded
    backend when it handles ShardedObjects (``torch_dist`` keeps them inside DCP's files), else the
    common one.

    Example:

    ```python
    load_sharded_objects({"rng": ShardedObject("rng", None, (2,), (1,))}, "ckpt/iter_10")["rng"]
    ```
    """
    location = resolve_location(checkpoint_dir)
    sharded, common = verify_checkpoint_and_load_strategy(location)
    if not sharded.can_handle_sharded_objects:
        return common.load_sharded_objects(sharded_state_dict, location)
    objects = [x for x in nested_values(sharded_state_dict) if isinstance(x, ShardedObject)]
    loaded = sharded.load({str(i): obj for i, obj in enumerate(objects)}, location)
    values = {id(obj): loaded[str(i)] for i, obj in enumerate(objects)}
    return dict_list_map_inplace(  # type: ignore[no-any-return]
        lambda x: values[id(x)] if isinstance(x, ShardedObject) else x, sharded_state_dict
    )


def remove_sharded_tensors(checkpoint_dir: LocationLike, key_prefix: str) -> None:
    """Delete every stored tensor whose key starts with ``key_prefix`` (one process calls it)."""
    location = resolve_location(checkpoint_dir)
    sharded, _ = verify_checkpoint_and_load_strategy(location)
    sharded.remove_sharded_tensors(location, key_prefix)


__all__ = [
    "load_common_state_dict",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_sharded_objects",
    "load_tensors_metadata",
    "remove_sharded_tensors",
]
