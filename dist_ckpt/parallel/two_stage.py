"""Two-stage loading: read each shard once per data-parallel group, broadcast it to the replicas.

The data-parallel replicas of a model request the same shards. Instead of every replica reading
everything from storage, each shard requested by several ranks of a data-parallel (DP) group is
read by one of them -- chosen so that the bytes read per rank are balanced -- and broadcast to
the others. It pays off when storage bandwidth per rank is the bottleneck and the network is
faster than the storage; with a small DP group the broadcasts can cost more than they save
(see ``benchmarks/bench_parallel.py``).

It wraps any sharded loader (by default the one registered for the checkpoint's backend), so
the checkpoint format does not matter. Public names follow Megatron-Core's ``two_stage``
module.

Example:

```python
strategy = TwoStageDataParallelLoadShardedStrategy(dp_group)
state = dc.load(request, "ckpt", sharded_strategy=strategy)
strategy.summarize_load_times()   # collective; logs min/mean/max per step
```
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, TypeVar

import torch

from dist_ckpt.backends.base import LoadShardedStrategy
from dist_ckpt.backends.registry import StrategyAction, get_default_strategy, registered_strategies
from dist_ckpt.collectives.distributed import ProcessGroup, all_gather_json, get_rank, new_group
from dist_ckpt.errors import IncompatibleStrategyError
from dist_ckpt.model.sharded import ShardedBase, ShardedStateDict, ShardedTensor, StateDict
from dist_ckpt.parallel.exchange import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    ExchangeHooks,
    GroupRequests,
    ShardId,
    agree_on_group,
    distribute_shards_to_ranks,
    load_with_exchange,
    shard_from_id,
    shard_id,
)
from dist_ckpt.record.commit import read_config
from dist_ckpt.storage import Storage

__all__ = ["TwoStageDataParallelLoadShardedStrategy", "sharded_tensor_chunk_id", "timed"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def timed(verbose: bool = True) -> Callable[[F], F]:
    """Decorate a method so each call's duration is recorded in ``self.timings[name]``.

    The timings belong to the strategy instance (no process-wide table);
    [`TwoStageDataParallelLoadShardedStrategy.summarize_load_times()`][dist_ckpt.parallel.two_stage.TwoStageDataParallelLoadShardedStrategy.summarize_load_times]
    reports them. With ``verbose`` every call is also logged at DEBUG.
    """

    def decorate(fn: F) -> F:
        name = fn.__name__

        @functools.wraps(fn)
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                took = time.perf_counter() - start
                self.timings[name].append(took)
                if verbose:
                    logger.debug("rank %d: %s took %.4fs", get_rank(), name, took)

        return wrapped  # type: ignore[return-value]

    return decorate


def sharded_tensor_chunk_id(sharded_tensor: ShardedTensor) -> ShardId:
    """The identity under which requests of the same chunk are deduplicated: the key and
    everything else that determines the loaded bytes (offset, shapes, flattened range, dtype)."""
    return shard_id(sharded_tensor)


@dataclass(frozen=True)
class _ShardedTensorMetadata:
    """One rank's request of one chunk, as exchanged in the data-parallel group."""

    global_rank: int
    sharded_tensor_no_data: ShardedTensor
    dist_group_rank: int
    nbytes: int


class _TimedHooks(ExchangeHooks):
    """Routes the data steps of the exchange through the strategy's timed methods."""

    def __init__(self, strategy: "TwoStageDataParallelLoadShardedStrategy") -> None:
        self.strategy = strategy

    def gather(self, primaries: Mapping[ShardId, ShardedTensor], group: Optional[ProcessGroup]) -> GroupRequests:
        return self.strategy.exchange_loaded_metadata(primaries, group)

    def read(
        self,
        mine: Mapping[ShardId, ShardedTensor],
        others: Sequence[ShardedBase],
        checkpoint_dir: Storage,
        base: LoadShardedStrategy,
    ) -> Dict[ShardId, Any]:
        return self.strategy.load_tensors_from_storage(mine, others, checkpoint_dir, base)

    def exchange(
        self,
        buckets: Sequence[Bucket],
        tensors: Mapping[ShardId, torch.Tensor],
        dests: Mapping[ShardId, torch.Tensor],
        group: Optional[ProcessGroup],
    ) -> Optional[BaseException]:
        return self.strategy.broadcast_chunks(buckets, tensors, dests, group)


