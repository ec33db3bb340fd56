"""Entry points for saving and loading distributed checkpoints.

``save`` and ``load`` are the distributed counterparts of ``torch.save`` / ``torch.load``: the
state dict's tensors are wrapped in :mod:`dist_ckpt.mapping` classes that say which part of a
global tensor each rank holds, and ``load`` takes such a sharded state dict as the description of
what to load, in whatever layout the loading job uses. Both are collective: every rank calls
them together (or a single process calls them without any process group).

Example::

    import dist_ckpt as dc
    sd = {"w": dc.ShardedTensor.from_rank_offsets("w", w_local, (0, tp_rank, tp_size)), "step": 10}
    dc.save(sd, "ckpt/iter_10")
    loaded = dc.load(sd_for_new_layout, "ckpt/iter_10")
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

from .core import METADATA_FILENAME, CheckpointingConfig, save_config
from .dict_utils import dict_list_map_inplace, extract_matching_values, merge, nested_values
from .distributed import broadcast_json, get_rank, get_world_size, run_collectively
from .errors import CheckpointExistsError, IncompatibleStrategyError, InvalidShardedTensorError
from .monitor import StepMonitor, main_replica_bytes, requested_bytes
from .mapping import (
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from .report import CheckpointReport, Operation, ProgressCallback
from .state_assembly import assemble, loaded_values
from .storage import Storage, validate_key
from .storage.location import CheckpointLocation, LocationLike, location_str, resolve_location
from .strategies.async_utils import AsyncRequest
from .strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    StrategySpec,
    get_default_strategy,
    resolve_strategy,
)
from .utils import extract_nonpersistent, extract_sharded_base
from .validation import (
    StrictHandling,
    gather_and_validate_sharding,
    parse_strict_flag,
    validate_common_state_dict,
    validate_integrity_and_strict_load,
    validate_sharded_objects_handling,
    validate_sharding_integrity,
    verify_checkpoint_and_load_strategy,
)
from .watchdog import DEFAULT_WATCHDOG_TIMEOUT_S

logger = logging.getLogger(__name__)

#: (backend, version) used by ``save`` when no sharded strategy is given
DEFAULT_SHARDED_BACKEND: Tuple[str, int] = ("safetensors", 1)
DEFAULT_COMMON_BACKEND: Tuple[str, int] = ("torch", 1)

__all__ = [
    "LoadResult",
    "SaveResult",
    "get_default_load_sharded_strategy",
    "get_default_save_common_strategy",
    "get_default_save_sharded_strategy",
    "load",
    "load_common_state_dict",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_sharded_objects",
    "load_tensors_metadata",
    "load_with_report",
    "remove_sharded_tensors",
    "save",
    "save_with_report",
    "validate_sharding_integrity",
]


@dataclass(frozen=True)
class LoadResult:
    """What :func:`load_with_report` returns, whatever the ``strict`` mode.

    Attributes:
        state_dict: the loaded state dict.
        missing_keys: keys in the checkpoint that no rank requested (found by ``*_ALL`` modes).
        unexpected_keys: keys this rank requested that the checkpoint lacks (skipped).
        report: seconds per phase, bytes read, files, throughput (see :mod:`dist_ckpt.report`).
    """

    state_dict: StateDict
    missing_keys: Set[str]
    unexpected_keys: Set[str]
    report: CheckpointReport


@dataclass(frozen=True)
class SaveResult:
    """What :func:`save_with_report` returns, whether the save is synchronous or not.

    Attributes:
        report: seconds per phase, bytes written, files, throughput (see
            :mod:`dist_ckpt.report`). For an asynchronous save it is completed -- its last
            phases added, ``complete`` set -- when the request is finalized.
        async_request: the request to schedule for an asynchronous save, else None.
    """

    report: CheckpointReport
    async_request: Optional[AsyncRequest]


def get_default_save_sharded_strategy(backend: str = DEFAULT_SHARDED_BACKEND[0], version: int = DEFAULT_SHARDED_BACKEND[1]) -> SaveShardedStrategy:
    """The registered save strategy for ``(backend, version)`` (the default backend if omitted)."""
    strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, backend, version)
    assert isinstance(strategy, SaveShardedStrategy)
    return strategy


def get_default_save_common_strategy(backend: str = DEFAULT_COMMON_BACKEND[0], version: int = DEFAULT_COMMON_BACKEND[1]) -> SaveCommonStrategy:
    """The registered common-state save strategy for ``(backend, version)``."""
    strategy = get_default_strategy(StrategyAction.SAVE_COMMON, backend, version)
    assert isinstance(strategy, SaveCommonStrategy)
    return strategy


def get_default_load_sharded_strategy(checkpoint_dir: LocationLike) -> LoadShardedStrategy:
    """The registered load strategy for the backend recorded in ``checkpoint_dir``."""
    return verify_checkpoint_and_load_strategy(checkpoint_dir)[0]


# --------------------------------------------------------------------------- save


def _owned_names(strategies: List[Any]) -> Set[str]:
    return {name for s in strategies for name in getattr(s, "owned_paths", ())}


def _prepare_directory(checkpoint_dir: CheckpointLocation, strategies: List[Any]) -> None:
    """On rank 0: create the directory, refuse a committed one, clear an interrupted save.

    On an object store there is no directory to create: a prefix holding ``metadata.json`` is
    refused, and objects under the strategies' owned names (``safetensors/``, ``common.pt``,
    ``objects/``, ...) left by a save that never committed are deleted.
    """
    if get_rank() != 0:
        return
    if not isinstance(checkpoint_dir, Path):
        _prepare_prefix(checkpoint_dir, strategies)
        return
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    if (checkpoint_dir / METADATA_FILENAME).exists():
        raise CheckpointExistsError(
            f"{str(checkpoint_dir)!r} already holds a committed checkpoint ({METADATA_FILENAME}); "
            f"save to a new directory or delete it first"
        )
    owned = _owned_names(strategies)
    leftovers = sorted(name for name in owned if (checkpoint_dir / name).exists())
    if leftovers:
        logger.warning(
            "%s holds %s from an interrupted save (no %s); removing them before saving",
            checkpoint_dir,
            leftovers,
            METADATA_FILENAME,
        )
        for name in leftovers:
            path = checkpoint_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _prepare_prefix(storage: Storage, strategies: List[Any]) -> None:
    """:func:`_prepare_directory` on an object store (rank 0)."""
    if storage.exists(METADATA_FILENAME):
        raise CheckpointExistsError(
            f"{storage.url!r} already holds a committed checkpoint ({METADATA_FILENAME}); "
            f"save to a new location or delete it first"
        )
    owned = _owned_names(strategies)
    leftovers = sorted({o.key for o in storage.list() if o.key.split("/", 1)[0] in owned})
    if leftovers:
        logger.warning(
            "%s holds %d objects under %s from an interrupted save (no %s); deleting them before saving",
            storage.url,
            len(leftovers),
            sorted({k.split("/", 1)[0] for k in leftovers}),
            METADATA_FILENAME,
        )
        for name in sorted({k.split("/", 1)[0] for k in leftovers}):
            if name in leftovers:
                storage.delete(name)
            storage.delete_prefix(name)


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

    Megatron-Core compatible; :func:`save_with_report` does the same and also returns the
    save's report (which ``save`` logs at INFO on rank 0).

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
            ``s3://bucket/prefix`` URL or an opened :class:`~dist_ckpt.storage.Storage`.
        sharded_strategy: a SaveShardedStrategy, a ``(backend, version)`` tuple, or None for
            the default backend.
        common_strategy: a SaveCommonStrategy, a ``(backend, version)`` tuple, or None.
        validate_access_integrity: check that main replicas cover every tensor exactly once.
        async_sharded_save: return an AsyncRequest that performs steps 5 and 6 instead of doing
            them (needs an AsyncSaveShardedStrategy).
        preprocess_common_before_consistancy_check: applied to the common state before the
            cross-rank consistency check only (e.g. to drop entries expected to differ).
        progress: called with a :class:`~dist_ckpt.report.ProgressEvent` as each step starts
            and ends (keyword only).
        watchdog_timeout_s: log a WARNING naming the rank and step when a step lasts longer
            than this (see :mod:`dist_ckpt.watchdog`); None disables the watchdog (keyword only).

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
    """Save like :func:`save` and return a :class:`SaveResult`: the report and, for an
    asynchronous save, the request (collective; same arguments and steps as :func:`save`).

    Example::

        result = save_with_report(sd, "ckpt/iter_10", progress=lambda e: print(e.phase, e.done))
        print(result.report.summary())
        print(result.report.phase_seconds("saving sharded tensors"), result.report.gib_per_s)
    """
    phases = ["preparing the save", "checking the state to save"]
    phases += ["validating the sharding"] if validate_access_integrity else []
    phases += ["saving the common state"]
    phases += ["preparing the async save", "finalizing the sharded tensors"] if async_sharded_save else ["saving sharded tensors"]
    phases += ["committing metadata.json"]
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
    location: CheckpointLocation,
    sharded_strategy: StrategySpec,
    common_strategy: StrategySpec,
    validate_access_integrity: bool,
    async_sharded_save: bool,
    preprocess_common_before_consistancy_check: Optional[Callable[[StateDict], StateDict]],
) -> Tuple[Optional[AsyncRequest], int]:
    """The numbered steps of :func:`save`; returns the async request (or None) and the bytes
    of this rank's main replicas."""

    # 1. strategies and directory
    def resolve() -> Tuple[SaveShardedStrategy, SaveCommonStrategy]:
        sharded = resolve_strategy(sharded_strategy, StrategyAction.SAVE_SHARDED, DEFAULT_SHARDED_BACKEND)
        common = resolve_strategy(common_strategy, StrategyAction.SAVE_COMMON, DEFAULT_COMMON_BACKEND)
        assert isinstance(sharded, SaveShardedStrategy) and isinstance(common, SaveCommonStrategy)
        if async_sharded_save and not isinstance(sharded, AsyncSaveShardedStrategy):
            raise IncompatibleStrategyError(
                f"async_sharded_save=True needs an AsyncSaveShardedStrategy, got {sharded}"
            )
        sharded.check_location(location)
        common.check_location(location)
        _check_same_on_all_ranks([location_str(location), sharded.backend, sharded.version], "(checkpoint_dir, backend, version)")
        _prepare_directory(location, [sharded, common])
        return sharded, common

    sharded_strat, common_strat = monitor.run("preparing the save", resolve)

    # 2. split the state
    def split() -> Tuple[ShardedStateDict, StateDict, List[ShardedBase]]:
        apply_factories(sharded_state_dict)
        _, persistent = extract_nonpersistent(sharded_state_dict)
        sharded_part, common_part = extract_sharded_base(persistent)
        return sharded_part, common_part, _check_save_inputs(sharded_part)

    sharded_part, common_state_dict, local_metadata = monitor.run("checking the state to save", split)
    nbytes = main_replica_bytes(sharded_part)

    # 3. validation
    def validate() -> None:
        gather_and_validate_sharding(local_metadata)
        to_compare = common_state_dict
        if preprocess_common_before_consistancy_check is not None:
            to_compare = preprocess_common_before_consistancy_check(common_state_dict)
        validate_common_state_dict(to_compare)

    if validate_access_integrity:
        monitor.run("validating the sharding", validate)

    # 4. common state and ShardedObjects
    def save_common() -> ShardedStateDict:
        common_strat.save_common(common_state_dict, location)
        if sharded_strat.can_handle_sharded_objects:
            return sharded_part
        validate_sharded_objects_handling(sharded_strat, common_strat)
        objects, tensors = extract_matching_values(sharded_part, lambda v: isinstance(v, ShardedObject))
        common_strat.save_sharded_objects(objects, location)  # type: ignore[arg-type]
        return tensors  # type: ignore[return-value]

    to_save = monitor.run("saving the common state", save_common)

    # 6. commit (run after step 5, directly or as the async request's finalization)
    def commit() -> None:
        config = CheckpointingConfig(
            sharded_strat.backend, sharded_strat.version, common_strat.backend, common_strat.version
        )
        monitor.run(
            "committing metadata.json",
            lambda: save_config(config, location, get_world_size()) if get_rank() == 0 else None,
        )

    # 5. sharded tensors
    if async_sharded_save:
        assert isinstance(sharded_strat, AsyncSaveShardedStrategy)
        request = monitor.run("preparing the async save", lambda: sharded_strat.async_save(to_save, location))
        returned = time.perf_counter()
        strategy_finalization = list(request.finalize_fns)
        request.finalize_fns.clear()

        def finalize() -> None:  # later, collectively: timed, and watched by the watchdog again
            monitor.add_phase("writing in the background (until finalized)", time.perf_counter() - returned)
            with monitor:
                monitor.run("finalizing the sharded tensors", lambda: [fn() for fn in strategy_finalization])
                commit()

        request.add_finalize_fn(finalize)
        return request, nbytes
    monitor.run("saving sharded tensors", lambda: sharded_strat.save(to_save, location))
    commit()
    return None, nbytes


