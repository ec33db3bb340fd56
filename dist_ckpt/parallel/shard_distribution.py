"""Megatron-Core's exchange API: a precomputed shard distribution and the exchange of loaded
tensors by it, over this package's collectives.

Megatron-Core's fully-parallel wrappers are built from these pieces, and code that customises
them calls them directly: `determine_main_replica_uniform_distribution()` decides, once per
state-dict structure, which rank of a parallelization group saves or loads each shard (a
[`ShardDistribution`][dist_ckpt.parallel.shard_distribution.ShardDistribution]);
`distribute_main_replicas_with_precomputed_distribution()` applies it to a save;
`exchange_by_distribution()` delivers the shards each rank loaded to the ranks that need them.
Shards are named by Megatron-Core's ids, ``(key, global_offset, (start, stop) or None)``
(`sharded_tensor_shard_id()`).

The machinery is `dist_ckpt.parallel.exchange`'s: the greedy
assignment (`distribute_shards_to_ranks()`), the packed broadcasts (`plan_buckets()`,
`exchange_shards()`) and its error protocol. Metadata travels as JSON and tensors as raw bytes,
never pickled; objects travel as ``torch.save`` bytes read back with ``weights_only=True``.

Example:

```python
distribution = determine_main_replica_uniform_distribution(sd, dp_group, ignore_groups=True)
loaded = {sid: t for sid, t in read_my_shards(distribution).items()}
everything = exchange_by_distribution(loaded, unloaded, distribution, dp_group, "broadcast")
```
"""

from __future__ import annotations

import io
import json
import struct
from collections import defaultdict
from itertools import zip_longest
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Set, Tuple

import torch

from dist_ckpt.backends.base import load_destination, loaded_shape
from dist_ckpt.collectives.distributed import (
    ProcessGroup,
    all_gather_bytes,
    all_gather_json,
    comm_device,
    get_rank,
    get_world_size,
    raise_if_any_rank_failed,
    run_collectively,
)
from dist_ckpt.errors import (
    ArgumentTypeError,
    CheckpointingException,
    ProcessGroupMismatchError,
    UnknownStrategyError,
    UnsafeObjectError,
)
from dist_ckpt.model.dict_utils import nested_values
from dist_ckpt.model.dtypes import dtype_from_name, dtype_to_name
from dist_ckpt.model.fp8 import dequantize_float8, is_float8tensor
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor, is_main_replica
from dist_ckpt.parallel.exchange import (
    Bucket,
    distribute_shards_to_ranks,
    exchange_shards,
    plan_buckets,
    shard_from_id,
    shard_id,
    shard_nbytes,
)

#: Megatron-Core's shard id: key, global offset and flattened range (None if not flattened)
MegatronShardId = Tuple[str, Tuple[int, ...], Optional[Tuple[int, int]]]

_PREPARING = "preparing the exchange of loaded tensors"

#: the algorithms of `exchange_by_distribution()`, by Megatron-Core's names
EXCHANGE_ALGORITHMS = ("broadcast", "gather_rounds", "gather_object")


def sharded_tensor_shard_id(sh: ShardedTensor) -> MegatronShardId:
    """Megatron-Core's id of the data ``sh`` describes: equal on every rank holding a replica."""
    rng = sh.flattened_range
    return (sh.key, tuple(sh.global_offset), None if rng is None else (int(rng.start), int(rng.stop)))


class ShardDistribution(NamedTuple):
    """Which rank of a parallelization group saves or loads each shard (the group is implicit).

    Attributes:
        main_rank_for_shard: the group rank that saves (or loads) each shard.
        shards_in_this_group: the shards the group is responsible for.
        shard_to_metadata: each shard's ShardedTensor, without data.
        all_ranks_for_shard: the group ranks that hold (or request) each shard.
    """

    main_rank_for_shard: Dict[MegatronShardId, int]
    shards_in_this_group: Set[MegatronShardId]
    shard_to_metadata: Dict[MegatronShardId, ShardedTensor]
    all_ranks_for_shard: Dict[MegatronShardId, List[int]]


