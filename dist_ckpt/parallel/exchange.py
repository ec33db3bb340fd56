"""Read each requested shard once per group of ranks, then broadcast it to the others.

When several ranks of a group (the data-parallel replicas of a model) load the same shard,
reading it from storage once and sending it over the network is faster than every rank reading
it. This module is the machinery shared by [`two_stage`][dist_ckpt.parallel.two_stage] and
[`fully_parallel`][dist_ckpt.parallel.fully_parallel]:

* pure functions, tested without processes: a shard's identity (`shard_id()`), the choice
  of the rank that reads or writes each shard (`distribute_shards_to_ranks()`), the
  packing of shards into broadcast buckets (`plan_buckets()`), the consistency of the
  process groups the ranks pass (`check_group_consistency()`);
* `load_with_exchange()`, the collective load itself, in numbered steps.

Error discipline: data moves inside the group, but every success flag is exchanged over the
default group (every rank calls the strategy, whatever its group), so a failure anywhere
raises the same error on every rank. Nothing is broadcast before every reader has reported
success; a rank that fails while unpacking keeps taking part in the remaining broadcasts and
reports afterwards, so no rank is ever left waiting in a broadcast.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar

import torch

from dist_ckpt.backends.base import LoadShardedStrategy, load_destination
from dist_ckpt.collectives.distributed import (
    ProcessGroup,
    all_gather_json,
    broadcast_tensor,
    comm_device,
    get_rank,
    get_world_size,
    group_backend,
    group_ranks,
    raise_if_any_rank_failed,
    run_collectively,
)
from dist_ckpt.collectives.shard_metadata import dtype_from_token, dtype_token
from dist_ckpt.errors import CheckpointingException, ProcessGroupMismatchError
from dist_ckpt.model.dict_utils import dict_list_map_inplace, nested_values
from dist_ckpt.model.dtypes import align_up
from dist_ckpt.model.sharded import ShardedBase, ShardedStateDict, ShardedTensor, StateDict
from dist_ckpt.storage import Storage

logger = logging.getLogger(__name__)

#: a shard's identity: canonical JSON of everything that determines its loaded contents
ShardId = str
#: any hashable, sortable shard id (`distribute_shards_to_ranks()` takes Megatron-Core's too)
T = TypeVar("T")
#: shards of one source are packed into broadcasts of at most this many bytes. Small: larger
#: shards then travel alone, sent from and received into their own memory (no packing copy),
#: which measured faster than large buckets (benchmarks/bench_parallel.py); smaller shards are
#: still packed, so many tiny tensors do not cost one broadcast each
DEFAULT_BUCKET_BYTES = 4 << 20


def shard_id(sh: ShardedTensor) -> ShardId:
    """Identity of the data a ShardedTensor describes: two requests with the same id load the
    same bytes (key, dtype, global shape, offset, local shape, flattened range, padding)."""
    rng = sh.flattened_range
    return json.dumps(
        [
            sh.key,
            dtype_token(sh.dtype),
            list(sh.global_shape),
            list(sh.global_offset),
            list(sh.local_shape),
            sh.prepend_axis_num,
            None if rng is None else [rng.start, rng.stop],
            bool(sh.allow_shape_mismatch),
        ],
        separators=(",", ":"),
    )


def shard_from_id(sid: ShardId) -> ShardedTensor:
    """The ShardedTensor (without data, replica 0) that `shard_id()` describes."""
    key, dtype, global_shape, offset, local_shape, prepend, rng, allow = json.loads(sid)
    return ShardedTensor(
        key,
        None,
        dtype_from_token(dtype),
        tuple(local_shape),
        tuple(global_shape),
        tuple(offset),
        None,
        0,
        prepend,
        allow,
        None if rng is None else slice(rng[0], rng[1]),
    )


def shard_numel(sh: ShardedTensor) -> int:
    """Elements of the shard's data (of its flattened range, if any)."""
    if sh.flattened_range is not None:
        return int(sh.flattened_range.stop - sh.flattened_range.start)
    return math.prod(sh.local_shape)


