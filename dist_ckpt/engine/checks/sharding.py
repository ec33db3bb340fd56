"""Sharding integrity: the main replicas of every tensor cover it exactly once, with one shape and dtype.

Pure functions over per-rank metadata, and the collective check a save runs: each rank sends its
shard metadata to rank 0 once, as a compact binary table (`dist_ckpt.collectives.shard_metadata`),
rank 0 checks every rank's table at once (`dist_ckpt.engine.checks.coverage`), and the
verdict reaches every rank. A save whose shard metadata is unchanged since the last passing check
skips the gather (`dist_ckpt.engine.checks.verdict_cache`): one all-reduce of 4 ints (which a save
folds into the one all-reduce of its validation step: `dist_ckpt.engine.checks.save_checks`).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

from dist_ckpt.collectives.distributed import (
    ProcessGroup,
    gather_bytes,
    get_rank,
    get_world_size,
    raise_if_any_rank_failed,
    run_collectively,
)
from dist_ckpt.collectives.shard_metadata import all_gather_metadata, decode_tables
from dist_ckpt.engine.checks.common_state import validate_common_state_dict
from dist_ckpt.engine.checks.coverage import FLATTENED_GAP, find_table_problems
from dist_ckpt.engine.checks.verdict_cache import VERDICTS, Agreement
from dist_ckpt.errors import CheckpointingException, ShardingIntegrityError, format_problems
from dist_ckpt.model.dict_utils import nested_values
from dist_ckpt.model.shard_table import ShardFields, ShardTable, encode_table, shard_fields
from dist_ckpt.model.sharded import ShardedBase, ShardedStateDict

logger = logging.getLogger(__name__)

GlobalMetadata = List[List[ShardedBase]]

#: the step named in the error of a rank that could not describe its shards
DESCRIBING_SHARDS = "describing the shards"


def find_sharding_problems(global_metadata: Sequence[Sequence[ShardedBase]]) -> List[str]:
    """Every way in which the ranks' shards fail to form a valid sharding (pure).

    Main replicas of each tensor must cover it exactly once (no overlap, no gap), and every
    rank must agree on global shape, dtype and local shape; likewise for ShardedObjects. The
    check itself is vectorized (`dist_ckpt.engine.checks.coverage`); this builds its table
    from ShardedBase lists (Megatron-Core's ``global_metadata``: ``global_metadata[r]`` is rank r's).
    """
    return find_table_problems(ShardTable.from_global(global_metadata))


def _integrity_error(problems: Sequence[str], world_size: int) -> ShardingIntegrityError:
    return ShardingIntegrityError(f"invalid sharding across {world_size} ranks: {format_problems(problems)}")


def check_sharding_integrity(global_metadata: Sequence[Sequence[ShardedBase]]) -> None:
    """Raise [`ShardingIntegrityError`][dist_ckpt.errors.ShardingIntegrityError] listing the problems (pure, no
    communication)."""
    problems = find_sharding_problems(global_metadata)
    if problems:
        raise _integrity_error(problems, len(global_metadata))


def determine_global_metadata(
    sharded_state_dict: ShardedStateDict, group: Optional[ProcessGroup] = None
) -> Tuple[List[ShardedBase], GlobalMetadata]:
    """This rank's shard metadata, and every rank's (all-gathered as compact binary tables)."""
    local_metadata = [sh.without_data() for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedBase)]
    return local_metadata, all_gather_metadata(local_metadata, group)


def validate_sharding_integrity(
    global_metadata: Optional[Sequence[Sequence[ShardedBase]]], common_state_dict: Optional[Dict[str, Any]] = None
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


def check_shard_table(table: ShardTable, world_size: int) -> None:
    """Raise [`ShardingIntegrityError`][dist_ckpt.errors.ShardingIntegrityError] listing the problems of every rank's
    ``table`` (pure)."""
    problems = find_table_problems(table)
    if problems:
        raise _integrity_error(problems, world_size)


def gather_and_validate_sharding(local_metadata: Sequence[ShardedBase], group: Optional[ProcessGroup] = None) -> None:
    """Collective: gather shard metadata to rank 0 only, validate there, raise everywhere.

    Steps:

    1. this rank's metadata becomes one tuple of fields per shard (one C-level pass);
    2. one all-reduce: if every rank's fields equal the ones it kept at the same passing check
       over ``group``, stop here (the structure is unchanged, the verdict is known);
    3. the tables are gathered to rank 0 (bytes, not JSON objects), which checks them all at once;
    4. the verdict is exchanged: the same ShardingIntegrityError on every rank, or a pass, after
       which every rank records its fields.
    """
    try:
        fields: Optional[List[ShardFields]] = shard_fields(local_metadata)
        error: Optional[Exception] = None
    except Exception as e:  # noqa: BLE001 -- the other ranks are in the all-reduce below
        fields, error = None, e
    agreement = VERDICTS.agree(fields, group)
    if agreement is Agreement.FAILED or fields is None:
        raise_if_any_rank_failed(error, DESCRIBING_SHARDS, group)
    if agreement is Agreement.HIT:
        logger.debug("sharding unchanged since the last passing check; not checked again")
        return
    assert fields is not None  # FAILED raised above
    check_fields_in_full(fields, group)


def check_fields_in_full(fields: List[ShardFields], group: Optional[ProcessGroup] = None) -> None:
    """Collective: steps 3 and 4 of `gather_and_validate_sharding()`, after the ranks agreed to
    check in full: gather every rank's ``fields`` (``shard_fields()`` of its metadata) to rank 0
    as tables, check them there, raise the same error on every rank or record the pass."""
    blobs = gather_bytes(encode_table(ShardTable.from_fields(fields, get_rank(group))), group=group)

    def check() -> None:
        if blobs is not None:
            check_shard_table(decode_tables(blobs), get_world_size(group))

    run_collectively("validating the sharding", check, group)
    VERDICTS.record(fields, group)


__all__ = [
    "DESCRIBING_SHARDS",
    "FLATTENED_GAP",
    "GlobalMetadata",
    "check_fields_in_full",
    "check_shard_table",
    "check_sharding_integrity",
    "determine_global_metadata",
    "find_sharding_problems",
    "gather_and_validate_sharding",
    "validate_sharding_integrity",
]