def determine_main_replica_uniform_distribution(
    sharded_state_dict: ShardedStateDict, parallelization_group: Optional[ProcessGroup], ignore_groups: bool = False
) -> Optional[ShardDistribution]:
    """Collective over ``parallelization_group`` (None: every rank): which rank saves or loads
    each shard, balancing bytes; None for a group of one rank.

    Each rank sends its ShardedTensors' descriptions once (compact JSON); every rank then
    computes the same distribution (`distribute_shards_to_ranks()`). The group is responsible
    for the shards whose main replica it holds; with ``ignore_groups`` (for loads) also for the
    shards it holds only replicas of, which then go last so that a load's choice stays close to
    the save's.

    Example:

    ```python
    distribution = determine_main_replica_uniform_distribution(sd, dp_group)
    distribute_main_replicas_with_precomputed_distribution(sd, dp_group, distribution)
    ```
    """
    group_size = get_world_size(parallelization_group)
    if group_size <= 1:
        return None

    def describe() -> List[Tuple[str, bool]]:
        shards = [sh for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)]
        return sorted({(shard_id(sh), is_main_replica(sh.replica_id)) for sh in shards})

    mine = run_collectively("describing the shards to distribute", describe, parallelization_group)
    ranks_for: Dict[MegatronShardId, List[int]] = defaultdict(list)
    sizes: Dict[MegatronShardId, int] = {}
    metadata: Dict[MegatronShardId, ShardedTensor] = {}
    with_main: Set[MegatronShardId] = set()
    with_replica: Set[MegatronShardId] = set()
    for rank, items in enumerate(all_gather_json(mine, parallelization_group)):
        for sid, main in items:
            sh = shard_from_id(sid)
            mid = sharded_tensor_shard_id(sh)
            if rank not in ranks_for[mid]:
                ranks_for[mid].append(rank)
            if mid not in metadata:
                metadata[mid], sizes[mid] = sh, shard_nbytes(sh)
            (with_main if main else with_replica).add(mid)
    in_group = with_main | with_replica if ignore_groups else set(with_main)
    ranks_for = {mid: ranks for mid, ranks in ranks_for.items() if mid in in_group}
    main_rank = distribute_shards_to_ranks(ranks_for, sizes, group_size, in_group - with_main)
    return ShardDistribution(main_rank, in_group, metadata, ranks_for)


def distribute_main_replicas_with_precomputed_distribution(
    sharded_state_dict: ShardedStateDict,
    parallelization_group: Optional[ProcessGroup],
    precomputed_distribution: Optional[ShardDistribution],
) -> None:
    """Apply a save distribution in place: each ShardedTensor this rank saves by
    ``precomputed_distribution`` gets ``replica_id`` 0, every other one 1. Not collective.

    For three ranks holding replicas of A, B and C, the distribution makes rank 0 save A,
    rank 1 B and rank 2 C: afterwards A is ``0`` on rank 0 and ``1`` on ranks 1 and 2, and so on.
    Nothing changes in a group of one rank.

    Raises:
        ProcessGroupMismatchError: no distribution for a group of several ranks, or a shard of
            the group that the distribution does not assign (it was computed for another state
            dict or group).
    """
    if get_world_size(parallelization_group) <= 1:
        return
    rank = get_rank(parallelization_group)
    if precomputed_distribution is None:
        raise ProcessGroupMismatchError(
            f"[rank {get_rank()}] precomputed_distribution is None for a parallelization group of "
            f"{get_world_size(parallelization_group)} ranks; compute it with "
            "determine_main_replica_uniform_distribution"
        )
    for sh in nested_values(sharded_state_dict):
        if not isinstance(sh, ShardedTensor):
            continue
        mid = sharded_tensor_shard_id(sh)
        if mid not in precomputed_distribution.shards_in_this_group:
            sh.replica_id = 1
            continue
        if mid not in precomputed_distribution.main_rank_for_shard:
            raise ProcessGroupMismatchError(
                f"[rank {get_rank()}] shard {mid} of key {sh.key!r} is in the group but the distribution assigns it to "
                f"no rank; it was computed for another state dict or group"
            )
        sh.replica_id = 0 if precomputed_distribution.main_rank_for_shard[mid] == rank else 1


# --------------------------------------------------------------------------- exchanges


def _nominal(t: torch.Tensor) -> torch.Tensor:
    """The tensor to send: a Transformer Engine Float8Tensor as its nominal dtype."""
    return dequantize_float8(t) if is_float8tensor(t) else t


