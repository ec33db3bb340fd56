"""``save``: the collective save of a sharded state dict, as numbered steps.

Every rank calls it together (or one process without a process group). The sharded state is
split into common and sharded parts, checked, written by the chosen strategies, and committed
by rank 0 writing ``metadata.json`` last, once every rank succeeded.

Example:

```python
import dist_ckpt as dc
sd = {"w": dc.ShardedTensor.from_rank_offsets("w", w_local, (0, tp_rank, tp_size)), "step": 10}
dc.save(sd, "ckpt/iter_10")
```
"""

from __future__ import annotations

import fnmatch
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Set, Tuple

from dist_ckpt.async_save.queue import AsyncRequest
from dist_ckpt.backends.base import AsyncSaveShardedStrategy, SaveCommonStrategy, SaveShardedStrategy
from dist_ckpt.engine.checks.common_state import validate_common_state_dict
from dist_ckpt.engine.checks.compatibility import validate_sharded_objects_handling
from dist_ckpt.engine.checks.sharding import gather_and_validate_sharding
from dist_ckpt.engine.commit import METADATA_FILENAME, CheckpointingConfig, save_config
from dist_ckpt.engine.distributed import broadcast_json, get_rank, get_world_size, run_collectively
from dist_ckpt.engine.monitor import StepMonitor, main_replica_bytes
from dist_ckpt.engine.registry import (
    DEFAULT_COMMON_BACKEND,
    DEFAULT_SHARDED_BACKEND,
    StrategyAction,
    StrategySpec,
    get_default_strategy,
    resolve_strategy,
)
from dist_ckpt.engine.report import CheckpointReport, Operation, ProgressCallback
from dist_ckpt.engine.steps import Step
from dist_ckpt.engine.watchdog import DEFAULT_WATCHDOG_TIMEOUT_S
from dist_ckpt.errors import CheckpointExistsError, IncompatibleStrategyError, InvalidShardedTensorError
from dist_ckpt.model.dict_utils import extract_matching_values, nested_values
from dist_ckpt.model.sharded import (
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    apply_factories,
    is_main_replica,
)
from dist_ckpt.model.state_dict_utils import extract_nonpersistent, extract_sharded_base
from dist_ckpt.storage import Storage, validate_key
from dist_ckpt.storage.location import LocationLike, resolve_location

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveResult:
    """What [`save_with_report()`][dist_ckpt.engine.save.save_with_report] returns, whether the save is synchronous or
    not.

    Attributes:
        report: seconds per phase, bytes written, files, throughput (see
            [`dist_ckpt.engine.report`][dist_ckpt.engine.report]). For an asynchronous save it is completed -- its last
            phases added, ``complete`` set -- when the request is finalized.
        async_request: the request to schedule for an asynchronous save, else None.
    """

    report: CheckpointReport
    async_request: Optional[AsyncRequest]


def get_default_save_sharded_strategy(
    backend: str = DEFAULT_SHARDED_BACKEND[0], version: int = DEFAULT_SHARDED_BACKEND[1]
) -> SaveShardedStrategy:
    """The registered save strategy for ``(backend, version)`` (the default backend if omitted)."""
    strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)
    assert isinstance(strategy, SaveShardedStrategy)
    return strategy


def get_default_save_common_strategy(
    backend: str = DEFAULT_COMMON_BACKEND[0], version: int = DEFAULT_COMMON_BACKEND[1]
) -> SaveCommonStrategy:
    """The registered common-state save strategy for ``(backend, version)``."""
    strategy = get_default_strategy(StrategyAction.SAVE_COMMON, backend, version)
    assert isinstance(strategy, SaveCommonStrategy)
    return strategy


def _owned_names(strategies: List[Any]) -> Set[str]:
    """The top-level names the strategies write; an entry may be a glob pattern (``__*.distcp``)."""
    return {name for s in strategies for name in getattr(s, "owned_paths", ())}


def _is_owned(name: str, owned: Set[str]) -> bool:
    return name in owned or any(fnmatch.fnmatchcase(name, pattern) for pattern in owned if "*" in pattern)