def shard_nbytes(sh: ShardedTensor) -> int:
    """Bytes of the shard's data."""
    return shard_numel(sh) * sh.dtype.itemsize


def distribute_shards_to_ranks(
    shard_to_ranks: Mapping[T, Sequence[int]],
    shard_to_size: Mapping[T, int],
    num_ranks: int,
    cross_parallelization_group_loads: AbstractSet[T] = frozenset(),
) -> Dict[T, int]:
    """Pick, for every shard, the one rank (among those that hold or need it) that reads or
    writes it, so that the bytes per rank are balanced. Pure and deterministic: every rank
    computes the same answer from the same gathered metadata.

    Greedy: shards in ``cross_parallelization_group_loads`` (a load's shards whose main replica
    is in another group) go last, so that a load's distribution stays close to the save's; before
    them, shards with the fewest candidate ranks go first (they have the least choice), then
    larger before smaller, then by id; each goes to its candidate with the fewest bytes so far
    (the lowest rank on ties). Shard ids may be any sortable values (this module's JSON ids,
    Megatron-Core's tuples).

    Example:

    ```python
    distribute_shards_to_ranks({"a": [0, 1], "b": [0, 1], "c": [1]}, {"a": 4, "b": 4, "c": 4}, 2)
    # {'c': 1, 'a': 0, 'b': 0}
    ```

    Raises:
        CheckpointingException: a shard has no candidate, or a candidate is not in ``range(num_ranks)``.
    """
    load = [0] * num_ranks
    chosen: Dict[T, int] = {}
    order = sorted(
        shard_to_ranks,
        key=lambda s: (s in cross_parallelization_group_loads, len(set(shard_to_ranks[s])), -shard_to_size[s], s),
    )
    for sid in order:
        candidates = sorted(set(shard_to_ranks[sid]))
        if not candidates or candidates[0] < 0 or candidates[-1] >= num_ranks:
            raise CheckpointingException(
                f"shard {sid} has candidate ranks {candidates}; expected a non-empty subset of range({num_ranks})"
            )
        rank = min(candidates, key=lambda r: (load[r], r))
        chosen[sid] = rank
        load[rank] += shard_to_size[sid]
    return chosen


@dataclass(frozen=True)
class Bucket:
    """One broadcast: group rank ``src`` sends ``shards`` packed at byte ``offsets``."""

    src: int
    shards: Tuple[ShardId, ...]
    offsets: Tuple[int, ...]
    nbytes: int