def _check_loaded(loaded: Mapping[MegatronShardId, torch.Tensor], distribution: ShardDistribution, rank: int) -> None:
    for mid, owner in distribution.main_rank_for_shard.items():
        if owner == rank and len(distribution.all_ranks_for_shard.get(mid, ())) > 1 and mid not in loaded:
            raise CheckpointingException(
                f"[rank {get_rank()}] the distribution has this rank load shard {mid} for "
                f"{distribution.all_ranks_for_shard[mid]}, but it is not in loaded_tensors"
            )


def empty_tensor_for_exchange(
    shard_id: MegatronShardId,
    needed_shards: Mapping[MegatronShardId, ShardedTensor],
    unneeded_shards: Mapping[MegatronShardId, ShardedTensor],
    loaded_tensors: Dict[MegatronShardId, torch.Tensor],
) -> Tuple[torch.Tensor, Optional[torch.device]]:
    """A tensor to receive shard ``shard_id`` into, on the default group's `comm_device()`, and
    the device the result belongs on (None when this rank does not need the shard).

    A shard this rank needs is received into its own memory when that already lives on the
    communication device (`load_destination()`), and is recorded in ``loaded_tensors``; one it
    does not need gets a scratch tensor from ``unneeded_shards``' metadata, dropped afterwards.
    Megatron-Core's ``_get_empty_tensor_for_exchange``, for code that writes its own exchange.

    Raises:
        KeyError: ``shard_id`` is in neither mapping.
    """
    device = comm_device()
    needed = needed_shards.get(shard_id)
    if needed is None:
        meta = unneeded_shards[shard_id]
        return torch.empty(loaded_shape(meta), dtype=meta.dtype, device=device), None
    dest = load_destination(needed)
    tensor = dest if dest.device == device else torch.empty_like(dest, device=device)
    loaded_tensors[shard_id] = tensor
    return tensor, dest.device


def exchange_loaded_tensors_broadcast(
    loaded_tensors: Dict[MegatronShardId, torch.Tensor],
    unloaded_shards: Dict[MegatronShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Optional[ProcessGroup] = None,
) -> Dict[MegatronShardId, torch.Tensor]:
    """Collective over the group: deliver every shard needed by several ranks from the rank that
    loaded it, by broadcasts (small shards packed together, `plan_buckets()`).

    Returns ``loaded_tensors`` plus a tensor for every shard of ``unloaded_shards`` (received
    into the ShardedTensor's own data when it has the right shape, as a load does). A failure on
    any rank raises the same error on every rank, after every broadcast was still taken part in.
    """
    rank = get_rank(parallelization_group)
    meta = shard_distribution.shard_to_metadata
    ours = {mid: shard_id(meta[mid]) for mid in shard_distribution.main_rank_for_shard}

    def prepare() -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
        _check_loaded(loaded_tensors, shard_distribution, rank)
        tensors = {ours[mid]: _nominal(t) for mid, t in loaded_tensors.items() if mid in ours}
        dests = {ours[mid]: load_destination(sh) for mid, sh in unloaded_shards.items() if mid in ours}
        return tensors, dests

    tensors, dests = run_collectively(_PREPARING, prepare, parallelization_group)
    owner = {ours[mid]: r for mid, r in shard_distribution.main_rank_for_shard.items()}
    needers = {ours[mid]: shard_distribution.all_ranks_for_shard[mid] for mid in shard_distribution.main_rank_for_shard}
    sizes = {sid: shard_nbytes(shard_from_id(sid)) for sid in owner}
    buckets: List[Bucket] = plan_buckets(owner, needers, sizes)
    error = exchange_shards(buckets, tensors, dests, parallelization_group)
    raise_if_any_rank_failed(error, "exchanging loaded tensors", parallelization_group)
    by_ours = {sid: mid for mid, sid in ours.items()}
    out = dict(loaded_tensors)
    out.update({by_ours[sid]: t for sid, t in dests.items()})
    return out


def _encode_tensors(tensors: Mapping[MegatronShardId, torch.Tensor]) -> bytes:
    """A JSON header (ids, dtypes, shapes, byte lengths) and the tensors' raw bytes."""
    header = []
    parts = []
    for mid, t in tensors.items():
        t = _nominal(t).detach().contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        header.append(
            [
                mid[0],
                list(mid[1]),
                None if mid[2] is None else list(mid[2]),
                dtype_to_name(t.dtype),
                list(t.shape),
                len(raw),
            ]
        )
        parts.append(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(head)) + head + b"".join(parts)


def _decode_tensors(data: bytes) -> Dict[MegatronShardId, torch.Tensor]:
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + n])
    pos = 8 + n
    out: Dict[MegatronShardId, torch.Tensor] = {}
    for key, offset, rng, dtype, shape, length in header:
        buf = (
            torch.frombuffer(bytearray(data[pos : pos + length]), dtype=torch.uint8)
            if length
            else torch.empty(0, dtype=torch.uint8)
        )
        out[(key, tuple(offset), None if rng is None else (rng[0], rng[1]))] = buf.view(dtype_from_name(dtype)).reshape(
            shape
        )
        pos += length
    return out


