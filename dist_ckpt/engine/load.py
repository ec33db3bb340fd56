"""``load``: the collective load of a checkpoint into the layout a sharded state dict describes.

The request's ShardedTensors say which part of each global tensor this rank wants, in whatever
layout the loading job uses; the stored layout may differ. Numbered steps read ``metadata.json``,
the common state, match keys, read the tensors (in place where allocated) and reassemble.

Example:

```python
import dist_ckpt as dc
loaded = dc.load(sd_for_new_layout, "ckpt/iter_10")
```
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Literal, Optional, Set, Tuple, Union, overload

from dist_ckpt.backends.base import LoadCommonStrategy, LoadShardedStrategy
from dist_ckpt.backends.registry import StrategySpec
from dist_ckpt.collectives.distributed import run_collectively
from dist_ckpt.engine.checks.compatibility import validate_sharded_objects_handling, verify_checkpoint_and_load_strategy
from dist_ckpt.engine.checks.key_hints import diagnose_integrity_error, with_key_suggestions
from dist_ckpt.engine.checks.strict import StrictHandling, parse_strict_flag, validate_integrity_and_strict_load
from dist_ckpt.engine.load_parts import load_sharded_metadata
from dist_ckpt.engine.monitor import StepMonitor, requested_bytes
from dist_ckpt.engine.report import CheckpointReport, Operation, ProgressCallback
from dist_ckpt.engine.state_assembly import assemble, loaded_values
from dist_ckpt.engine.steps import Step
from dist_ckpt.engine.watchdog import DEFAULT_WATCHDOG_TIMEOUT_S
from dist_ckpt.errors import KeyMismatchError, ShardingIntegrityError
from dist_ckpt.integrity.file_manifest import verify_integrity_manifest
from dist_ckpt.model.dict_utils import dict_list_map_inplace, extract_matching_values, nested_values
from dist_ckpt.model.sharded import (
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
)
from dist_ckpt.model.state_dict_utils import extract_sharded_base
from dist_ckpt.storage import Storage
from dist_ckpt.storage.host_memory import host_memory_budget
from dist_ckpt.storage.location import LocationLike, resolve_location

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadResult:
    """What [`load_with_report()`][dist_ckpt.engine.load.load_with_report] returns, whatever the ``strict`` mode.

    Attributes:
        state_dict: the loaded state dict.
        missing_keys: keys in the checkpoint that no rank requested (found by ``*_ALL`` modes).
        unexpected_keys: keys this rank requested that the checkpoint lacks (skipped).
        report: seconds per phase, bytes read, files, throughput (see
            [`dist_ckpt.engine.report`][dist_ckpt.engine.report]).
    """

    state_dict: StateDict
    missing_keys: Set[str]
    unexpected_keys: Set[str]
    report: CheckpointReport


def get_default_load_sharded_strategy(checkpoint_dir: LocationLike) -> LoadShardedStrategy:
    """The registered load strategy for the backend recorded in ``checkpoint_dir``."""
    return verify_checkpoint_and_load_strategy(checkpoint_dir)[0]


def _load_preprocess(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, ShardedStateDict]:
    """Copy the structure and build factories, keeping them for the merge after loading."""
    request, _ = extract_matching_values(sharded_state_dict, lambda x: True)
    factories, _ = extract_matching_values(
        request, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
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
    allow_dtype_cast: Optional[bool] = None,
    host_memory_budget_bytes: Optional[int] = None,
    verify_integrity: bool = False,
) -> LoadResult:
    """Load like [`load()`][dist_ckpt.engine.load.load], always returning a
    [`LoadResult`][dist_ckpt.engine.load.LoadResult] (collective), with the load's report (seconds per phase, bytes,
    files, throughput; also logged at INFO on rank 0).

    Steps:

    1. Read ``metadata.json`` and pick load strategies compatible with it (configured with
       ``allow_dtype_cast`` when it is given). With ``verify_integrity``, check every file that
       Megatron-Core's ``integrity.json`` lists (each rank a share; see
       `dist_ckpt.integrity.file_manifest`).
    2. Load the common state: the base of the result. Build factories.
    3. Match requested keys against the checkpoint (``strict``) and, if
       ``validate_access_integrity``, check the requested sharding on rank 0.
    4. Load ShardedObjects and ShardedTensors (in place where ``data`` is allocated).
    5. Put loaded values and LocalNonPersistentObjects' local values where the request has
       them (see `dist_ckpt.engine.state_assembly`), then apply factory merges.

    A key requested but absent from the checkpoint raises (naming it) unless ``strict`` says
    to skip it; it is never silently left unloaded. ``progress`` and ``watchdog_timeout_s`` are
    as in [`save()`][dist_ckpt.engine.save.save], ``allow_dtype_cast`` and ``host_memory_budget_bytes``
    as in [`load()`][dist_ckpt.engine.load.load].

    Example:

    ```python
    result = load_with_report(sd, "ckpt/iter_10")
    model_state, report = result.state_dict, result.report
    print(report.summary())
    ```
    """
    phases = [Step.OPEN_CHECKPOINT] + ([Step.VERIFY_INTEGRITY] if verify_integrity else [])
    phases += [Step.LOAD_COMMON, Step.MATCH_KEYS, Step.LOAD_SHARDED, Step.ASSEMBLE]
    location = run_collectively("opening the checkpoint location", lambda: resolve_location(checkpoint_dir))
    monitor = StepMonitor(Operation.LOAD, location, phases, progress, watchdog_timeout_s)
    monitor.count_files_meanwhile()
    with monitor, host_memory_budget(host_memory_budget_bytes) as memory:
        state, missing, unexpected, nbytes = _load_steps(
            monitor,
            sharded_state_dict,
            location,
            sharded_strategy,
            common_strategy,
            validate_access_integrity,
            parse_strict_flag(strict),
            allow_dtype_cast,
            verify_integrity,
        )
    monitor.report.host_memory_budget_bytes = memory.budget
    return LoadResult(state, missing, unexpected, monitor.finish(nbytes))


def _load_steps(
    monitor: StepMonitor,
    sharded_state_dict: ShardedStateDict,
    location: Storage,
    sharded_strategy: StrategySpec,
    common_strategy: StrategySpec,
    validate_access_integrity: bool,
    strict: StrictHandling,
    allow_dtype_cast: Optional[bool],
    verify_integrity: bool = False,
) -> Tuple[StateDict, Set[str], Set[str], int]:
    """The numbered steps of [`load_with_report()`][dist_ckpt.engine.load.load_with_report]; returns the state, the
    missing and unexpected keys, and the tensor bytes this rank requested."""

    # 1. strategies
    def strategies() -> Tuple[LoadShardedStrategy, LoadCommonStrategy]:
        sharded, common = verify_checkpoint_and_load_strategy(location, sharded_strategy, common_strategy)
        return (sharded if allow_dtype_cast is None else sharded.with_dtype_cast(allow_dtype_cast)), common

    sharded_strat, common_strat = monitor.run(Step.OPEN_CHECKPOINT, strategies)
    if verify_integrity:  # Megatron-Core's integrity.json: every file it lists, before any is read
        monitor.run(Step.VERIFY_INTEGRITY, lambda: verify_integrity_manifest(location), exchanges_errors=True)

    # 2. common state and factories
    def prepare() -> Tuple[StateDict, ShardedStateDict, ShardedStateDict, ShardedStateDict, Optional[ShardedStateDict]]:
        common = common_strat.load_common(location)
        request, factories = _load_preprocess(sharded_state_dict)
        sharded_part, _ = extract_sharded_base(request)
        ckpt_metadata = None
        if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
            ckpt_metadata = load_sharded_metadata(location, sharded_strat, common_strat)
        return common, request, sharded_part, factories, ckpt_metadata

    common_state, request, sharded_part, factories, ckpt_metadata = monitor.run(Step.LOAD_COMMON, prepare)

    def stored_keys() -> Optional[Set[str]]:
        """The checkpoint's keys, for the errors of a request that fails (`key_hints`)."""
        try:
            return {sh.key for sh in load_sharded_metadata(location, sharded_strat, common_strat).values()}
        except Exception as e:  # noqa: BLE001 -- only a hint for the error under way
            logger.debug("cannot list the keys of %s for an error message: %s", location.url, e)
            return None

    # 3. key matching and sharding validation (a failed sharding check says if a mistyped key caused it)
    def match_keys() -> Tuple[ShardedStateDict, Set[str], Set[str]]:
        try:
            return validate_integrity_and_strict_load(
                sharded_part, strict, validate_access_integrity, ckpt_sharded_metadata=ckpt_metadata
            )
        except ShardingIntegrityError as e:  # raised on every rank
            diagnose_integrity_error(e, sharded_part, stored_keys, repr(location.url))

    sharded_part, missing, unexpected = monitor.run(Step.MATCH_KEYS, match_keys)

    # 4. sharded objects and tensors
    def load_sharded() -> Dict[int, Any]:
        # a copy of the structure: strategies replace the leaves in place, and step 5 needs the request
        tensors: ShardedStateDict = extract_matching_values(sharded_part, lambda v: True)[0]  # type: ignore[assignment]
        values: Dict[int, Any] = {}
        if not sharded_strat.can_handle_sharded_objects:
            validate_sharded_objects_handling(sharded_strat, common_strat)
            objects, tensors = extract_matching_values(sharded_part, lambda v: isinstance(v, ShardedObject))  # type: ignore[assignment]
            inputs = extract_matching_values(objects, lambda v: True)[0]
            values.update(loaded_values(inputs, common_strat.load_sharded_objects(objects, location)))  # type: ignore[arg-type]
        inputs = extract_matching_values(tensors, lambda v: True)[0]
        values.update(loaded_values(inputs, sharded_strat.load(tensors, location)))
        return values

    def load_sharded_or_suggest() -> Dict[int, Any]:
        try:
            return load_sharded()
        except KeyMismatchError as e:  # did you mean a stored key?
            suggested = with_key_suggestions(e, stored_keys)
            if suggested is e:
                raise
            raise suggested from e

    nbytes = requested_bytes(sharded_part)
    values = monitor.run(Step.LOAD_SHARDED, load_sharded_or_suggest, bytes_total=nbytes)

    # 5. reassemble
    def reassemble() -> StateDict:
        kept = {id(x) for x in nested_values(sharded_part) if isinstance(x, ShardedBase)}
        state: StateDict = apply_factory_merges(assemble(common_state, request, values, kept), factories)
        return state

    state = monitor.run(Step.ASSEMBLE, reassemble)
    return state, missing, unexpected, nbytes