# --------------------------------------------------------------------------- load


def _load_preprocess(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, ShardedStateDict]:
    """Copy the structure and build factories, keeping them for the merge after loading."""
    request, _ = extract_matching_values(sharded_state_dict, lambda x: True)
    factories, _ = extract_matching_values(request, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True)
    apply_factories(request)  # type: ignore[arg-type]
    dict_list_map_inplace(lambda f: f.without_data(), factories)
    return request, factories  # type: ignore[return-value]


def load_with_report(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: LocationLike,
    sharded_strategy: StrategySpec = None,
    common_strategy: StrategySpec = None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
    *,
    progress: Optional[ProgressCallback] = None,
    watchdog_timeout_s: Optional[float] = DEFAULT_WATCHDOG_TIMEOUT_S,
) -> LoadResult:
    """Load like :func:`load`, always returning a :class:`LoadResult` (collective), with the
    load's report (seconds per phase, bytes, files, throughput; also logged at INFO on rank 0).

    Steps:

    1. Read ``metadata.json`` and pick load strategies compatible with it.
    2. Load the common state: the base of the result. Build factories.
    3. Match requested keys against the checkpoint (``strict``) and, if
       ``validate_access_integrity``, check the requested sharding on rank 0.
    4. Load ShardedObjects and ShardedTensors (in place where ``data`` is allocated).
    5. Put loaded values and LocalNonPersistentObjects' local values where the request has
       them (see :mod:`dist_ckpt.state_assembly`), then apply factory merges.

    A key requested but absent from the checkpoint raises (naming it) unless ``strict`` says
    to skip it; it is never silently left unloaded. ``progress`` and ``watchdog_timeout_s`` are
    as in :func:`save`.

    Example::

        result = load_with_report(sd, "ckpt/iter_10")
        model_state, report = result.state_dict, result.report
        print(report.summary())
    """
    phases = ["opening the checkpoint", "loading the common state", "matching the requested keys",
              "loading sharded tensors", "assembling the state"]
    location = run_collectively("opening the checkpoint location", lambda: resolve_location(checkpoint_dir))
    monitor = StepMonitor(Operation.LOAD, location, phases, progress, watchdog_timeout_s)
    with monitor:
        state, missing, unexpected, nbytes = _load_steps(
            monitor, sharded_state_dict, location, sharded_strategy, common_strategy,
            validate_access_integrity, parse_strict_flag(strict),
        )
    return LoadResult(state, missing, unexpected, monitor.finish(nbytes))