def _merge_without_duplicates(parts: List[Dict[MegatronShardId, Any]], what: str) -> Dict[MegatronShardId, Any]:
    merged: Dict[MegatronShardId, Any] = {}
    duplicates: Dict[MegatronShardId, List[int]] = {}
    for rank, part in enumerate(parts):
        for mid, value in part.items():
            if mid in merged:
                duplicates.setdefault(mid, [r for r, p in enumerate(parts[:rank]) if mid in p]).append(rank)
            merged[mid] = value
    if duplicates:
        listing = "; ".join(f"{mid} by group ranks {ranks}" for mid, ranks in sorted(duplicates.items(), key=str)[:5])
        raise CheckpointingException(
            f"[rank {get_rank()}] duplicate shard ids {what} by different ranks: {listing}; each shard must be "
            f"loaded by one rank of the group"
        )
    return merged


def exchange_loaded_tensors_gather_object(
    loaded_tensors: Dict[MegatronShardId, torch.Tensor],
    unloaded_shards: Dict[MegatronShardId, ShardedTensor],
    shard_distribution: Optional[ShardDistribution],
    parallelization_group: Optional[ProcessGroup] = None,
) -> Dict[MegatronShardId, torch.Tensor]:
    """Collective over the group: every rank's loaded tensors on every rank, in one all-gather
    (simple, and memory-hungry: for debugging and small states).

    Returns the tensors loaded by every rank of the group (on the CPU, except this rank's own).

    Raises:
        CheckpointingException: a shard was loaded by two ranks (on every rank, naming them).
    """
    payload = run_collectively(_PREPARING, lambda: _encode_tensors(loaded_tensors), parallelization_group)
    gathered = all_gather_bytes(payload, parallelization_group)
    me = get_rank(parallelization_group)
    parts = [dict(loaded_tensors) if r == me else _decode_tensors(b) for r, b in enumerate(gathered)]
    return _merge_without_duplicates(parts, "loaded")


def exchange_loaded_objects_gather_object(loaded_objects: Dict[MegatronShardId, Any]) -> Dict[MegatronShardId, Any]:
    """Collective over every rank: every rank's loaded objects (ShardedObject values) on every
    rank, in one all-gather.

    The objects travel as ``torch.save`` bytes and are read with ``torch.load(weights_only=True)``,
    so no rank runs code from another's objects.

    Raises:
        UnsafeObjectError: an object needs pickle beyond tensors and plain containers.
        CheckpointingException: an object id was loaded by two ranks.
    """

    def encode() -> bytes:
        buf = io.BytesIO()
        named = {json.dumps([k, list(o), None if r is None else list(r)]): v for (k, o, r), v in loaded_objects.items()}
        torch.save(named, buf)
        return buf.getvalue()

    payload = run_collectively("preparing the exchange of loaded objects", encode)
    parts: List[Dict[MegatronShardId, Any]] = []
    for rank, data in enumerate(all_gather_bytes(payload)):
        try:
            decoded = torch.load(io.BytesIO(data), weights_only=True)
        except Exception as e:
            raise UnsafeObjectError(
                f"[rank {get_rank()}] the objects loaded by rank {rank} cannot be exchanged safely: {e}; only tensors "
                f"and plain containers travel with weights_only=True"
            ) from e
        part: Dict[MegatronShardId, Any] = {}
        for text, value in decoded.items():
            key, offset, rng = json.loads(text)
            part[(key, tuple(offset), None if rng is None else tuple(rng))] = value
        parts.append(part)
    return _merge_without_duplicates(parts, "of objects loaded")