def _prepare_directory(checkpoint_dir: Storage, strategies: List[Any]) -> None:
    """On rank 0: create the directory, refuse a committed one, clear an interrupted save.

    A location holding ``metadata.json`` is refused; whatever lies under the strategies' owned
    names (``safetensors/``, ``common.pt``, ``objects/``, ...), left by a save that never
    committed, is deleted. Object stores have no directory to create.
    """
    if get_rank() != 0:
        return
    checkpoint_dir.make_dir()
    if checkpoint_dir.exists(METADATA_FILENAME):
        where = "directory" if checkpoint_dir.local_paths else "location"
        raise CheckpointExistsError(
            f"{checkpoint_dir.url!r} already holds a committed checkpoint ({METADATA_FILENAME}); "
            f"save to a new {where} or delete it first"
        )
    keys = {o.key for o in checkpoint_dir.list()}
    present = {k.split("/", 1)[0] for k in keys} | set(checkpoint_dir.list_dirs())  # empty directories too
    owned = _owned_names(strategies)
    leftovers = sorted(name for name in present if _is_owned(name, owned))
    if leftovers:
        logger.warning(
            "%s holds %s from an interrupted save (no %s); removing them before saving",
            checkpoint_dir.url,
            leftovers,
            METADATA_FILENAME,
        )
        for name in leftovers:
            if name in keys:
                checkpoint_dir.delete(name)
            checkpoint_dir.delete_prefix(name)


def _check_same_on_all_ranks(value: List[Any], what: str) -> None:
    reference = broadcast_json(value)
    if reference != value:
        raise InvalidShardedTensorError(
            f"[rank {get_rank()}] {what} differs from rank 0: {value} vs {reference}; every rank must pass the same"
        )


def _check_save_inputs(sharded_part: ShardedStateDict) -> List[ShardedBase]:
    rank = get_rank()
    local_metadata = []
    for sh in nested_values(sharded_part):
        if not isinstance(sh, ShardedBase):
            continue
        validate_key(sh.key, rank)
        if isinstance(sh, ShardedTensor) and sh.data is None and is_main_replica(sh.replica_id):
            raise InvalidShardedTensorError(f"[rank {rank}] main replica of {sh.key!r} has no data to save")
        local_metadata.append(sh.without_data())
    return local_metadata


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: LocationLike,
    sharded_strategy: StrategySpec = None,
    common_strategy: StrategySpec = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Optional[Callable[[StateDict], StateDict]] = None,
    *,
    progress: Optional[ProgressCallback] = None,
    watchdog_timeout_s: Optional[float] = DEFAULT_WATCHDOG_TIMEOUT_S,
) -> Optional[AsyncRequest]:
    """Save a sharded state dict (collective).

    Megatron-Core compatible; [`save_with_report()`][dist_ckpt.engine.save.save_with_report] does the same and also
    returns the save's report (which ``save`` logs at INFO on rank 0).

    Steps:

    1. Resolve the strategies; rank 0 prepares the directory (refusing a committed checkpoint).
    2. Apply factories, drop LocalNonPersistentObjects, split into sharded and common parts.
    3. Check keys; if ``validate_access_integrity``, check the sharding on rank 0 and warn if
       the common state differs between ranks.
    4. Save the common state (rank 0) and this rank's ShardedObjects.
    5. Save the sharded tensors (in the background if ``async_sharded_save``).
    6. Commit: once every rank succeeded, rank 0 writes ``metadata.json``.

    Each step ends with an error exchange, so a failure on any rank raises the same
    CheckpointingException on every rank, and no partial checkpoint is ever committed.

    Args:
        sharded_state_dict: the state to save; modified in place by factories.
        checkpoint_dir: target directory (created if missing; must not hold a checkpoint), an
            ``s3://bucket/prefix`` URL or an opened [`Storage`][dist_ckpt.storage.base.Storage].
        sharded_strategy: a SaveShardedStrategy, a ``(backend, version)`` tuple, or None for
            the default backend.
        common_strategy: a SaveCommonStrategy, a ``(backend, version)`` tuple, or None.
        validate_access_integrity: check that main replicas cover every tensor exactly once.
        async_sharded_save: return an AsyncRequest that performs steps 5 and 6 instead of doing
            them (needs an AsyncSaveShardedStrategy).
        preprocess_common_before_consistancy_check: applied to the common state before the
            cross-rank consistency check only (e.g. to drop entries expected to differ).
        progress: called with a [`ProgressEvent`][dist_ckpt.engine.report.ProgressEvent] as each step starts
            and ends (keyword only).
        watchdog_timeout_s: log a WARNING naming the rank and step when a step lasts longer
            than this (see [`dist_ckpt.engine.watchdog`][dist_ckpt.engine.watchdog]); None disables the watchdog
            (keyword only).

    Returns:
        None, or the AsyncRequest when ``async_sharded_save`` is set.
    """
    return save_with_report(
        sharded_state_dict,
        checkpoint_dir,
        sharded_strategy,
        common_strategy,
        validate_access_integrity,
        async_sharded_save,
        preprocess_common_before_consistancy_check,
        progress=progress,
        watchdog_timeout_s=watchdog_timeout_s,
    ).async_request