class TwoStageDataParallelLoadShardedStrategy(LoadShardedStrategy):
    """Loads each chunk once per data-parallel group and broadcasts it to the other replicas.

    Steps of `load()` (collective over the default group; data moves inside each DP group):

    0. [`maybe_init_gloo_group()`][.maybe_init_gloo_group]: check that the ranks' DP groups agree; with
       ``cpu_transfer``, mirror DP groups of another backend (NCCL) with gloo groups, so
       broadcasts go through host memory.
    1. Exchange the requested chunks' metadata within the DP group.
    2. [`deduplicate_chunks()`][.deduplicate_chunks]: each chunk requested by the group is assigned to one rank
       that requested it, balancing bytes (pure, deterministic).
    3. Every rank reads its assigned chunks from storage with the base strategy, all at once
       and into their destinations; success flags are exchanged before any broadcast.
    4. Broadcast bucket by bucket, copy into place, free each bucket before the next.

    Memory: a reader loads into its own destination tensors (it needs the chunks anyway);
    receivers need one bucket (``bucket_bytes``) of extra memory at a time.

    Args:
        data_parallel_group: this rank's DP group (None: the default group).
        cpu_transfer: broadcast through gloo on the host even if the DP group uses another
            backend; otherwise the transfer device follows the group's backend (gloo: CPU).
        base_strategy: the loader that reads from storage; by default the one registered for
            the backend recorded in the checkpoint.
        bucket_bytes: upper bound of one broadcast of packed small chunks.
        allow_dtype_cast: applied to the loader that reads (``with_dtype_cast``); None leaves
            it as it is (the built-in loaders cast by default).
    """

    def __init__(
        self,
        data_parallel_group: Optional[ProcessGroup] = None,
        cpu_transfer: bool = True,
        *,
        base_strategy: Optional[LoadShardedStrategy] = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        allow_dtype_cast: Optional[bool] = None,
    ) -> None:
        self.data_parallel_group = data_parallel_group
        self.cpu_transfer = cpu_transfer
        self.base_strategy = base_strategy
        self.bucket_bytes = bucket_bytes
        self.allow_dtype_cast = allow_dtype_cast
        self.timings: Dict[str, List[float]] = defaultdict(list)
        self.global_rank = get_rank()
        self.dp_group_ranks: List[int] = []
        self.dp_group_rank = 0
        # the checkpoint's format, as the compatibility checks saw it (for the registered loader)
        self._loaded_backend: Optional[str] = None
        self._loaded_version: Optional[int] = None

    # ----------------------------------------------------------------- compatibility

    @property
    def can_handle_sharded_objects(self) -> bool:
        """The wrapped loader's answer: with no ``base_strategy``, that of the loader registered for
        the checkpoint's format once the compatibility checks have seen it (torch_dist keeps
        ShardedObjects with its tensors)."""
        if self.base_strategy is not None:
            return self.base_strategy.can_handle_sharded_objects
        if self._loaded_backend is None or self._loaded_version is None:
            return False
        registered = get_default_strategy(StrategyAction.LOAD_SHARDED, self._loaded_backend, self._loaded_version)
        return isinstance(registered, LoadShardedStrategy) and registered.can_handle_sharded_objects

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if self.base_strategy is not None:
            self.base_strategy.check_backend_compatibility(loaded_backend)
            return
        self._loaded_backend = loaded_backend
        if not any(
            k.action == StrategyAction.LOAD_SHARDED and k.backend == loaded_backend for k in registered_strategies()
        ):
            raise IncompatibleStrategyError(f"{self}: no loader is registered for backend {loaded_backend!r} to wrap")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if self.base_strategy is not None:
            self.base_strategy.check_version_compatibility(loaded_version)
        self._loaded_version = loaded_version
        # otherwise the registered loader of the checkpoint's (backend, version) is used

    def check_location(self, checkpoint_dir: Storage) -> None:
        """The wrapped loader decides (the registered one is checked when it is chosen)."""
        if self.base_strategy is not None:
            self.base_strategy.check_location(checkpoint_dir)

    def with_dtype_cast(self, allow: bool) -> "TwoStageDataParallelLoadShardedStrategy":
        """A copy of this strategy whose reading loader is configured with ``allow`` (the copy
        shares the timings, so [`summarize_load_times()`][..summarize_load_times] on either reports its loads)."""
        if self.allow_dtype_cast == allow:
            return self
        clone = copy.copy(self)
        clone.allow_dtype_cast = allow
        return clone

    def _base(self, checkpoint_dir: Storage) -> LoadShardedStrategy:
        if self.base_strategy is not None:
            if self.allow_dtype_cast is None:
                return self.base_strategy
            return self.base_strategy.with_dtype_cast(self.allow_dtype_cast)
        config = read_config(checkpoint_dir)
        base = get_default_strategy(StrategyAction.LOAD_SHARDED, config.sharded_backend, config.sharded_backend_version)
        if not isinstance(base, LoadShardedStrategy) or (
            isinstance(base, TwoStageDataParallelLoadShardedStrategy) and base.base_strategy is None
        ):
            raise IncompatibleStrategyError(
                f"{self} wraps the loader registered for ({config.sharded_backend!r}, "
                f"{config.sharded_backend_version}), which is {base}; pass base_strategy= explicitly"
            )
        base.check_backend_compatibility(config.sharded_backend)
        base.check_version_compatibility(config.sharded_backend_version)
        base.check_location(checkpoint_dir)
        return base if self.allow_dtype_cast is None else base.with_dtype_cast(self.allow_dtype_cast)

    # ----------------------------------------------------------------- the steps

    @timed()
    def maybe_init_gloo_group(self) -> None:
        """Step 0 (collective over the default group): check the DP groups; with
        ``cpu_transfer``, replace non-gloo DP groups by gloo groups of the same members."""
        declared = agree_on_group(self.data_parallel_group, "data-parallel groups")
        self.global_rank = get_rank()
        self.dp_group_ranks = declared[self.global_rank][0]
        if self.cpu_transfer:
            # decided from the gathered backends, so every rank creates the same groups in
            # the same order (new_group is collective over the default group)
            to_mirror = sorted({tuple(m) for m, backend in declared if backend not in ("gloo", "none")})
            for members in to_mirror:
                gloo_group = new_group(members, backend="gloo")
                if self.global_rank in members:
                    self.data_parallel_group = gloo_group
        self.dp_group_rank = get_rank(self.data_parallel_group)

    @timed()
    def exchange_loaded_metadata(
        self, primaries: Mapping[ShardId, ShardedTensor], group: Optional[ProcessGroup]
    ) -> GroupRequests:
        """Step 1: every DP rank's requested chunks (ids and sizes)."""
        return ExchangeHooks().gather(primaries, group)

    @timed()
    def deduplicate_chunks(self, ten_metas: List[_ShardedTensorMetadata]) -> Dict[ShardId, _ShardedTensorMetadata]:
        """Step 2 (pure): group the requests by chunk and pick, for each chunk, the request
        (hence the rank) that reads it, balancing bytes read across the DP group."""
        by_chunk: Dict[ShardId, List[_ShardedTensorMetadata]] = defaultdict(list)
        for meta in ten_metas:
            by_chunk[sharded_tensor_chunk_id(meta.sharded_tensor_no_data)].append(meta)
        group_size = 1 + max((m.dist_group_rank for m in ten_metas), default=0)
        reader = distribute_shards_to_ranks(
            {cid: [m.dist_group_rank for m in metas] for cid, metas in by_chunk.items()},
            {cid: metas[0].nbytes for cid, metas in by_chunk.items()},
            group_size,
        )
        return {cid: next(m for m in by_chunk[cid] if m.dist_group_rank == reader[cid]) for cid in by_chunk}

    def _assign(self, requests: GroupRequests, group_size: int) -> Dict[ShardId, int]:
        ranks = self.dp_group_ranks or list(range(group_size))
        metas = [
            _ShardedTensorMetadata(ranks[r], shard_from_id(sid), r, requests.sizes[sid])
            for sid, needers in requests.needers.items()
            for r in needers
        ]
        return {cid: meta.dist_group_rank for cid, meta in self.deduplicate_chunks(metas).items()}

    @timed()
    def load_tensors_from_storage(
        self,
        mine: Mapping[ShardId, ShardedTensor],
        others: Sequence[ShardedBase],
        checkpoint_dir: Storage,
        base: LoadShardedStrategy,
    ) -> Dict[ShardId, Any]:
        """Step 3: read this rank's assigned chunks (and any non-tensor shards) in one call to
        the base strategy, so that it can read them concurrently."""
        return ExchangeHooks().read(mine, others, checkpoint_dir, base)

    def load_tensor_from_storage(self, checkpoint_dir: Storage, ten_meta: _ShardedTensorMetadata) -> torch.Tensor:
        """Read one chunk from storage with the base strategy (a new tensor)."""
        sh = ten_meta.sharded_tensor_no_data.without_data()
        out = self.load_tensors_from_storage(
            {sharded_tensor_chunk_id(sh): sh}, [], checkpoint_dir, self._base(checkpoint_dir)
        )
        tensor: torch.Tensor = next(iter(out.values()))
        return tensor

    @timed()
    def broadcast_chunks(
        self,
        buckets: Sequence[Bucket],
        tensors: Mapping[ShardId, torch.Tensor],
        dests: Mapping[ShardId, torch.Tensor],
        group: Optional[ProcessGroup],
    ) -> Optional[BaseException]:
        """Step 4: the broadcasts within the DP group (errors are returned, then exchanged)."""
        return ExchangeHooks().exchange(buckets, tensors, dests, group)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> StateDict:
        base = self._base(checkpoint_dir)
        self.maybe_init_gloo_group()
        return load_with_exchange(
            sharded_state_dict,
            checkpoint_dir,
            base,
            self.data_parallel_group,
            self._assign,
            self.bucket_bytes,
            _TimedHooks(self),
        )

    def load_tensors_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        return self._base(checkpoint_dir).load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        return self._base(checkpoint_dir).load_sharded_metadata(checkpoint_dir)

    def summarize_load_times(self) -> Dict[str, Dict[str, float]]:
        """Collective over the default group: min, mean and max over ranks of the total time
        of each step; logged at INFO on rank 0 and returned on every rank."""
        mine = {name: sum(times) for name, times in sorted(self.timings.items())}
        gathered = all_gather_json(mine)
        summary: Dict[str, Dict[str, float]] = {}
        for name in sorted({n for per_rank in gathered for n in per_rank}):
            values = [per_rank.get(name, 0.0) for per_rank in gathered]
            summary[name] = {"min": min(values), "mean": sum(values) / len(values), "max": max(values)}
        if get_rank() == 0:
            lines = [
                f"{name:>28}: min {s['min']:.3f}s  mean {s['mean']:.3f}s  max {s['max']:.3f}s"
                for name, s in summary.items()
            ]
            logger.info("two-stage load times over %d ranks:\n%s", len(gathered), "\n".join(lines))
        return summary

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(base={self.base_strategy or 'registered loader'})"
