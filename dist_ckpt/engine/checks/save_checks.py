"""The validation step of a save: sharding and common state, one all-reduce when both are unchanged.

A save with validation checks that the ranks' shards form a valid sharding
(`dist_ckpt.engine.checks.sharding`) and warns when the ranks' common states differ
(`dist_ckpt.engine.checks.common_state`). Training saves one structure every N steps, so the
usual answers are "unchanged since the last passing check" and "the same on every rank". Asked
separately, they cost a small all-reduce each, plus the error exchange that ends the step: three
collectives, each waiting for the slowest rank. `validate_save()` asks everything at once, in
one all-reduce (maximum) of `VOTES` + 2 ints per rank:

* the verdict cache's votes (`VerdictCache.votes()`): whether this rank's shard metadata is
  the one it recorded at the same passing check, and whether this rank *failed* before the
  all-reduce -- describing its shards, running the ``preprocess`` hook or fingerprinting its
  common state (then it votes with no metadata);
* ``digest`` and ``-digest`` of this rank's common-state fingerprints: every rank holds the same
  digest exactly when the maximum of the first equals minus the maximum of the second.

Every rank reads the same answer from the reduced ints, and then:

* some rank failed: every rank exchanges its error (`raise_if_any_rank_failed()`) and raises the
  same one, naming the lowest failing rank, as the separate steps did;
* the sharding is unchanged and the digests are equal: done, nothing else is exchanged;
* otherwise what differs runs in full, as on its own: the sharding is gathered and checked on
  rank 0 (the same ShardingIntegrityError on every rank, or the pass recorded), the fingerprints
  gathered and their differences logged on rank 0 (the same WARNING), inside
  `run_collectively()`, so a failure there reaches every rank too.

So every error `validate_save()` raises has been raised on every rank, and the save runs it
with ``StepMonitor.run(..., exchanges_errors=True)``: no exchange is added after it.

Example:

```python
validate_save(local_metadata, common_state_dict)   # collective; raises or warns as a save does
```
"""

from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Sequence, Tuple

from dist_ckpt.collectives.distributed import all_reduce_max, raise_if_any_rank_failed, run_collectively
from dist_ckpt.engine.checks.common_state import (
    FingerprintDoc,
    fingerprint_common_state,
    report_common_state_differences,
)
from dist_ckpt.engine.checks.sharding import DESCRIBING_SHARDS, check_fields_in_full
from dist_ckpt.engine.checks.verdict_cache import VERDICTS, VOTES, Agreement
from dist_ckpt.engine.steps import Step
from dist_ckpt.model.shard_table import ShardFields, shard_fields
from dist_ckpt.model.sharded import ShardedBase, StateDict

__all__ = ["validate_save"]

logger = logging.getLogger(__name__)


class _Local:
    """What this rank computed before the all-reduce, or the error it failed with and where."""

    def __init__(self) -> None:
        self.fields: Optional[List[ShardFields]] = None
        self.doc: FingerprintDoc = []
        self.digest = 0
        self.error: Optional[Exception] = None
        self.step = DESCRIBING_SHARDS


def _prepare(
    local_metadata: Sequence[ShardedBase],
    common_state_dict: StateDict,
    preprocess: Optional[Callable[[StateDict], StateDict]],
) -> _Local:
    """This rank's shard fields and common-state digest; an error is kept, not raised (the other
    ranks are on their way to the all-reduce, which must carry it)."""
    local = _Local()
    try:
        fields = shard_fields(local_metadata)
        local.step = Step.VALIDATE_SHARDING.value  # where the common state's errors were reported
        to_compare: Any = common_state_dict if preprocess is None else preprocess(common_state_dict)
        local.doc, local.digest = fingerprint_common_state(to_compare)
        local.fields = fields
    except Exception as e:  # noqa: BLE001 -- the other ranks are in the all-reduce below
        local.error = e
    return local


def _agree(local: _Local) -> Tuple[Agreement, bool]:
    """Collective, one all-reduce: what the ranks agree about the sharding, and whether every
    rank's common state has the same digest."""
    votes = VERDICTS.votes(local.fields)  # None on a rank that failed: every rank gets FAILED
    reduced = all_reduce_max([*votes, local.digest, -local.digest])
    newest, minus_oldest = reduced[VOTES:]
    return VERDICTS.decide(reduced[:VOTES]), newest == -minus_oldest


def validate_save(
    local_metadata: Sequence[ShardedBase],
    common_state_dict: StateDict,
    preprocess: Optional[Callable[[StateDict], StateDict]] = None,
) -> None:
    """Collective over the default process group: `gather_and_validate_sharding()` and
    `validate_common_state_dict()` in one, with one all-reduce when nothing changed.

    Every error it raises is raised on every rank (see the module docstring).

    Args:
        local_metadata: this rank's shards (without data).
        common_state_dict: this rank's common state.
        preprocess: applied to the common state before it is compared (the save's
            ``preprocess_common_before_consistancy_check``).

    Raises:
        ShardingIntegrityError: the shards do not form a valid sharding (on every rank).
        CheckpointingException: a rank failed to describe its shards or its common state (on
            every rank, naming it; RankFailedError for an error outside the family; in a world
            of one, the error itself).
    """
    local = _prepare(local_metadata, common_state_dict, preprocess)
    agreement, same_common_state = _agree(local)
    if agreement is Agreement.FAILED:
        raise_if_any_rank_failed(local.error, local.step)
    fields = local.fields
    assert fields is not None  # a rank without fields voted FAILED, raised above
    if agreement is Agreement.HIT and same_common_state:
        logger.debug("sharding unchanged since the last passing check and common state equal on every rank")
        return

    def in_full() -> None:
        if agreement is Agreement.MISS:
            check_fields_in_full(fields)
        if not same_common_state:
            report_common_state_differences(local.doc)

    run_collectively(Step.VALIDATE_SHARDING.value, in_full)
