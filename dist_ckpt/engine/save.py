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

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from dist_ckpt.asynchronous.queue import AsyncRequest
from dist_ckpt.backends.base import AsyncSaveShardedStrategy, SaveCommonStrategy, SaveShardedStrategy
from dist_ckpt.backends.registry import (
    DEFAULT_COMMON_BACKEND,
    DEFAULT_SHARDED_BACKEND,
    StrategyAction,
    StrategySpec,
    builtin_save_owned_paths,
    get_default_strategy,
    resolve_strategy,
)
from dist_ckpt.collectives.distributed import broadcast_json, get_rank, get_world_size, run_collectively
from dist_ckpt.collectives.peer_failures import is_transport_failure
from dist_ckpt.engine.checks.compatibility import validate_sharded_objects_handling
from dist_ckpt.engine.checks.save_checks import validate_save
from dist_ckpt.engine.monitor import StepMonitor, main_replica_bytes
from dist_ckpt.engine.preprocess import add_content_metadata
from dist_ckpt.engine.report import CheckpointReport, Operation, ProgressCallback
from dist_ckpt.engine.save_claim import SaveClaim, abandon_claim, check_claim, claim_location, release_claim
from dist_ckpt.engine.steps import Step
from dist_ckpt.engine.watchdog import DEFAULT_WATCHDOG_TIMEOUT_S
from dist_ckpt.errors import (
    CheckpointingException,
    IncompatibleStrategyError,
    InvalidKeyError,
    InvalidShardedTensorError,
)
from dist_ckpt.integrity.file_manifest import write_integrity_manifest
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
from dist_ckpt.record.commit import RECORD_FILENAME, CheckpointingConfig, new_save_id, save_config
from dist_ckpt.record.records import digest_records
from dist_ckpt.storage import Storage, encode_key, validate_key
from dist_ckpt.storage.host_memory import host_memory_budget
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


def _claim(location: Storage, strategies: List[Any], claims: List[SaveClaim]) -> None:
    """On rank 0: make this save the owner of ``location`` (see `dist_ckpt.engine.save_claim`);
    the claim is appended to ``claims``."""
    if get_rank() == 0:
        owned = _owned_names(strategies) | {RECORD_FILENAME}  # dist_ckpt.json: written at a Megatron-format commit
        claims.append(claim_location(location, sorted(owned), new_save_id(), builtin_save_owned_paths))


def _abandon(location: Storage, claims: List[SaveClaim], error: BaseException) -> None:
    """On rank 0, after a failed save: delete the files the save wrote (it owns them: its claim
    is still in place). Not after a peer rank died: a survivor may still be writing."""
    if claims and not is_transport_failure(error):
        abandon_claim(location, claims[0])


def _record_names(strategy: Any, action: StrategyAction) -> Set[str]:
    """The integrity records ``strategy`` may have written: those it declares, and those of the
    registered strategy of its format (a wrapper that does not declare them writes them too)."""
    names = set(getattr(strategy, "integrity_records", ()))
    try:
        registered = get_default_strategy(action, strategy.backend, strategy.version)
    except CheckpointingException:  # a format of its own: what it declares is all there is
        return names
    return names | set(getattr(registered, "integrity_records", ()))


def _check_same_on_all_ranks(value: List[Any], what: str) -> None:
    reference = broadcast_json(value)
    if reference != value:
        raise InvalidShardedTensorError(
            f"[rank {get_rank()}] {what} differs from rank 0: {value} vs {reference}; every rank must pass the same"
        )


