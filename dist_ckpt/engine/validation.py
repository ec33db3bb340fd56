"""Sharding-integrity and key-matching checks.

The checks are pure functions over per-rank metadata (``global_metadata[rank]`` is the list of
that rank's shards without data), so they are tested without processes. The collective
wrappers gather metadata to rank 0 once, check there, and raise the same error on every rank.
"""

from __future__ import annotations

import hashlib
import logging
import math
import pickle
from collections import defaultdict
from enum import Enum
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch

from dist_ckpt.engine.commit import detect_config
from dist_ckpt.model.dict_utils import extract_matching_values, nested_values
from dist_ckpt.engine.distributed import (
    ProcessGroup,
    broadcast_json,
    gather_json,
    get_rank,
    run_collectively,
)
from dist_ckpt.errors import (
    CheckpointingException,
    IncompatibleStrategyError,
    KeyMismatchError,
    ShardingIntegrityError,
    format_keys,
)
from dist_ckpt.model.sharded import (
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    is_main_replica,
)
from dist_ckpt.engine.shard_metadata import all_gather_metadata, gather_metadata
from dist_ckpt.storage.location import LocationLike, location_str, resolve_location
from dist_ckpt.backends.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    StrategyAction,
    StrategySpec,
    resolve_strategy,
)

logger = logging.getLogger(__name__)

GlobalMetadata = List[List[ShardedBase]]
_MAX_REPORTED = 10