def plan_buckets(
    owner: Mapping[ShardId, int],
    needers: Mapping[ShardId, Sequence[int]],
    sizes: Mapping[ShardId, int],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> List[Bucket]:
    """The broadcasts that deliver every shard from its owner to the other ranks needing it.

    Pure and deterministic. A shard needed by its owner alone moves nowhere. Shards of one
    owner are packed, ordered by id, into buckets of at most ``bucket_bytes`` (a larger shard
    travels alone, unpacked), which bounds the extra memory of a load to about one bucket and
    keeps the number of broadcasts small when there are many small tensors.
    """
    by_src: Dict[int, List[ShardId]] = defaultdict(list)
    for sid in sorted(owner):
        if len(set(needers[sid])) > 1:
            by_src[owner[sid]].append(sid)
    buckets: List[Bucket] = []
    for src in sorted(by_src):
        shards: List[ShardId] = []
        offsets: List[int] = []
        used = 0
        for sid in by_src[src]:
            size = sizes[sid]
            if shards and used + size > bucket_bytes:
                buckets.append(Bucket(src, tuple(shards), tuple(offsets), used))
                shards, offsets, used = [], [], 0
            offsets.append(used)
            shards.append(sid)
            used = align_up(used + size)  # the next shard's offset: any dtype can be viewed there
        if shards:
            buckets.append(Bucket(src, tuple(shards), tuple(offsets), used))
    return buckets


# --------------------------------------------------------------------------- process groups


def check_group_consistency(declared: Sequence[Any]) -> List[str]:
    """What is wrong with the groups the ranks passed (empty if nothing).

    ``declared[r]`` is the list of global ranks of the group that rank ``r`` passed, or a string
    saying why rank ``r`` could not list it. Consistent means: every rank is in its own group,
    and every member of a rank's group passed the same group.
    """
    problems: List[str] = []
    for r, members in enumerate(declared):
        if isinstance(members, str):
            problems.append(f"rank {r} passed an unusable group: {members}")
            continue
        if r not in members:
            problems.append(f"rank {r} passed group {list(members)}, which does not contain it")
        for m in members:
            if not 0 <= m < len(declared):
                problems.append(
                    f"rank {r} passed group {list(members)} with rank {m} outside the world of {len(declared)}"
                )
                continue
            other = declared[m]
            if m != r and not isinstance(other, str) and list(other) != list(members):
                problems.append(f"rank {r} passed group {list(members)} but its member rank {m} passed {list(other)}")
    return list(dict.fromkeys(problems))


def _members(group: Optional[ProcessGroup]) -> Any:
    try:
        return group_ranks(group)
    except Exception as e:  # noqa: BLE001 -- reported on every rank by agree_on_group
        return f"{type(e).__name__}: {e}"


def agree_on_group(group: Optional[ProcessGroup], what: str) -> List[Tuple[List[int], str]]:
    """Collective over the default group: every rank's ``(group members, group backend)``.

    Raises [`ProcessGroupMismatchError`][dist_ckpt.errors.ProcessGroupMismatchError] on every rank (each computes the
    same verdict from the same gathered lists) if the groups passed by the ranks do not partition consistently.
    Costs one all-gather of ``world x group size`` integers.
    """
    members = _members(group)
    backend = group_backend(group) if not isinstance(members, str) else "unknown"
    gathered = all_gather_json([members, backend])
    problems = check_group_consistency([m for m, _ in gathered])
    if problems:
        raise ProcessGroupMismatchError(
            f"[rank {get_rank()}] the {what} passed by the ranks do not agree: "
            + "; ".join(problems[:5])
            + (f"; ... and {len(problems) - 5} more" if len(problems) > 5 else "")
            + ". Every rank must pass its own group, created with the same members on every rank"
        )
    return [(list(m), str(b)) for m, b in gathered]


# --------------------------------------------------------------------------- the load


@dataclass
class GroupRequests:
    """What the ranks of a group request: who needs each shard (group ranks) and its size."""

    needers: Dict[ShardId, List[int]] = field(default_factory=dict)
    sizes: Dict[ShardId, int] = field(default_factory=dict)


def gather_requests(local: Mapping[ShardId, ShardedTensor], group: Optional[ProcessGroup]) -> GroupRequests:
    """Collective over ``group``: every rank's requested shard ids and sizes."""
    mine = [[sid, shard_nbytes(sh)] for sid, sh in sorted(local.items())]
    out = GroupRequests()
    for group_rank, items in enumerate(all_gather_json(mine, group)):
        for sid, size in items:
            out.needers.setdefault(sid, []).append(group_rank)
            out.sizes[sid] = int(size)
    return out


@dataclass
class ExchangePlan:
    """Who reads which shard, and the broadcasts that follow."""

    requests: GroupRequests
    owner: Dict[ShardId, int]
    buckets: List[Bucket]


Assign = Callable[[GroupRequests, int], Dict[ShardId, int]]


def balanced_owners(requests: GroupRequests, group_size: int) -> Dict[ShardId, int]:
    """Each shard is read by one of the ranks that need it, balancing bytes read per rank."""
    return distribute_shards_to_ranks(requests.needers, requests.sizes, group_size)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _pack(bucket: Bucket, tensors: Mapping[ShardId, torch.Tensor], device: torch.device) -> torch.Tensor:
    if len(bucket.shards) == 1:
        t = tensors[bucket.shards[0]]
        if t.is_contiguous() and t.device == device:
            return _as_bytes(t)  # sent from its own memory
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
    for sid, off in zip(bucket.shards, bucket.offsets):
        t = tensors[sid]
        n = t.numel() * t.element_size()
        buf[off : off + n].copy_(_as_bytes(t.contiguous()))
    return buf


def _receive_buffer(
    bucket: Bucket, dests: Mapping[ShardId, torch.Tensor], device: torch.device
) -> Tuple[torch.Tensor, bool]:
    """The buffer to receive ``bucket`` into, and whether it is the destination itself."""
    if len(bucket.shards) == 1 and bucket.shards[0] in dests:
        t = dests[bucket.shards[0]]
        if t.is_contiguous() and t.device == device:
            return _as_bytes(t), True
    return torch.empty(bucket.nbytes, dtype=torch.uint8, device=device), False


def _unpack(bucket: Bucket, buf: torch.Tensor, dests: Mapping[ShardId, torch.Tensor]) -> None:
    for sid, off in zip(bucket.shards, bucket.offsets):
        t = dests.get(sid)
        if t is None:
            continue  # another rank of the group needs it
        n = t.numel() * t.element_size()
        t.copy_(buf[off : off + n].view(t.dtype).view(t.shape))


def exchange_shards(
    buckets: Sequence[Bucket],
    tensors: Mapping[ShardId, torch.Tensor],
    dests: Mapping[ShardId, torch.Tensor],
    group: Optional[ProcessGroup],
) -> Optional[BaseException]:
    """Run every broadcast of ``buckets`` (collective over ``group``, same buckets on every rank).

    ``tensors``: the shards this rank read (sent when it is a bucket's source); ``dests``: where
    this rank wants the shards it receives. Returns the first local error instead of raising, so
    that the rank still takes part in every later broadcast; the caller exchanges it.
    """
    me = get_rank(group)
    device = comm_device(group)
    error: Optional[BaseException] = None
    for bucket in buckets:
        first_key = json.loads(bucket.shards[0])[0]
        what = f"{len(bucket.shards)} shard(s) of {first_key!r} and others ({bucket.nbytes} bytes)"
        if me == bucket.src:
            try:
                buf = _pack(bucket, tensors, device)
            except Exception as e:  # noqa: BLE001 -- still send, so nobody waits; reported after
                error = error or e
                buf = torch.zeros(bucket.nbytes, dtype=torch.uint8, device=device)
            broadcast_tensor(buf, bucket.src, group, what)
        else:
            buf, in_place = _receive_buffer(bucket, dests, device)
            broadcast_tensor(buf, bucket.src, group, what)
            if error is None and not in_place:
                try:
                    _unpack(bucket, buf, dests)
                except Exception as e:  # noqa: BLE001 -- keep taking part; reported after
                    error = e
        del buf  # freed as we go: at most one bucket is alive
    return error


def load_with_exchange(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: Storage,
    base: LoadShardedStrategy,
    group: Optional[ProcessGroup],
    assign: Assign = balanced_owners,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    hooks: Optional["ExchangeHooks"] = None,
) -> StateDict:
    """Load ``sharded_state_dict`` with ``base``, each shard read by one rank of ``group``.

    Collective over the default group (every rank calls it; data moves inside each rank's
    ``group``). Steps:

    1. Index this rank's request: one primary ShardedTensor per shard id (a rank may request a
       shard under several state-dict keys), and its destination.
    2. Gather the group's requests; choose each shard's reader (``assign``, pure) and plan the
       broadcasts (`plan_buckets()`, pure).
    3. Every rank reads the shards it owns with ``base`` (all at once, so ``base`` can read
       them concurrently), into their destinations. Success flags are exchanged: nothing is
       broadcast unless every reader succeeded.
    4. Broadcast bucket by bucket; receivers unpack into their destinations and free the bucket.
    5. Copy shards requested twice; replace each ShardedTensor by its tensor.

    The five steps stay in one function (about 60 lines) because they share the failure protocol:
    every collective must be reached by every rank, which is easiest to check in one place.
    """
    hooks = hooks or ExchangeHooks()
    rank = get_rank()

    # 1. local index
    def index() -> Tuple[Dict[ShardId, ShardedTensor], List[ShardedBase]]:
        primaries: Dict[ShardId, ShardedTensor] = {}
        others: List[ShardedBase] = []
        for x in nested_values(sharded_state_dict):
            if isinstance(x, ShardedTensor):
                primaries.setdefault(shard_id(x), x)
            elif isinstance(x, ShardedBase):
                others.append(x)  # e.g. ShardedObjects of a base strategy that handles them
        return primaries, others

    primaries, others = run_collectively("indexing the load request", index)

    # 2. plan
    requests = hooks.gather(primaries, group)

    def plan() -> ExchangePlan:
        owner = assign(requests, get_world_size(group))
        return ExchangePlan(requests, owner, plan_buckets(owner, requests.needers, requests.sizes, bucket_bytes))

    exchange_plan = run_collectively("planning who reads which shard", plan)
    me = get_rank(group)
    mine = {sid: sh for sid, sh in primaries.items() if exchange_plan.owner[sid] == me}

    # 3. read what this rank owns
    def read() -> Dict[ShardId, Any]:
        return hooks.read(mine, others, checkpoint_dir, base)

    loaded = run_collectively("reading owned shards from storage", read)
    tensors: Dict[ShardId, torch.Tensor] = {sid: loaded[sid] for sid in mine}

    # 4. exchange
    dests = {sid: load_destination(sh) for sid, sh in primaries.items() if sid not in mine}
    error = hooks.exchange(exchange_plan.buckets, tensors, dests, group)
    raise_if_any_rank_failed(error, "exchanging loaded shards", None)

    # 5. results
    results: Dict[ShardId, torch.Tensor] = {**dests, **tensors}
    object_values = {id(o): loaded[f"__object_{i}"] for i, o in enumerate(others)}

    def result_of(x: Any) -> Any:
        if isinstance(x, ShardedTensor):
            sid = shard_id(x)
            value = results[sid]
            if x is primaries[sid]:
                return value
            dest = load_destination(x)
            dest.copy_(value)
            return dest
        if isinstance(x, ShardedBase):
            return object_values[id(x)]
        return x

    logger.debug(
        "rank %d: read %d of %d requested shards, %d broadcasts in the group",
        rank,
        len(mine),
        len(primaries),
        len(exchange_plan.buckets),
    )
    return dict_list_map_inplace(result_of, sharded_state_dict)  # type: ignore[no-any-return]


class ExchangeHooks:
    """The three steps of `load_with_exchange()` that touch data, overridable by wrappers
    that time them (two-stage) or count them (tests)."""

    def gather(self, primaries: Mapping[ShardId, ShardedTensor], group: Optional[ProcessGroup]) -> GroupRequests:
        return gather_requests(primaries, group)

    def read(
        self,
        mine: Mapping[ShardId, ShardedTensor],
        others: Sequence[ShardedBase],
        checkpoint_dir: Storage,
        base: LoadShardedStrategy,
    ) -> Dict[ShardId, Any]:
        """Load the owned shards (and any non-tensor shards) with ``base`` in one call."""
        request: Dict[str, Any] = dict(mine)
        request.update({f"__object_{i}": o for i, o in enumerate(others)})
        out: Dict[str, Any] = base.load(request, checkpoint_dir)
        return out

    def exchange(
        self,
        buckets: Sequence[Bucket],
        tensors: Mapping[ShardId, torch.Tensor],
        dests: Mapping[ShardId, torch.Tensor],
        group: Optional[ProcessGroup],
    ) -> Optional[BaseException]:
        return exchange_shards(buckets, tensors, dests, group)