def _check_save_inputs(
    sharded_part: ShardedStateDict, sharded: SaveShardedStrategy, common: SaveCommonStrategy
) -> List[ShardedBase]:
    """Keys valid and free, main replicas with data of their declared shape and dtype; returns the
    shards' metadata (no data)."""
    rank = get_rank()
    local_metadata = []
    objects_by = sharded if sharded.can_handle_sharded_objects else common
    for sh in nested_values(sharded_part):
        if not isinstance(sh, ShardedBase):
            continue
        validate_key(sh.key, rank)
        owner = objects_by if isinstance(sh, ShardedObject) else sharded
        reserved = getattr(owner, "reserved_names", ())
        if reserved and encode_key(sh.key) in reserved:
            raise InvalidKeyError(
                f"[rank {rank}] key {sh.key!r} is reserved: {owner} keeps its own records under that name "
                f"({', '.join(reserved)}); rename the {type(sh).__name__}"
            )
        if isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id):
            if sh.data is None:
                raise InvalidShardedTensorError(f"[rank {rank}] main replica of {sh.key!r} has no data to save")
            try:
                sh.validate_data()  # checked when built, but data may have been replaced since
            except InvalidShardedTensorError as e:
                raise InvalidShardedTensorError(f"[rank {rank}] {e}") from None
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
    content_metadata: Optional[Dict[str, Any]] = None,
    *,
    progress: Optional[ProgressCallback] = None,
    watchdog_timeout_s: Optional[float] = DEFAULT_WATCHDOG_TIMEOUT_S,
    host_memory_budget_bytes: Optional[int] = None,
    verify_integrity: bool = False,
) -> Optional[AsyncRequest]:
    """Save a sharded state dict (collective).

    Megatron-Core compatible; [`save_with_report()`][dist_ckpt.engine.save.save_with_report] does the same and also
    returns the save's report (which ``save`` logs at INFO on rank 0).

    Steps:

    1. Resolve the strategies; rank 0 claims the location (``save_in_progress.json``; see
       `dist_ckpt.engine.save_claim`): a committed checkpoint, another save in progress
       there, or entries this save would write that no save record explains are refused.
    2. Apply factories, drop LocalNonPersistentObjects, split into sharded and common parts
       (``content_metadata`` joins the common part).
    3. Check keys; if ``validate_access_integrity``, check the sharding on rank 0 and warn if
       the common state differs between ranks (one small all-reduce in all when both are
       unchanged since the last save: see `dist_ckpt.engine.checks.save_checks`).
    4. Save the common state (rank 0) and this rank's ShardedObjects.
    5. Save the sharded tensors (in the background if ``async_sharded_save``).
    6. Commit: once every rank succeeded, rank 0 checks the location is still its own, writes
       ``metadata.json`` (listing the integrity records the save wrote) and removes its claim.
    7. With ``verify_integrity``, Megatron-Core's ``integrity.json``: the SHA-256 of every file,
       each rank hashing a share (see `dist_ckpt.integrity.file_manifest`).

    Each step ends with an error exchange (step 3 exchanges its errors itself), so a failure on
    any rank raises the same CheckpointingException on every rank, and no partial checkpoint is
    ever committed; rank 0 then deletes what the save wrote (its claim proves they are its files).

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
        content_metadata: a dict describing the checkpoint's content, stored in the common state
            under ``"content_metadata"`` (Megatron-Core's key; a ``dp_cp_group`` entry, a process
            group, is left out) and read back with
            [`load_content_metadata()`][dist_ckpt.engine.preprocess.load_content_metadata].
        progress: called with a [`ProgressEvent`][dist_ckpt.engine.report.ProgressEvent] as each step starts
            and ends (keyword only).
        watchdog_timeout_s: log a WARNING naming the rank and step when a step lasts longer
            than this (see [`dist_ckpt.engine.watchdog`][dist_ckpt.engine.watchdog]); None disables the watchdog
            (keyword only).
        host_memory_budget_bytes: most extra host memory the save may hold at once -- the async
            snapshot, device-to-host staging -- (keyword only; None: the process's budget, see
            [`dist_ckpt.storage.host_memory`][dist_ckpt.storage.host_memory], else no bound). What an
            async save cannot snapshot within it is written before this returns.
        verify_integrity: write Megatron-Core's ``integrity.json`` after the commit (step 7), which
            ``load(..., verify_integrity=True)`` checks (keyword only).

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
        content_metadata,
        progress=progress,
        watchdog_timeout_s=watchdog_timeout_s,
        host_memory_budget_bytes=host_memory_budget_bytes,
        verify_integrity=verify_integrity,
    ).async_request


def save_with_report(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: LocationLike,
    sharded_strategy: StrategySpec = None,
    common_strategy: StrategySpec = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Optional[Callable[[StateDict], StateDict]] = None,
    content_metadata: Optional[Dict[str, Any]] = None,
    *,
    progress: Optional[ProgressCallback] = None,
    watchdog_timeout_s: Optional[float] = DEFAULT_WATCHDOG_TIMEOUT_S,
    host_memory_budget_bytes: Optional[int] = None,
    verify_integrity: bool = False,
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
    phases += [Step.WRITE_INTEGRITY] if verify_integrity else []
    location = run_collectively("opening the checkpoint location", lambda: resolve_location(checkpoint_dir))
    monitor = StepMonitor(Operation.SAVE, location, phases, progress, watchdog_timeout_s)
    claims: List[SaveClaim] = []  # rank 0's claim of the location, once made
    started = time.perf_counter()
    try:
        with monitor, host_memory_budget(host_memory_budget_bytes) as memory:
            request, nbytes = _save_steps(
                monitor,
                sharded_state_dict,
                location,
                claims,
                sharded_strategy,
                common_strategy,
                validate_access_integrity,
                async_sharded_save,
                preprocess_common_before_consistancy_check,
                content_metadata,
                verify_integrity,
            )
    except BaseException as e:
        _abandon(location, claims, e)
        raise
    monitor.report.host_memory_budget_bytes = memory.budget
    if request is None:
        return SaveResult(monitor.finish(nbytes), None)
    monitor.report.snapshot_nbytes = memory.snapshot_nbytes
    monitor.report.written_before_return_nbytes = memory.written_before_return_nbytes
    monitor.report.blocked_seconds = time.perf_counter() - started
    request.add_finalize_fn(lambda: monitor.finish(nbytes))  # completes the report after the commit
    return SaveResult(monitor.report, request)


def _save_steps(
    monitor: StepMonitor,
    sharded_state_dict: ShardedStateDict,
    location: Storage,
    claims: List[SaveClaim],
    sharded_strategy: StrategySpec,
    common_strategy: StrategySpec,
    validate_access_integrity: bool,
    async_sharded_save: bool,
    preprocess_common_before_consistancy_check: Optional[Callable[[StateDict], StateDict]],
    content_metadata: Optional[Dict[str, Any]],
    verify_integrity: bool = False,
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
        _claim(location, [sharded, common], claims)
        return sharded, common

    sharded_strat, common_strat = monitor.run(Step.PREPARE_SAVE, resolve)

    # 2. split the state
    def split() -> Tuple[ShardedStateDict, StateDict, List[ShardedBase]]:
        apply_factories(sharded_state_dict)
        _, persistent = extract_nonpersistent(sharded_state_dict)
        sharded_part, common_part = extract_sharded_base(persistent)
        add_content_metadata(common_part, content_metadata)
        return sharded_part, common_part, _check_save_inputs(sharded_part, sharded_strat, common_strat)

    sharded_part, common_state_dict, local_metadata = monitor.run(Step.CHECK_STATE, split)
    nbytes = main_replica_bytes(sharded_part)

    # 3. validation
    def validate() -> None:  # one all-reduce for an unchanged structure; raises on every rank or none
        validate_save(local_metadata, common_state_dict, preprocess_common_before_consistancy_check)

    if validate_access_integrity:
        monitor.run(Step.VALIDATE_SHARDING, validate, exchanges_errors=True)

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

        def write_metadata() -> None:
            if get_rank() == 0:
                claim = claims[0]
                check_claim(location, claim)  # still ours: nobody took the location over
                names = _record_names(sharded_strat, StrategyAction.SAVE_SHARDED)
                names |= _record_names(common_strat, StrategyAction.SAVE_COMMON)
                records = digest_records(location, names)
                save_config(config, location, get_world_size(), save_id=claim.save_id, records=records)
                release_claim(location, claim)

        monitor.run(Step.COMMIT, write_metadata)
        if verify_integrity:  # 7. after the commit, so that metadata.json is hashed too
            monitor.run(Step.WRITE_INTEGRITY, lambda: write_integrity_manifest(location), exchanges_errors=True)

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
        request.add_abort_fn(lambda error: _abandon(location, claims, error))
        return request, nbytes
    monitor.run(Step.SAVE_SHARDED, lambda: sharded_strat.save(to_save, location), bytes_total=nbytes)
    commit()
    return None, nbytes


__all__ = [
    "SaveResult",
    "get_default_save_common_strategy",
    "get_default_save_sharded_strategy",
    "save",
    "save_with_report",
]
