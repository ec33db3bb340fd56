"""The checks every sharded loader makes before reading a byte.

A load request names keys with a dtype and a global shape; the checkpoint must hold each key in
a dtype the request may be cast from (`dist_ckpt.model.dtype_cast`: any dtype unless the
load sets ``allow_dtype_cast=False``), and with the same global shape unless
``allow_shape_mismatch`` is set. All problems are collected and raised at once, naming the keys,
the rank and the checkpoint; the casts a load will make are logged once, at INFO.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch

from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import (
    UNEXPECTED_KEYS,
    CheckpointingException,
    KeyMismatchError,
    LoadMismatchError,
    ShardedObjectLayoutError,
    format_keys,
    format_problems,
)
from dist_ckpt.model.dict_utils import dict_list_map_inplace, nested_values
from dist_ckpt.model.dtype_cast import cast_refusal, describe_cast
from dist_ckpt.model.sharded import ShardedObject, ShardedStateDict, ShardedTensor, StateDict

logger = logging.getLogger(__name__)

#: ``(dtype, global_shape)`` of a stored tensor, or None if the checkpoint lacks the key
StoredLookup = Callable[[str], Optional[Tuple[torch.dtype, Tuple[int, ...]]]]


def stored_mismatches(
    sh: ShardedTensor, dtype: torch.dtype, global_shape: Tuple[int, ...], allow_dtype_cast: bool = True
) -> List[str]:
    """Why ``sh`` cannot be loaded from a stored tensor of ``dtype`` and ``global_shape``."""
    problems = []
    refusal = cast_refusal(dtype, sh.dtype, allow_dtype_cast)
    if refusal is not None:
        problems.append(f"{sh.key!r} {refusal}")
    if len(sh.global_shape) != len(global_shape) or (sh.global_shape != global_shape and not sh.allow_shape_mismatch):
        problems.append(
            f"{sh.key!r} has global shape {global_shape} in the checkpoint, requested "
            f"{sh.global_shape} (set allow_shape_mismatch=True to pad or crop)"
        )
    return problems


def check_requested_tensors(
    requested: Sequence[ShardedTensor], lookup: StoredLookup, where: str, allow_dtype_cast: bool = True
) -> None:
    """Raise before any read if a requested tensor is absent or does not match what is stored;
    log (once, at INFO) the keys that will be cast from their stored dtype.

    Args:
        requested: this rank's requested shards.
        lookup: the stored ``(dtype, global_shape)`` of a key, None if absent.
        where: the checkpoint, as it should appear in messages.
        allow_dtype_cast: whether a requested dtype may differ from the stored one (see
            `cast_refusal()`).

    Raises:
        KeyMismatchError: keys requested but absent (Megatron-Core's "unexpected" keys).
        LoadMismatchError: dtype or global-shape mismatches, one line per key.
    """
    rank = get_rank()
    stored = {sh.key: lookup(sh.key) for sh in requested}
    absent = {key for key, found in stored.items() if found is None}
    if absent:
        raise KeyMismatchError(
            f"[rank {rank}] {UNEXPECTED_KEYS} (tensors requested by load but absent from checkpoint {where}): "
            f"{format_keys(absent)}",
            unexpected_keys=absent,
        )
    problems: List[str] = []
    casts: List[str] = []
    for sh in requested:
        found = stored[sh.key]
        assert found is not None
        problems.extend(p for p in stored_mismatches(sh, *found, allow_dtype_cast) if p not in problems)
        cast = describe_cast(sh.key, found[0], sh.dtype)
        if found[0] != sh.dtype and cast not in casts:
            casts.append(cast)
    if problems:
        raise LoadMismatchError(
            f"[rank {rank}] checkpoint {where} does not match the requested tensors: {format_problems(problems)}"
        )
    if casts:
        logger.info(
            "[rank %d] checkpoint %s: casting %d tensors to the requested dtype: %s",
            rank,
            where,
            len(casts),
            format_problems(casts, ", "),
        )


def object_layout_error(
    requested: ShardedObject, stored_shards: Iterable[str], where: str
) -> Optional[ShardedObjectLayoutError]:
    """The error for a ShardedObject shard that is not stored while other shards of its key are,
    when the stored ones belong to another grid (the object was saved at another TP/PP/DP layout);
    None when they belong to the requested grid (a shard of the saved layout is missing: damage).

    Args:
        requested: the shard ``load`` asked for.
        stored_shards: the stored shards of its key, by unique key (``key/shard_0.1_1.2``) or
            by the part after the key's ``/`` (``shard_0.1_1.2``).
        where: the checkpoint, as it should appear in messages.

    Example:

    ```python
    object_layout_error(ShardedObject("rng", None, (1,), (0,)), ["shard_0_2", "shard_1_2"], "'ckpt'")
    ```
    """
    grids = set()
    names = sorted(s.rpartition("/")[2] for s in stored_shards)
    for name in names:
        try:
            grids.add(ShardedObject.empty_from_unique_key(f"{requested.key}/{name}").global_shape)
        except CheckpointingException:
            continue  # not a shard name: says nothing about the layout
    if not grids or requested.global_shape in grids:
        return None
    saved = " or ".join(str(g) for g in sorted(grids))
    return ShardedObjectLayoutError(
        f"[rank {get_rank()}] ShardedObject {requested.key!r} was saved in checkpoint {where} as a grid of shape "
        f"{saved} (stored shards: {format_keys(names)}), and this load asks for shard {requested.global_offset} "
        f"of a grid of shape {requested.global_shape} ({requested.unique_key!r}). The checkpoint is not corrupt: "
        "ShardedObjects are opaque and are not resharded, so they load only in the layout (TP/PP/DP sizes) they "
        "were saved in. Drop this key from the state dict passed to load (re-seed an RNG state instead; "
        "Megatron-LM: --no-load-rng), or save it under a key that names its layout (the parallel sizes) and "
        "request it only where the layout is the same"
    )


def refuse_sharded_objects(sharded_objects_state_dict: ShardedStateDict, why: str) -> StateDict:
    """The loaders of checkpoints that hold no ShardedObjects (HF folders, plain DCP directories).

    Raises KeyMismatchError naming this rank and the requested objects' keys after ``why`` (which
    says which checkpoint and what it holds instead); with none requested, returns the state dict
    unchanged, as ``load_sharded_objects`` must.
    """
    requested = sorted({o.key for o in nested_values(sharded_objects_state_dict) if isinstance(o, ShardedObject)})
    if requested:
        raise KeyMismatchError(
            f"[rank {get_rank()}] {why}; ShardedObjects requested: {format_keys(requested)}", unexpected_keys=requested
        )
    return dict_list_map_inplace(lambda x: x, sharded_objects_state_dict)  # type: ignore[no-any-return]