class StrictHandling(Enum):
    """What ``load`` does when requested keys and checkpoint keys differ.

    Terms follow Megatron-Core: *unexpected* keys are requested by ``load`` but absent from
    the checkpoint; *missing* keys are in the checkpoint but requested by no rank. ``*_UNEXPECTED``
    modes only look at unexpected keys (no metadata exchange); ``*_ALL`` modes look at both.
    Every mode except ``ASSUME_OK_UNEXPECTED`` reads the checkpoint's key list before loading.
    """

    #: let the sharded strategy raise on unexpected keys (it does, naming them)
    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    #: log unexpected keys at WARNING and skip them; ignore missing keys
    LOG_UNEXPECTED = "log_unexpected"
    #: log unexpected and missing keys at WARNING; skip unexpected keys
    LOG_ALL = "log_all"
    #: raise before loading if there are unexpected keys
    RAISE_UNEXPECTED = "raise_unexpected"
    #: raise before loading on any mismatch (like ``strict=True`` in torch)
    RAISE_ALL = "raise_all"
    #: skip unexpected keys and return them: ``load`` returns ``(state_dict, missing, unexpected)``
    RETURN_UNEXPECTED = "return_unexpected"
    #: skip unexpected keys and return both kinds: ``(state_dict, missing, unexpected)``
    RETURN_ALL = "return_all"
    #: skip unexpected keys silently (not recommended)
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: "StrictHandling") -> bool:
        """Whether the checkpoint's key list must be read before loading."""
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        """Whether every rank's requested keys must be known (to find missing keys)."""
        return val in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        """Whether ``load`` returns ``(state_dict, missing_keys, unexpected_keys)``."""
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, StrictHandling]) -> StrictHandling:
    """Accept a :class:`StrictHandling` or its string value."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except ValueError as e:
        allowed = ", ".join(m.value for m in StrictHandling)
        raise CheckpointingException(f"invalid strict flag {strict!r}; expected one of: {allowed}") from e


# --------------------------------------------------------------------------- sharding integrity


def _first_difference(key: str, shards: List[Tuple[int, ShardedTensor]]) -> Optional[str]:
    ref_rank, ref = shards[0]
    for attr in ("global_shape", "dtype", "full_local_shape", "prepend_axis_num"):
        for rank, sh in shards:
            if getattr(sh, attr) != getattr(ref, attr):
                return (
                    f"{key!r}: {attr} differs between ranks: rank {ref_rank} has {getattr(ref, attr)}, "
                    f"rank {rank} has {getattr(sh, attr)}"
                )
    if len({sh.flattened_range is None for _, sh in shards}) > 1:
        flat = [r for r, sh in shards if sh.flattened_range is not None]
        return f"{key!r}: ranks {flat} hold flattened shards and other ranks hold whole shards; use one form per tensor"
    return None


def _missing_chunk(grid: Tuple[int, ...], covered: Set[Tuple[int, ...]]) -> Tuple[int, ...]:
    for idx in np.ndindex(*grid):
        if tuple(idx) not in covered:
            return tuple(int(i) for i in idx)
    raise AssertionError("no missing chunk")  # callers check the count first


def _tensor_problems(key: str, shards: List[Tuple[int, ShardedTensor]]) -> List[str]:
    difference = _first_difference(key, shards)
    if difference:
        return [difference]
    ref = shards[0][1]
    chunk, glob = ref.full_local_shape, ref.global_shape
    if math.prod(glob) == 0:
        return []
    for axis, (g, c) in enumerate(zip(glob, chunk)):
        if c == 0 or g % c:
            return [
                f"{key!r}: global size {g} along axis {axis} is not a multiple of the local size {c}; "
                f"equal shards cannot tile global shape {glob}"
            ]
    grid = tuple(g // c for g, c in zip(glob, chunk))
    mains = [(rank, sh) for rank, sh in shards if is_main_replica(sh.replica_id)]
    problems: List[str] = []
    owners: Dict[Tuple[int, ...], List[Tuple[int, int, int]]] = defaultdict(list)
    for rank, sh in mains:
        rng = sh.flattened_range
        start, stop = (0, math.prod(chunk)) if rng is None else (rng.start, rng.stop)
        owners[sh.local_chunk_offset_in_global()].append((start, stop, rank))
    chunk_numel = math.prod(chunk)
    for idx in sorted(owners):
        offset = tuple(i * c for i, c in zip(idx, chunk))
        pieces = sorted(owners[idx])
        if ref.flattened_range is None:
            if len(pieces) > 1:
                problems.append(
                    f"{key!r}: the shard at global offset {offset} is a main replica on ranks "
                    f"{[r for _, _, r in pieces]} (overlap); give all but one a non-zero replica_id"
                )
            continue
        pos = 0
        for start, stop, rank in pieces:
            if start < pos:
                problems.append(
                    f"{key!r}: flattened ranges overlap in the chunk at global offset {offset}: rank {rank} "
                    f"holds [{start}, {stop}) but elements up to {pos} are already held"
                )
            elif start > pos:
                problems.append(f"{key!r}: no rank holds flat elements [{pos}, {start}) of the chunk at global offset {offset}")
            pos = max(pos, stop)
        if pos < chunk_numel:
            problems.append(f"{key!r}: no rank holds flat elements [{pos}, {chunk_numel}) of the chunk at global offset {offset}")
    total = math.prod(grid)
    if len(owners) < total:
        idx = _missing_chunk(grid, set(owners))
        offset = tuple(i * c for i, c in zip(idx, chunk))
        problems.append(
            f"{key!r}: no main replica holds the shard at global offset {offset} (shape {chunk}); "
            f"{total - len(owners)} of {total} shards are missing (gap in coverage)"
        )
    return problems


def _object_problems(key: str, shards: List[Tuple[int, ShardedObject]]) -> List[str]:
    ref_rank, ref = shards[0]
    for rank, sh in shards:
        if sh.global_shape != ref.global_shape:
            return [
                f"{key!r}: global_shape differs between ranks: rank {ref_rank} has {ref.global_shape}, "
                f"rank {rank} has {sh.global_shape}"
            ]
    owners: Dict[Tuple[int, ...], List[int]] = defaultdict(list)
    for rank, sh in shards:
        if is_main_replica(sh.replica_id):
            owners[sh.global_offset].append(rank)
    problems = [
        f"{key!r}: object shard {offset} is a main replica on ranks {ranks} (overlap)"
        for offset, ranks in sorted(owners.items())
        if len(ranks) > 1
    ]
    total = math.prod(ref.global_shape)
    if len(owners) < total:
        idx = _missing_chunk(ref.global_shape, set(owners))
        problems.append(f"{key!r}: no main replica holds object shard {idx}; {total - len(owners)} of {total} are missing")
    return problems


def find_sharding_problems(global_metadata: Sequence[Sequence[ShardedBase]]) -> List[str]:
    """Every way in which the ranks' shards fail to form a valid sharding (pure).

    Main replicas of each tensor must cover it exactly once (no overlap, no gap), and every
    rank must agree on global shape, dtype and local shape; likewise for ShardedObjects.
    """
    by_key: Dict[str, List[Tuple[int, ShardedBase]]] = defaultdict(list)
    for rank, shards in enumerate(global_metadata):
        for sh in shards:
            by_key[sh.key].append((rank, sh))
    problems: List[str] = []
    for key in sorted(by_key):
        tensors = [(r, s) for r, s in by_key[key] if isinstance(s, ShardedTensor)]
        objects = [(r, s) for r, s in by_key[key] if isinstance(s, ShardedObject)]
        if tensors and objects:
            problems.append(
                f"{key!r} is a ShardedTensor on ranks {sorted({r for r, _ in tensors})} and a "
                f"ShardedObject on ranks {sorted({r for r, _ in objects})}"
            )
        elif tensors:
            problems += _tensor_problems(key, tensors)
        elif objects:
            problems += _object_problems(key, objects)
    return problems


def _integrity_error(problems: Sequence[str], world_size: int) -> ShardingIntegrityError:
    shown = "; ".join(problems[:_MAX_REPORTED])
    more = f"; ... and {len(problems) - _MAX_REPORTED} more" if len(problems) > _MAX_REPORTED else ""
    return ShardingIntegrityError(f"invalid sharding across {world_size} ranks: {shown}{more}")


def check_sharding_integrity(global_metadata: Sequence[Sequence[ShardedBase]]) -> None:
    """Raise :class:`ShardingIntegrityError` listing the problems (pure, no communication)."""
    problems = find_sharding_problems(global_metadata)
    if problems:
        raise _integrity_error(problems, len(global_metadata))


def determine_global_metadata(
    sharded_state_dict: ShardedStateDict, group: Optional[ProcessGroup] = None
) -> Tuple[List[ShardedBase], GlobalMetadata]:
    """This rank's shard metadata, and every rank's (all-gathered, compact JSON encoding)."""
    local_metadata = [sh.without_data() for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedBase)]
    return local_metadata, all_gather_metadata(local_metadata, group)


def validate_sharding_integrity(
    global_metadata: Optional[Sequence[Sequence[ShardedBase]]],
    common_state_dict: Optional[Dict[str, Any]] = None,
) -> None:
    """Collective: check the sharding on rank 0 and raise the same error on every rank.

    Args:
        global_metadata: every rank's shard metadata (needed on rank 0 only).
        common_state_dict: if given, also warn when the common state differs between ranks.
    """
    if common_state_dict is not None:
        validate_common_state_dict(common_state_dict)

    def check() -> None:
        if get_rank() == 0:
            if global_metadata is None:
                raise CheckpointingException("validate_sharding_integrity needs global_metadata on rank 0")
            check_sharding_integrity(global_metadata)

    run_collectively("validating the sharding", check)


def gather_and_validate_sharding(local_metadata: Sequence[ShardedBase]) -> None:
    """Collective: gather shard metadata to rank 0 only, validate there, raise everywhere."""
    gathered = gather_metadata(local_metadata)
    validate_sharding_integrity(gathered)


# --------------------------------------------------------------------------- common state


def _fingerprint(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h = hashlib.sha1(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
        return "tensor:" + h.hexdigest()
    if isinstance(value, np.ndarray):
        h = hashlib.sha1(f"{value.dtype}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).data)
        return "ndarray:" + h.hexdigest()
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, (set, frozenset)):
        return "set:" + repr(sorted(_fingerprint(v) for v in value))
    if isinstance(value, tuple):
        return "tuple:" + repr([_fingerprint(v) for v in value])
    try:
        return f"{type(value).__qualname__}:" + hashlib.sha1(pickle.dumps(value)).hexdigest()
    except Exception:  # noqa: BLE001 -- unpicklable values are compared by type only
        return f"{type(value).__qualname__}:<unhashable>"


def common_state_fingerprints(common_state_dict: Any, prefix: str = "") -> Dict[str, str]:
    """``{"a/b/0": fingerprint}`` for every leaf of the common state (compact, comparable)."""
    out: Dict[str, str] = {}
    items: Iterable[Tuple[Any, Any]]
    if isinstance(common_state_dict, dict):
        items = common_state_dict.items()
    elif isinstance(common_state_dict, list):
        items = enumerate(common_state_dict)
    else:
        return {prefix or "<root>": _fingerprint(common_state_dict)}
    for k, v in items:
        path = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, (dict, list)) and v:
            out.update(common_state_fingerprints(v, path))
        else:
            out[path] = _fingerprint(v)
    return out


def find_common_state_differences(fingerprints: Sequence[Dict[str, str]]) -> Dict[int, Tuple[List[str], List[str], List[str]]]:
    """Per rank r > 0: (paths only on rank 0, paths only on rank r, paths whose values differ)."""
    ref = fingerprints[0]
    out = {}
    for rank, fp in enumerate(fingerprints[1:], start=1):
        only_0 = sorted(ref.keys() - fp.keys())
        only_r = sorted(fp.keys() - ref.keys())
        differ = sorted(k for k in ref.keys() & fp.keys() if ref[k] != fp[k])
        if only_0 or only_r or differ:
            out[rank] = (only_0, only_r, differ)
    return out


def validate_common_state_dict(common_state_dict: Dict[str, Any]) -> None:
    """Collective: log at WARNING (on rank 0) how the ranks' common states differ.

    Only rank 0's common state is saved, so a difference usually means a bug (or rank-specific
    state that belongs in a ShardedObject). Fingerprints, not the objects, are gathered.
    """
    gathered = gather_json(common_state_fingerprints(common_state_dict))
    if gathered is None:
        return
    differences = find_common_state_differences(gathered)
    if differences:
        lines = [
            f"rank {rank}: only on rank 0: {only_0[:5]}, only on rank {rank}: {only_r[:5]}, different values: {differ[:5]}"
            for rank, (only_0, only_r, differ) in sorted(differences.items())
        ]
        logger.warning(
            "the common (non-sharded) state differs between ranks; only rank 0's copy is saved. %s",
            "; ".join(lines[:_MAX_REPORTED]),
        )


# --------------------------------------------------------------------------- key matching


def determine_missing_and_unexpected_keys(
    ckpt_sharded_metadata: ShardedStateDict,
    local_metadata: Sequence[ShardedBase],
    global_metadata: Optional[Sequence[Sequence[ShardedBase]]] = None,
) -> Tuple[Set[str], Set[str]]:
    """(missing, unexpected) keys: in the checkpoint but requested by no rank / requested here
    but not in the checkpoint. Missing keys need ``global_metadata`` (else the set is empty)."""
    ckpt_keys = {sh.key for sh in ckpt_sharded_metadata.values()}
    unexpected = {sh.key for sh in local_metadata} - ckpt_keys
    missing: Set[str] = set()
    if global_metadata is not None:
        missing = ckpt_keys - {sh.key for rank in global_metadata for sh in rank}
    return missing, unexpected


def maybe_report_missing_and_unexpected_keys(
    missing_keys: Iterable[str], unexpected_keys: Iterable[str], raise_error: bool = True
) -> None:
    """Raise :class:`KeyMismatchError` (or log at WARNING) describing mismatched keys."""
    missing, unexpected = sorted(missing_keys), sorted(unexpected_keys)
    if not missing and not unexpected:
        return
    parts = []
    if unexpected:
        parts.append(f"keys requested by load but absent from the checkpoint: {format_keys(unexpected)}")
    if missing:
        parts.append(f"keys in the checkpoint that no rank requested: {format_keys(missing)}")
    message = f"[rank {get_rank()}] " + "; ".join(parts)
    if raise_error:
        raise KeyMismatchError(message, missing, unexpected)
    logger.warning(message)


def adjust_non_strict_load(sharded_state_dict: ShardedStateDict, sharded_keys_to_remove: Set[str]) -> ShardedStateDict:
    """Drop the ShardedBase leaves whose key is in ``sharded_keys_to_remove``."""

    def is_unexpected(x: Any) -> bool:
        return isinstance(x, ShardedBase) and x.key in sharded_keys_to_remove

    _, kept = extract_matching_values(sharded_state_dict, is_unexpected)
    return kept  # type: ignore[return-value]


def validate_sharded_objects_handling(sharded_strategy: Any, common_strategy: Any) -> None:
    """Raise unless the sharded or the common strategy handles ShardedObjects."""
    if not sharded_strategy.can_handle_sharded_objects and not common_strategy.can_handle_sharded_objects:
        raise IncompatibleStrategyError(
            f"neither {sharded_strategy} nor {common_strategy} can handle ShardedObjects; "
            f"use a common strategy that can (e.g. the default 'torch' one)"
        )


def verify_checkpoint_and_load_strategy(
    checkpoint_dir: LocationLike,
    sharded_strategy: StrategySpec = None,
    common_strategy: StrategySpec = None,
) -> Tuple[LoadShardedStrategy, LoadCommonStrategy]:
    """Read ``metadata.json`` and return load strategies compatible with it.

    A folder holding HuggingFace weights and no ``metadata.json`` is read with the ``hf``
    strategies (see :func:`dist_ckpt.engine.commit.detect_config`).

    Strategies the caller passes are checked for compatibility; missing ones come from the
    registry, keyed by the backend and version the checkpoint records. On an object store
    (``s3://``), each must also be able to read from one (``check_location``).
    """
    location = resolve_location(checkpoint_dir)
    config = detect_config(location)
    sharded = resolve_strategy(
        sharded_strategy, StrategyAction.LOAD_SHARDED, (config.sharded_backend, config.sharded_backend_version)
    )
    common = resolve_strategy(
        common_strategy, StrategyAction.LOAD_COMMON, (config.common_backend, config.common_backend_version)
    )
    assert isinstance(sharded, LoadShardedStrategy) and isinstance(common, LoadCommonStrategy)
    for strategy, backend, version in (
        (sharded, config.sharded_backend, config.sharded_backend_version),
        (common, config.common_backend, config.common_backend_version),
    ):
        try:
            strategy.check_backend_compatibility(backend)
            strategy.check_version_compatibility(version)
        except IncompatibleStrategyError as e:
            raise IncompatibleStrategyError(f"checkpoint {location_str(location)!r}: {e}") from e
        strategy.check_location(location)
    return sharded, common


def validate_integrity_and_strict_load(
    sharded_state_dict: ShardedStateDict,
    strict: StrictHandling,
    validate_access_integrity: bool,
    local_metadata: Optional[Sequence[ShardedBase]] = None,
    global_metadata: Optional[Sequence[Sequence[ShardedBase]]] = None,
    ckpt_sharded_metadata: Optional[ShardedStateDict] = None,
) -> Tuple[ShardedStateDict, Set[str], Set[str]]:
    """Collective: apply ``strict`` and (optionally) check the requested sharding.

    Global metadata is gathered to rank 0 only; rank 0 validates the sharding and finds
    missing keys, and shares the outcome. Unexpected keys are found locally on each rank.

    Returns:
        ``(sharded_state_dict without unexpected keys, missing_keys, unexpected_keys)``.
    """
    missing: Set[str] = set()
    unexpected: Set[str] = set()
    if local_metadata is None:
        local_metadata = [sh.without_data() for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedBase)]
    check_mismatch = StrictHandling.requires_explicit_ckpt_mismatch_check(strict)
    need_global = StrictHandling.requires_global_app_metadata(strict) and check_mismatch
    if check_mismatch and ckpt_sharded_metadata is None:
        raise CheckpointingException("cannot check key mismatches without the checkpoint's sharded metadata")

    if validate_access_integrity or need_global:
        gathered = global_metadata if global_metadata is not None else gather_metadata(local_metadata)

        def check_on_rank0() -> List[str]:
            if get_rank() != 0:
                return []
            assert gathered is not None
            if validate_access_integrity:
                check_sharding_integrity(gathered)
            if need_global:
                assert ckpt_sharded_metadata is not None
                return sorted(determine_missing_and_unexpected_keys(ckpt_sharded_metadata, [], gathered)[0])
            return []

        missing = set(broadcast_json(run_collectively("validating the load request", check_on_rank0)))

    if check_mismatch:
        assert ckpt_sharded_metadata is not None
        unexpected = determine_missing_and_unexpected_keys(ckpt_sharded_metadata, local_metadata)[1]
        sharded_state_dict = adjust_non_strict_load(sharded_state_dict, unexpected)

        def report() -> None:
            if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
                maybe_report_missing_and_unexpected_keys(missing, unexpected, raise_error=True)
            elif strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
                maybe_report_missing_and_unexpected_keys(missing, unexpected, raise_error=False)
            elif strict == StrictHandling.IGNORE_ALL and (missing or unexpected):
                logger.info(
                    "strict=IGNORE_ALL: skipping %d requested keys absent from the checkpoint",
                    len(unexpected),
                )

        run_collectively("matching requested keys against the checkpoint", report)
        if strict == StrictHandling.IGNORE_ALL:
            missing, unexpected = set(), set()
    return sharded_state_dict, missing, unexpected


__all__ = [
    "StrictHandling",
    "adjust_non_strict_load",
    "check_sharding_integrity",
    "common_state_fingerprints",
    "determine_global_metadata",
    "determine_missing_and_unexpected_keys",
    "find_common_state_differences",
    "find_sharding_problems",
    "gather_and_validate_sharding",
    "maybe_report_missing_and_unexpected_keys",
    "parse_strict_flag",
    "validate_common_state_dict",
    "validate_integrity_and_strict_load",
    "validate_sharded_objects_handling",
    "validate_sharding_integrity",
    "verify_checkpoint_and_load_strategy",
]