def _load_steps(
    monitor: StepMonitor,
    sharded_state_dict: ShardedStateDict,
    location: CheckpointLocation,
    sharded_strategy: StrategySpec,
    common_strategy: StrategySpec,
    validate_access_integrity: bool,
    strict: StrictHandling,
) -> Tuple[StateDict, Set[str], Set[str], int]:
    """The numbered steps of :func:`load_with_report`; returns the state, the missing and
    unexpected keys, and the tensor bytes this rank requested."""
    # 1. strategies
    sharded_strat, common_strat = monitor.run(
        "opening the checkpoint",
        lambda: verify_checkpoint_and_load_strategy(location, sharded_strategy, common_strategy),
    )

    # 2. common state and factories
    def prepare() -> Tuple[StateDict, ShardedStateDict, ShardedStateDict, ShardedStateDict, Optional[ShardedStateDict]]:
        common = common_strat.load_common(location)
        request, factories = _load_preprocess(sharded_state_dict)
        sharded_part, _ = extract_sharded_base(request)
        ckpt_metadata = None
        if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
            ckpt_metadata = load_sharded_metadata(location, sharded_strat, common_strat)
        return common, request, sharded_part, factories, ckpt_metadata

    common_state, request, sharded_part, factories, ckpt_metadata = monitor.run("loading the common state", prepare)

    # 3. key matching and sharding validation
    sharded_part, missing, unexpected = monitor.run(
        "matching the requested keys",
        lambda: validate_integrity_and_strict_load(
            sharded_part, strict, validate_access_integrity, ckpt_sharded_metadata=ckpt_metadata
        ),
    )

    # 4. sharded objects and tensors
    def load_sharded() -> Dict[int, Any]:
        tensors = sharded_part
        values: Dict[int, Any] = {}
        if not sharded_strat.can_handle_sharded_objects:
            validate_sharded_objects_handling(sharded_strat, common_strat)
            objects, tensors = extract_matching_values(sharded_part, lambda v: isinstance(v, ShardedObject))  # type: ignore[assignment]
            inputs = extract_matching_values(objects, lambda v: True)[0]
            values.update(loaded_values(inputs, common_strat.load_sharded_objects(objects, location)))  # type: ignore[arg-type]
        inputs = extract_matching_values(tensors, lambda v: True)[0]
        values.update(loaded_values(inputs, sharded_strat.load(tensors, location)))
        return values

    values = monitor.run("loading sharded tensors", load_sharded)

    # 5. reassemble
    def reassemble() -> StateDict:
        kept = {id(x) for x in nested_values(sharded_part) if isinstance(x, ShardedBase)}
        state: StateDict = apply_factory_merges(assemble(common_state, request, values, kept), factories)
        return state

    state = monitor.run("assembling the state", reassemble)
    return state, missing, unexpected, requested_bytes(sharded_part)


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: LocationLike,
    sharded_strategy: StrategySpec = None,
    common_strategy: StrategySpec = None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
    *,
    progress: Optional[ProgressCallback] = None,
    watchdog_timeout_s: Optional[float] = DEFAULT_WATCHDOG_TIMEOUT_S,
) -> Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]:
    """Load a checkpoint into the layout described by ``sharded_state_dict`` (collective).

    See :func:`load_with_report` for the steps. Megatron-Core compatible: with
    ``strict=StrictHandling.RETURN_UNEXPECTED`` or ``RETURN_ALL`` the result is
    ``(state_dict, missing_keys, unexpected_keys)``, otherwise the state dict. New code that
    wants one return type should call :func:`load_with_report`.

    Args:
        sharded_state_dict: what to load: ShardedTensors describe this rank's part of each
            tensor (their ``data``, if allocated, is filled in place); other leaves are ignored.
        checkpoint_dir: a committed checkpoint directory, ``s3://bucket/prefix`` URL or storage.
        sharded_strategy: a LoadShardedStrategy or ``(backend, version)``; by default the one
            registered for the checkpoint's backend.
        common_strategy: a LoadCommonStrategy or ``(backend, version)``.
        validate_access_integrity: check that the requested main replicas form a valid sharding.
        strict: how to handle key mismatches (:class:`StrictHandling` or its value).
        progress: called with a :class:`~dist_ckpt.report.ProgressEvent` as each step starts
            and ends (keyword only).
        watchdog_timeout_s: as in :func:`save` (keyword only).
    """
    result = load_with_report(
        sharded_state_dict, checkpoint_dir, sharded_strategy, common_strategy, validate_access_integrity, strict,
        progress=progress, watchdog_timeout_s=watchdog_timeout_s,
    )
    if StrictHandling.requires_returning_mismatch_keys(parse_strict_flag(strict)):
        return result.state_dict, result.missing_keys, result.unexpected_keys
    return result.state_dict