#: the ``strict`` values for which `load()` returns ``(state_dict, missing_keys, unexpected_keys)``
ReturnsMismatchKeys = Literal[
    StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL, "return_unexpected", "return_all"
]
#: the ``strict`` values for which `load()` returns the state dict alone
ReturnsStateDict = Literal[
    StrictHandling.ASSUME_OK_UNEXPECTED,
    StrictHandling.LOG_UNEXPECTED,
    StrictHandling.LOG_ALL,
    StrictHandling.RAISE_UNEXPECTED,
    StrictHandling.RAISE_ALL,
    StrictHandling.IGNORE_ALL,
    "assume_ok_unexpected",
    "log_unexpected",
    "log_all",
    "raise_unexpected",
    "raise_all",
    "ignore_all",
]
#: what `load()` returns with ``strict`` set to one of `ReturnsMismatchKeys`
StateDictAndMismatchKeys = Tuple[StateDict, Set[str], Set[str]]


# The overloads let a type checker know load()'s result from a literal ``strict`` (the
# Megatron-Core signature returns a dict or a tuple depending on it): ``state["w"]`` type-checks
# after ``load(sd, path)``, and the tuple unpacks after ``strict=StrictHandling.RETURN_ALL``.
@overload
def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: LocationLike,
    sharded_strategy: StrategySpec = None,
    common_strategy: StrategySpec = None,
    validate_access_integrity: bool = True,
    strict: ReturnsStateDict = StrictHandling.ASSUME_OK_UNEXPECTED,
    *,
    progress: Optional[ProgressCallback] = None,
    watchdog_timeout_s: Optional[float] = DEFAULT_WATCHDOG_TIMEOUT_S,
    allow_dtype_cast: Optional[bool] = None,
    host_memory_budget_bytes: Optional[int] = None,
    verify_integrity: bool = False,
) -> StateDict: ...