def exchange_loaded_tensors_gather_rounds(
    loaded_tensors: Dict[MegatronShardId, torch.Tensor],
    unloaded_shards: Dict[MegatronShardId, ShardedTensor],
    shard_distribution: ShardDistribution,
    parallelization_group: Optional[ProcessGroup] = None,
) -> Dict[MegatronShardId, torch.Tensor]:
    """Collective over the group: deliver every shard needed by several ranks in rounds of
    all-gathers, each rank contributing its next loaded shard to each round.

    Returns ``loaded_tensors`` plus a tensor for every shard of ``unloaded_shards``, copied into
    the ShardedTensor's own data when it has the right shape. Fewer, larger collectives than
    `exchange_loaded_tensors_broadcast()` when every rank loads about as much.
    """
    me = get_rank(parallelization_group)
    size = get_world_size(parallelization_group)
    run_collectively(_PREPARING, lambda: _check_loaded(loaded_tensors, shard_distribution, me), parallelization_group)
    by_rank: List[List[MegatronShardId]] = [[] for _ in range(size)]
    for mid, owner in sorted(shard_distribution.main_rank_for_shard.items(), key=str):
        if len(shard_distribution.all_ranks_for_shard.get(mid, ())) > 1:
            by_rank[owner].append(mid)
    out = dict(loaded_tensors)
    error: Optional[BaseException] = None  # kept, not raised: every rank takes part in every round
    for round_ids in zip_longest(*by_rank):
        mine = round_ids[me]
        try:
            payload = _encode_tensors({mine: loaded_tensors[mine]} if mine is not None else {})
        except Exception as e:  # noqa: BLE001 -- still take part; reported after the rounds
            error, payload = error or e, _encode_tensors({})
        for r, data in enumerate(all_gather_bytes(payload, parallelization_group)):
            mid = round_ids[r]
            if error is not None or r == me or mid is None or mid not in unloaded_shards:
                continue
            try:
                dest = load_destination(unloaded_shards[mid])
                dest.copy_(_decode_tensors(data)[mid].reshape(dest.shape))
                out[mid] = dest
            except Exception as e:  # noqa: BLE001 -- still take part; reported after the rounds
                error = e
    raise_if_any_rank_failed(error, "exchanging loaded tensors in rounds", parallelization_group)
    return out


def exchange_by_distribution(
    loaded_tensors: Dict[MegatronShardId, torch.Tensor],
    unloaded_shards: Dict[MegatronShardId, ShardedTensor],
    shard_distribution: Optional[ShardDistribution],
    parallelization_group: Optional[ProcessGroup] = None,
    exchange_algo: str = "broadcast",
) -> Dict[MegatronShardId, torch.Tensor]:
    """Collective over the group: the exchange of loaded tensors by ``exchange_algo``
    (``"broadcast"``, ``"gather_rounds"`` or ``"gather_object"``; see `EXCHANGE_ALGORITHMS`).

    Raises:
        ArgumentTypeError: no distribution was given.
        UnknownStrategyError: an algorithm of another name.
    """
    if shard_distribution is None:
        raise ArgumentTypeError("exchange_by_distribution needs a ShardDistribution, got None")
    if exchange_algo == "broadcast":
        return exchange_loaded_tensors_broadcast(
            loaded_tensors, unloaded_shards, shard_distribution, parallelization_group
        )
    if exchange_algo == "gather_rounds":
        return exchange_loaded_tensors_gather_rounds(
            loaded_tensors, unloaded_shards, shard_distribution, parallelization_group
        )
    if exchange_algo == "gather_object":
        return exchange_loaded_tensors_gather_object(
            loaded_tensors, unloaded_shards, shard_distribution, parallelization_group
        )
    raise UnknownStrategyError(
        f"unknown exchange_algo {exchange_algo!r}; expected one of {', '.join(EXCHANGE_ALGORITHMS)}"
    )


__all__ = [
    "EXCHANGE_ALGORITHMS",
    "MegatronShardId",
    "ShardDistribution",
    "determine_main_replica_uniform_distribution",
    "distribute_main_replicas_with_precomputed_distribution",
    "empty_tensor_for_exchange",
    "exchange_by_distribution",
    "exchange_loaded_objects_gather_object",
    "exchange_loaded_tensors_broadcast",
    "exchange_loaded_tensors_gather_object",
    "exchange_loaded_tensors_gather_rounds",
    "sharded_tensor_shard_id",
]