def save_with_report(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: LocationLike,
    sharded_strategy: StrategySpec = None,
    common_strategy: StrategySpec = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Optional[Callable[[StateDict], StateDict]] = None,
    *,
    progress: Optional[ProgressCallback] = None,
    watchdog_timeout_s: Optional[float] = DEFAULT_WATCHDOG_TIMEOUT_S,
) -> SaveResult:
    """Save like [`save()`][dist_ckpt.engine.save.save] and return a [`SaveResult`][dist_ckpt.engine.save.SaveResult]:
    the report and, for an asynchronous save, the request (collective; same arguments and steps as
    [`save()`][dist_ckpt.engine.save.save]).

    Example:

    ```python
    result = save_with_report(sd, "ckpt/iter_10", progress=lambda e: print(e.phase, e.done))
    print(result.report.summary())
    print(result.report.phase_seconds(Step.SAVE_SHARDED), result.report.gib_per_s)
    ```
    """
    phases = [Step.PREPARE_SAVE, Step.CHECK_STATE]
    phases += [Step.VALIDATE_SHARDING] if validate_access_integrity else []
    phases += [Step.SAVE_COMMON]
    phases += [Step.PREPARE_ASYNC, Step.FINALIZE_SHARDED] if async_sharded_save else [Step.SAVE_SHARDED]
    phases += [Step.COMMIT]
    location = run_collectively("opening the checkpoint location", lambda: resolve_location(checkpoint_dir))
    monitor = StepMonitor(Operation.SAVE, location, phases, progress, watchdog_timeout_s)
    with monitor:
        request, nbytes = _save_steps(
            monitor,
            sharded_state_dict,
            location,
            sharded_strategy,
            common_strategy,
            validate_access_integrity,
            async_sharded_save,
            preprocess_common_before_consistancy_check,
        )
    if request is None:
        return SaveResult(monitor.finish(nbytes), None)
    request.add_finalize_fn(lambda: monitor.finish(nbytes))  # completes the report after the commit
    return SaveResult(monitor.report, request)