def load_common_state_dict(checkpoint_dir: LocationLike, common_strategy: StrategySpec = None) -> StateDict:
    """The common (non-sharded) state of a checkpoint; needs no process group."""
    location = resolve_location(checkpoint_dir)
    _, common = verify_checkpoint_and_load_strategy(location, common_strategy=common_strategy)
    return common.load_common(location)


def load_tensors_metadata(checkpoint_dir: LocationLike, sharded_strategy: StrategySpec = None) -> ShardedStateDict:
    """``{key: ShardedTensor}`` with each stored tensor's global shape and dtype (no data).

    The ShardedTensors describe whole, unsharded tensors, so the result can be passed to
    :func:`load` to read full tensors. Needs no process group.
    """
    location = resolve_location(checkpoint_dir)
    sharded, _ = verify_checkpoint_and_load_strategy(location, sharded_strategy)
    return sharded.load_tensors_metadata(location)


def load_sharded_metadata(
    checkpoint_dir: LocationLike, sharded_strategy: StrategySpec = None, common_strategy: StrategySpec = None
) -> ShardedStateDict:
    """Metadata of every stored ShardedTensor (by key) and ShardedObject (by unique key)."""
    location = resolve_location(checkpoint_dir)
    sharded, common = verify_checkpoint_and_load_strategy(location, sharded_strategy, common_strategy)
    metadata = sharded.load_sharded_metadata(location)
    if not sharded.can_handle_sharded_objects:
        validate_sharded_objects_handling(sharded, common)
        merge(metadata, common.load_sharded_metadata(location))
    return metadata


