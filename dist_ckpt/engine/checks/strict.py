"""Requested keys vs stored keys: the ``StrictHandling`` modes of ``load``."""

from __future__ import annotations

import logging
from enum import Enum
from typing import Any, Iterable, List, Optional, Sequence, Set, Tuple, Union

from dist_ckpt.collectives.distributed import broadcast_json, gather_bytes, get_rank, run_collectively
from dist_ckpt.collectives.shard_metadata import decode_tables
from dist_ckpt.engine.checks.sharding import check_shard_table
from dist_ckpt.errors import (
    MISSING_KEYS,
    UNEXPECTED_KEYS,
    CheckpointingException,
    KeyMismatchError,
    did_you_mean,
    format_keys,
)
from dist_ckpt.model.dict_utils import extract_matching_values, nested_values
from dist_ckpt.model.shard_table import ShardTable, encode_table
from dist_ckpt.model.sharded import ShardedBase, ShardedStateDict

logger = logging.getLogger(__name__)


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
    """Accept a [`StrictHandling`][dist_ckpt.engine.checks.strict.StrictHandling] or its string value."""
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except ValueError as e:
        allowed = ", ".join(m.value for m in StrictHandling)
        raise CheckpointingException(f"invalid strict flag {strict!r}; expected one of: {allowed}") from e


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
    missing_keys: Iterable[str],
    unexpected_keys: Iterable[str],
    raise_error: bool = True,
    stored_keys: Iterable[str] = (),
) -> None:
    """Raise [`KeyMismatchError`][dist_ckpt.errors.KeyMismatchError] (or log at WARNING) describing mismatched keys,
    with the stored keys (``stored_keys``, default the missing ones) that unexpected keys resemble."""
    missing, unexpected = sorted(missing_keys), sorted(unexpected_keys)
    if not missing and not unexpected:
        return
    parts = []
    if unexpected:
        parts.append(
            f"{UNEXPECTED_KEYS} (requested by load but absent from the checkpoint): {format_keys(unexpected)}"
            + did_you_mean(unexpected, stored_keys or missing)
        )
    if missing:
        parts.append(f"{MISSING_KEYS} (in the checkpoint but requested by no rank): {format_keys(missing)}")
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
    missing keys, and shares the outcome. Unexpected keys are found locally on each rank. A
    request that one rank cannot describe (a shard outside its tensor, say) still takes that
    rank through the gather, with an empty blob, and fails in the exchange that follows it, so
    every rank raises the same error instead of the others waiting in the gather.

    Returns:
        ``(sharded_state_dict without unexpected keys, missing_keys, unexpected_keys)``.
    """
    missing: Set[str] = set()
    unexpected: Set[str] = set()
    check_mismatch = StrictHandling.requires_explicit_ckpt_mismatch_check(strict)
    need_global = StrictHandling.requires_global_app_metadata(strict) and check_mismatch
    if check_mismatch and ckpt_sharded_metadata is None:
        raise CheckpointingException("cannot check key mismatches without the checkpoint's sharded metadata")
    gathers = (validate_access_integrity or need_global) and global_metadata is None
    failure: Optional[Exception] = None  # this rank's requests could not be described
    blob = b""  # this rank's table, encoded; empty when it failed (a table never is)
    try:
        if local_metadata is None:
            local_metadata = [
                sh.without_data() for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedBase)
            ]
        if gathers:
            blob = encode_table(ShardTable.from_shards(local_metadata))
    except Exception as e:  # noqa: BLE001 -- raised in the exchange after the gather, on every rank
        if not gathers:
            raise  # the other ranks' next collective is an exchange: it reports this error
        local_metadata, failure = [], e

    if validate_access_integrity or need_global:
        # every rank's requests reach rank 0 as compact tables (see collectives/shard_metadata.py)
        blobs = gather_bytes(blob) if gathers else None

        def check_on_rank0() -> List[str]:
            if failure is not None:
                raise failure
            if get_rank() != 0 or (blobs is not None and not all(blobs)):  # a rank that failed reports why
                return []
            if global_metadata is not None:
                table, world_size = ShardTable.from_global(global_metadata), len(global_metadata)
            else:
                assert blobs is not None
                table, world_size = decode_tables(blobs), len(blobs)
            if validate_access_integrity:
                check_shard_table(table, world_size)
            if need_global:
                assert ckpt_sharded_metadata is not None
                return sorted({sh.key for sh in ckpt_sharded_metadata.values()} - set(table.keys))
            return []

        missing = set(broadcast_json(run_collectively("validating the load request", check_on_rank0)))

    if check_mismatch:
        assert ckpt_sharded_metadata is not None
        unexpected = determine_missing_and_unexpected_keys(ckpt_sharded_metadata, local_metadata)[1]
        sharded_state_dict = adjust_non_strict_load(sharded_state_dict, unexpected)

        stored = {sh.key for sh in ckpt_sharded_metadata.values()}

        def report() -> None:
            if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
                maybe_report_missing_and_unexpected_keys(missing, unexpected, raise_error=True, stored_keys=stored)
            elif strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
                maybe_report_missing_and_unexpected_keys(missing, unexpected, raise_error=False, stored_keys=stored)
            elif strict == StrictHandling.IGNORE_ALL and (missing or unexpected):
                logger.info("strict=IGNORE_ALL: skipping %d requested keys absent from the checkpoint", len(unexpected))

        run_collectively("matching requested keys against the checkpoint", report)
        if strict == StrictHandling.IGNORE_ALL:
            missing, unexpected = set(), set()
    return sharded_state_dict, missing, unexpected


__all__ = [
    "StrictHandling",
    "adjust_non_strict_load",
    "determine_missing_and_unexpected_keys",
    "maybe_report_missing_and_unexpected_keys",
    "parse_strict_flag",
    "validate_integrity_and_strict_load",
]