def _save_steps(
    monitor: StepMonitor,
    sharded_state_dict: ShardedStateDict,
    location: Storage,
    sharded_strategy: StrategySpec,
    common_strategy: StrategySpec,
    validate_access_integrity: bool,
    async_sharded_save: bool,
    preprocess_common_before_consistancy_check: Optional[Callable[[StateDict], StateDict]],
) -> Tuple[Optional[AsyncRequest], int]:
    """The numbered steps of [`save()`][dist_ckpt.engine.save.save]; returns the async request (or None) and the bytes
    of this rank's main replicas.

    Long on purpose: the steps are nested functions run in order through ``monitor`` (which times each
    one and names it in errors), so the whole save reads top to bottom in one place.
    """

    # 1. strategies and directory
    def resolve() -> Tuple[SaveShardedStrategy, SaveCommonStrategy]:
        sharded = resolve_strategy(sharded_strategy, StrategyAction.SAVE_SHARDED, DEFAULT_SHARDED_BACKEND)
        common = resolve_strategy(common_strategy, StrategyAction.SAVE_COMMON, DEFAULT_COMMON_BACKEND)
        assert isinstance(sharded, SaveShardedStrategy) and isinstance(common, SaveCommonStrategy)
        if async_sharded_save and not isinstance(sharded, AsyncSaveShardedStrategy):
            raise IncompatibleStrategyError(f"async_sharded_save=True needs an AsyncSaveShardedStrategy, got {sharded}")
        sharded.check_location(location)
        common.check_location(location)
        _check_same_on_all_ranks([location.url, sharded.backend, sharded.version], "(checkpoint_dir, backend, version)")
        _prepare_directory(location, [sharded, common])
        return sharded, common

    sharded_strat, common_strat = monitor.run(Step.PREPARE_SAVE, resolve)

    # 2. split the state
    def split() -> Tuple[ShardedStateDict, StateDict, List[ShardedBase]]:
        apply_factories(sharded_state_dict)
        _, persistent = extract_nonpersistent(sharded_state_dict)
        sharded_part, common_part = extract_sharded_base(persistent)
        return sharded_part, common_part, _check_save_inputs(sharded_part)

    sharded_part, common_state_dict, local_metadata = monitor.run(Step.CHECK_STATE, split)
    nbytes = main_replica_bytes(sharded_part)

    # 3. validation
    def validate() -> None:
        gather_and_validate_sharding(local_metadata)
        to_compare = common_state_dict
        if preprocess_common_before_consistancy_check is not None:
            to_compare = preprocess_common_before_consistancy_check(common_state_dict)
        validate_common_state_dict(to_compare)

    if validate_access_integrity:
        monitor.run(Step.VALIDATE_SHARDING, validate)

    # 4. common state and ShardedObjects
    def save_common() -> ShardedStateDict:
        common_strat.save_common(common_state_dict, location)
        if sharded_strat.can_handle_sharded_objects:
            return sharded_part
        validate_sharded_objects_handling(sharded_strat, common_strat)
        objects, tensors = extract_matching_values(sharded_part, lambda v: isinstance(v, ShardedObject))
        common_strat.save_sharded_objects(objects, location)  # type: ignore[arg-type]
        return tensors  # type: ignore[return-value]

    to_save = monitor.run(Step.SAVE_COMMON, save_common)

    # 6. commit (run after step 5, directly or as the async request's finalization)
    def commit() -> None:
        config = CheckpointingConfig(
            sharded_strat.backend, sharded_strat.version, common_strat.backend, common_strat.version
        )
        monitor.run(Step.COMMIT, lambda: save_config(config, location, get_world_size()) if get_rank() == 0 else None)

    # 5. sharded tensors
    if async_sharded_save:
        assert isinstance(sharded_strat, AsyncSaveShardedStrategy)
        request = monitor.run(Step.PREPARE_ASYNC, lambda: sharded_strat.async_save(to_save, location))
        returned = time.perf_counter()
        strategy_finalization = list(request.finalize_fns)
        request.finalize_fns.clear()

        def finalize() -> None:  # later, collectively: timed, and watched by the watchdog again
            monitor.add_phase(Step.WRITE_IN_BACKGROUND, time.perf_counter() - returned)
            with monitor:
                monitor.run(Step.FINALIZE_SHARDED, lambda: [fn() for fn in strategy_finalization])
                commit()

        request.add_finalize_fn(finalize)
        return request, nbytes
    monitor.run(Step.SAVE_SHARDED, lambda: sharded_strat.save(to_save, location))
    commit()
    return None, nbytes


__all__ = [
    "SaveResult",
    "get_default_save_common_strategy",
    "get_default_save_sharded_strategy",
    "save",
    "save_with_report",
]