def load_plain_tensors(checkpoint_dir: LocationLike) -> StateDict:
    """Every stored tensor, whole, keyed by its checkpoint key (the common state is not included).

    Collective when a process group is initialized (every rank loads the full tensors).
    """
    location = run_collectively("opening the checkpoint location", lambda: resolve_location(checkpoint_dir))
    sharded, _ = run_collectively("opening the checkpoint", lambda: verify_checkpoint_and_load_strategy(location))
    metadata = run_collectively("reading tensor metadata", lambda: sharded.load_tensors_metadata(location))
    return run_collectively("loading tensors", lambda: sharded.load(metadata, location))


def load_sharded_objects(sharded_state_dict: ShardedStateDict, checkpoint_dir: LocationLike) -> StateDict:
    """Replace every ShardedObject in ``sharded_state_dict`` by its stored value (in place)."""
    location = resolve_location(checkpoint_dir)
    _, common = verify_checkpoint_and_load_strategy(location)
    return common.load_sharded_objects(sharded_state_dict, location)


def remove_sharded_tensors(checkpoint_dir: LocationLike, key_prefix: str) -> None:
    """Delete every stored tensor whose key starts with ``key_prefix`` (one process calls it)."""
    location = resolve_location(checkpoint_dir)
    sharded, _ = verify_checkpoint_and_load_strategy(location)
    sharded.remove_sharded_tensors(location, key_prefix)