@overload
def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: LocationLike,
    sharded_strategy: StrategySpec,
    common_strategy: StrategySpec,
    validate_access_integrity: bool,
    strict: ReturnsMismatchKeys,
    *,
    progress: Optional[ProgressCallback] = None,
    watchdog_timeout_s: Optional[float] = DEFAULT_WATCHDOG_TIMEOUT_S,
    allow_dtype_cast: Optional[bool] = None,
    host_memory_budget_bytes: Optional[int] = None,
    verify_integrity: bool = False,
) -> StateDictAndMismatchKeys: ...


@overload
def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: LocationLike,
    sharded_strategy: StrategySpec = None,
    common_strategy: StrategySpec = None,
    validate_access_integrity: bool = True,
    *,
    strict: ReturnsMismatchKeys,
    progress: Optional[ProgressCallback] = None,
    watchdog_timeout_s: Optional[float] = DEFAULT_WATCHDOG_TIMEOUT_S,
    allow_dtype_cast: Optional[bool] = None,
    host_memory_budget_bytes: Optional[int] = None,
    verify_integrity: bool = False,
) -> StateDictAndMismatchKeys: ...


@overload
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
    allow_dtype_cast: Optional[bool] = None,
    host_memory_budget_bytes: Optional[int] = None,
    verify_integrity: bool = False,
) -> Union[StateDict, StateDictAndMismatchKeys]: ...


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
    allow_dtype_cast: Optional[bool] = None,
    host_memory_budget_bytes: Optional[int] = None,
    verify_integrity: bool = False,
) -> Union[StateDict, StateDictAndMismatchKeys]:
    """Load a checkpoint into the layout described by ``sharded_state_dict`` (collective).

    See [`load_with_report()`][dist_ckpt.engine.load.load_with_report] for the steps. Megatron-Core compatible: with
    ``strict=StrictHandling.RETURN_UNEXPECTED`` or ``RETURN_ALL`` the result is
    ``(state_dict, missing_keys, unexpected_keys)``, otherwise the state dict; with ``strict``
    written as a literal, type checkers know which (overloads). New code that wants one return
    type should call [`load_with_report()`][dist_ckpt.engine.load.load_with_report].

    Args:
        sharded_state_dict: what to load: ShardedTensors describe this rank's part of each
            tensor (their ``data``, if allocated, is filled in place); other leaves are ignored.
        checkpoint_dir: a committed checkpoint directory, ``s3://bucket/prefix`` URL or storage.
        sharded_strategy: a LoadShardedStrategy or ``(backend, version)``; by default the one
            registered for the checkpoint's backend.
        common_strategy: a LoadCommonStrategy or ``(backend, version)``.
        validate_access_integrity: check that the requested main replicas form a valid sharding.
        strict: how to handle key mismatches ([`StrictHandling`][dist_ckpt.engine.checks.strict.StrictHandling] or its
            value).
        progress: called with a [`ProgressEvent`][dist_ckpt.engine.report.ProgressEvent] as each step starts
            and ends (keyword only).
        watchdog_timeout_s: as in [`save()`][dist_ckpt.engine.save.save] (keyword only).
        allow_dtype_cast: whether a requested dtype may differ from the stored one (keyword
            only). The loaders cast by default, as Megatron-Core and torch.distributed.checkpoint
            do: each stored piece is read in its dtype and converted while copied into the
            requested tensor (`dist_ckpt.model.dtype_cast` has the rule; the keys cast are
            logged at INFO). ``False`` raises ``LoadMismatchError`` naming the key, rank,
            checkpoint and both dtypes instead; ``None`` leaves the choice to the strategy's own
            option (e.g. ``SafetensorsLoadOptions(allow_dtype_cast=...)``).
        host_memory_budget_bytes: most host memory the load stages at once on the way to
            destinations it cannot read into directly (GPU or strided tensors), keyword only;
            None: the process's budget ([`dist_ckpt.storage.host_memory`][dist_ckpt.storage.host_memory]), else
            no bound.
        verify_integrity: first check the SHA-256 of every file listed in Megatron-Core's
            ``integrity.json`` (keyword only); a missing manifest, or a file missing or different,
            raises on every rank, naming each file.

    Example:

    ```python
    dc.load(bf16_model_sd, "ckpt/iter_10")                            # fp32 on disk: cast
    dc.load(bf16_model_sd, "ckpt/iter_10", allow_dtype_cast=False)    # LoadMismatchError
    ```
    """
    result = load_with_report(
        sharded_state_dict,
        checkpoint_dir,
        sharded_strategy,
        common_strategy,
        validate_access_integrity,
        strict,
        progress=progress,
        watchdog_timeout_s=watchdog_timeout_s,
        allow_dtype_cast=allow_dtype_cast,
        host_memory_budget_bytes=host_memory_budget_bytes,
        verify_integrity=verify_integrity,
    )
    if StrictHandling.requires_returning_mismatch_keys(parse_strict_flag(strict)):
        return result.state_dict, result.missing_keys, result.unexpected_keys
    return result.state_dict


__all__ = ["LoadResult", "get_default_load_sharded_strategy", "load", "load_with_report"]
