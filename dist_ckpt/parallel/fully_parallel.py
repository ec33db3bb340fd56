"""Spread the saving and loading of replicated shards over all their replicas.

Save: a plain save writes each shard from its main replica (``replica_id`` 0), so with data
parallelism the ranks of DP replica 0 write everything while the other replicas idle.
[`FullyParallelSaveStrategyWrapper`][dist_ckpt.parallel.fully_parallel.FullyParallelSaveStrategyWrapper] chooses, for
every shard whose main replica lies in the parallelization group, which holder writes it -- balancing bytes over the
group -- makes that rank's copy the main replica and every other copy a replica, and calls the wrapped
strategy. The checkpoint has the same contents as a plain save. Replicas must hold identical
data, as data-parallel replicas do: any of them may be the one written.

Load: [`FullyParallelLoadStrategyWrapper`][dist_ckpt.parallel.fully_parallel.FullyParallelLoadStrategyWrapper] has each
shard requested by several ranks of the group read by one of them (balancing bytes) and broadcast to the others
(`exchange`).

Both wrap any sharded strategy. Public names follow Megatron-Core's ``fully_parallel`` module.

Example:

```python
save_strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(), dp_group)
dc.save(sd, "ckpt", sharded_strategy=save_strategy)
zarr_loader = dc.get_default_strategy(StrategyAction.LOAD_SHARDED, "zarr", 1)
load_strategy = FullyParallelLoadStrategyWrapper(zarr_loader, dp_group)
state = dc.load(request, "ckpt", sharded_strategy=load_strategy)
```
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections import defaultdict
from dataclasses import replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from dist_ckpt.asynchronous.queue import AsyncRequest
from dist_ckpt.backends.base import AsyncSaveShardedStrategy, LoadShardedStrategy, SaveShardedStrategy
from dist_ckpt.collectives.distributed import ProcessGroup, all_gather_json, get_rank, run_collectively
from dist_ckpt.errors import IncompatibleStrategyError
from dist_ckpt.model.dict_utils import dict_list_map_outplace, nested_values
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from dist_ckpt.parallel.exchange import (
    DEFAULT_BUCKET_BYTES,
    ExchangeHooks,
    GroupRequests,
    ShardId,
    agree_on_group,
    balanced_owners,
    distribute_shards_to_ranks,
    load_with_exchange,
    shard_id,
    shard_nbytes,
)
from dist_ckpt.storage import Storage

__all__ = ["FullyParallelLoadStrategyWrapper", "FullyParallelSaveStrategyWrapper", "distribute_main_replicas"]

logger = logging.getLogger(__name__)

#: one rank's saveable copy of a shard, as exchanged: (shard id, bytes, is it the main replica)
HeldShard = Tuple[ShardId, int, bool]


def distribute_main_replicas(gathered: Sequence[Sequence[HeldShard]]) -> Dict[ShardId, int]:
    """Which rank of the group writes each shard (pure, deterministic).

    ``gathered[r]`` lists the shards group rank ``r`` holds with data. Only shards whose main
    replica is in the group are distributed (a shard mainly held elsewhere is written there);
    each goes to one of its holders, balancing bytes (`distribute_shards_to_ranks()`).

    Example:

    ```python
    distribute_main_replicas([[("a", 8, True), ("b", 8, True)], [("a", 8, False), ("b", 8, False)]])
    # {'a': 0, 'b': 1}
    ```
    """
    holders: Dict[ShardId, List[int]] = defaultdict(list)
    sizes: Dict[ShardId, int] = {}
    mains: Set[ShardId] = set()
    for rank, items in enumerate(gathered):
        for sid, size, main in items:
            holders[sid].append(rank)
            sizes[sid] = size
            if main:
                mains.add(sid)
    return distribute_shards_to_ranks({sid: holders[sid] for sid in mains}, sizes, len(gathered))


def _fingerprint(items: Any) -> str:
    return hashlib.sha256(json.dumps(items, separators=(",", ":")).encode()).hexdigest()


def _cache_valid(fingerprint: str, cached: Optional[str], group: Optional[ProcessGroup]) -> bool:
    """Collective over ``group``: whether every rank's input is unchanged since it was cached
    (all ranks must agree, or some would skip a collective the others enter)."""
    return all(all_gather_json(cached is not None and fingerprint == cached, group))


class FullyParallelSaveStrategyWrapper(AsyncSaveShardedStrategy):
    """Saves with ``strategy`` after spreading the writing of replicated shards over replicas.

    Steps of `save()` (collective):

    1. Check that the ranks' parallelization groups agree.
    2. Gather, within the group, which shards each rank holds with data (and whether as the
       main replica); choose each shard's writer
       ([`distribute_main_replicas()`][dist_ckpt.parallel.fully_parallel.distribute_main_replicas]).
    3. Rewrite the replica ids in a copy of the state dict: the writer's (first) copy becomes
       the main replica, every other copy a replica. The caller's objects are not modified.
    4. Save the copy with the wrapped strategy.

    Args:
        strategy: the sharded save strategy that writes.
        parallelization_group: the ranks among which writing is spread (None: every rank);
            usually the data-parallel group.
        do_cache_distribution: reuse the previous distribution when no rank's shards changed
            (one small collective to agree on that instead of the gather).
    """

    def __init__(
        self,
        strategy: SaveShardedStrategy,
        parallelization_group: Optional[ProcessGroup] = None,
        do_cache_distribution: bool = False,
    ) -> None:
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self._cached: Optional[Tuple[str, Dict[ShardId, int]]] = None

    @property  # a wrapper owns what its strategy owns
    def owned_paths(self) -> Tuple[str, ...]:  # type: ignore[override]
        return tuple(self.base_strategy.owned_paths)

    @property  # and writes its strategy's integrity records, under its reserved names
    def integrity_records(self) -> Tuple[str, ...]:  # type: ignore[override]
        return tuple(self.base_strategy.integrity_records)

    @property
    def reserved_names(self) -> Tuple[str, ...]:  # type: ignore[override]
        return tuple(self.base_strategy.reserved_names)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

    def check_location(self, checkpoint_dir: Storage) -> None:
        """The wrapped strategy decides."""
        self.base_strategy.check_location(checkpoint_dir)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> None:
        to_save = self.apply_saving_parallelization(sharded_state_dict)
        # 4. the wrapped strategy writes the new main replicas
        self.base_strategy.save(to_save, checkpoint_dir)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> AsyncRequest:
        """Steps 1-3 (collective), then the wrapped strategy's asynchronous save of the new main
        replicas (Megatron-Core's wrapper is async-capable too).

        Raises:
            IncompatibleStrategyError: the wrapped strategy cannot save asynchronously.
        """
        if not isinstance(self.base_strategy, AsyncSaveShardedStrategy):
            raise IncompatibleStrategyError(
                f"{self} cannot save asynchronously: {self.base_strategy} is not an AsyncSaveShardedStrategy"
            )
        return self.base_strategy.async_save(self.apply_saving_parallelization(sharded_state_dict), checkpoint_dir)

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> ShardedStateDict:
        """Steps 1-3 (collective): a copy of ``sharded_state_dict`` whose main replicas are the
        chosen writers."""
        group = self.parallelization_group
        # 1. groups
        run_collectively("checking the parallelization groups", lambda: agree_on_group(group, "parallelization groups"))

        # 2. who holds what; who writes what
        def held() -> List[HeldShard]:
            items: Dict[ShardId, HeldShard] = {}
            for sh in nested_values(sharded_state_dict):
                if isinstance(sh, ShardedTensor) and sh.data is not None:
                    sid = shard_id(sh)
                    old = items.get(sid)
                    items[sid] = (sid, shard_nbytes(sh), is_main_replica(sh.replica_id) or (old is not None and old[2]))
            return sorted(items.values())

        mine = run_collectively("indexing the shards to save", held)
        writer = self._writers(mine, group)

        # 3. rewrite replica ids on copies
        me = get_rank(group)
        claimed: Set[ShardId] = set()

        def rewrite(x: Any) -> Any:
            if not isinstance(x, ShardedTensor):
                return x
            sid = shard_id(x)
            if sid not in writer:
                return x  # main replica outside the group: written where it is
            main = writer[sid] == me and sid not in claimed and x.data is not None
            if main:
                claimed.add(sid)
            return replace(x, replica_id=0 if main else 1)

        return run_collectively("assigning writers", lambda: dict_list_map_outplace(rewrite, sharded_state_dict))

    def _writers(self, mine: List[HeldShard], group: Optional[ProcessGroup]) -> Dict[ShardId, int]:
        fingerprint = _fingerprint(mine)
        if self.do_cache_distribution and _cache_valid(fingerprint, self._cached[0] if self._cached else None, group):
            assert self._cached is not None
            return self._cached[1]
        gathered = [
            [(sid, int(size), bool(main)) for sid, size, main in items] for items in all_gather_json(mine, group)
        ]
        writer = run_collectively("distributing the writing", lambda: distribute_main_replicas(gathered))
        if self.do_cache_distribution:
            self._cached = (fingerprint, writer)
        return writer

    def __str__(self) -> str:
        return f"{self.__class__.__name__}({self.base_strategy})"


class _CachingHooks(ExchangeHooks):
    def __init__(self, wrapper: "FullyParallelLoadStrategyWrapper") -> None:
        self.wrapper = wrapper

    def gather(self, primaries: Mapping[ShardId, ShardedTensor], group: Optional[ProcessGroup]) -> GroupRequests:
        fingerprint = _fingerprint(sorted(primaries))
        cached = self.wrapper._cached
        if _cache_valid(fingerprint, cached[0] if cached else None, group):
            assert cached is not None
            return cached[1]
        requests = super().gather(primaries, group)
        self.wrapper._cached = (fingerprint, requests)
        return requests


class FullyParallelLoadStrategyWrapper(LoadShardedStrategy):
    """Loads with ``strategy``, each shard requested by several ranks of the group read once.

    Steps of `load()` (collective): check the groups agree, then
    `load_with_exchange()`: gather the group's requests,
    give each shard to one of the ranks requesting it (balancing bytes), read, broadcast.

    Args:
        strategy: the sharded load strategy that reads from storage.
        parallelization_group: the ranks that share reading (None: every rank).
        do_cache_distribution: reuse the previous requests of the group when no rank's
            request changed.
        bucket_bytes: upper bound of one broadcast of packed small shards.
    """

    def __init__(
        self,
        strategy: LoadShardedStrategy,
        parallelization_group: Optional[ProcessGroup] = None,
        do_cache_distribution: bool = False,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.bucket_bytes = bucket_bytes
        self._cached: Optional[Tuple[str, GroupRequests]] = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects

    def check_location(self, checkpoint_dir: Storage) -> None:
        """The wrapped strategy decides."""
        self.base_strategy.check_location(checkpoint_dir)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        self.base_strategy.check_version_compatibility(loaded_version)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> StateDict:
        group = self.parallelization_group
        run_collectively("checking the parallelization groups", lambda: agree_on_group(group, "parallelization groups"))
        hooks = _CachingHooks(self) if self.do_cache_distribution else None
        return load_with_exchange(
            sharded_state_dict, checkpoint_dir, self.base_strategy, group, balanced_owners, self.bucket_bytes, hooks
        )

    def with_dtype_cast(self, allow: bool) -> "FullyParallelLoadStrategyWrapper":
        """This wrapper around ``strategy.with_dtype_cast(allow)`` (the wrapped loader casts;
        the shards broadcast are already in the requested dtype)."""
        base = self.base_strategy.with_dtype_cast(allow)
        if base is self.base_strategy:
            return self
        clone = copy.copy(self)
        clone.base_strategy = base
        return clone

    def load_tensors_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)

    def __str__(self) -> str:
        return f"{self.__class__.__name__}({self.base_strategy})"
