"""Skip the sharding check of a save whose shard metadata is the same as at the last check.

Training saves one structure every N steps. Each rank compares its own shard metadata --
`shard_fields()`: every field the check depends on, one tuple
per shard -- with the copy it kept at the last successful check over the same process group,
exactly (tuple equality, no hash that could collide). The ranks then agree in one small
all-reduce whether *every* rank's metadata is unchanged since the *same* check. Only then is the
gather and the check skipped; any change on any rank -- of keys, shapes, offsets, dtypes,
replica ids, flattened ranges, the order of shards, the rank or the ranks taking part -- checks
in full.

Why this is safe:

* the global metadata is the concatenation of the ranks' shard metadata in rank order, so if no
  rank's metadata and no rank's position changed, the checked structure did not change;
* metadata is recorded only after a check succeeded on every rank (the check raises the same
  error everywhere, so no rank records a failing structure);
* each rank keeps one record per process group, stamped with a generation that the all-reduce
  also compares, so ranks never combine records of different checks (a rank that restarted, or
  dropped its record, has none and forces a full check);
* every rank gets the same answer from the all-reduce, so the ranks never disagree about
  whether to gather (which would hang).

The cache is per process: one record per process group (keyed by the global world size and the
group's members), at most `MAX_GROUPS`, least recently used dropped first. It holds
references to the recorded shards' field values (strings, small tuples), not to the shards or
their data. There is no flag to turn it on or off and nothing to configure: a hit is proof that
the check would pass.

Example:

```text
fields = shard_fields(local_metadata)
if VERDICTS.agree(fields, group) is Agreement.MISS:   # collective: one all-reduce of 4 ints
    ...gather and check...
    VERDICTS.record(fields, group)                     # only after the check passed on every rank
```

A save folds the agreement into the one all-reduce of its validation step
(`dist_ckpt.engine.checks.save_checks`): `VerdictCache.votes()` gives this rank's ints for it,
`VerdictCache.decide()` reads the agreement from the reduced ints.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Dict, List, Optional, Sequence, Tuple

from dist_ckpt.collectives.distributed import ProcessGroup, all_reduce_max, get_rank, group_identity
from dist_ckpt.model.shard_table import ShardFields

__all__ = ["MAX_GROUPS", "VERDICTS", "VOTES", "Agreement", "VerdictCache"]

#: process groups whose last passing check is remembered
MAX_GROUPS = 8

#: how many ints a rank contributes to the agreement's all-reduce (`VerdictCache.votes()`)
VOTES = 4


class Agreement(Enum):
    """What the ranks agreed in `VerdictCache.agree()`."""

    #: every rank's metadata is unchanged since the same passing check: skip the check
    HIT = "hit"
    #: some rank's metadata changed (or is unknown): check in full
    MISS = "miss"
    #: some rank could not describe its shards: exchange its error
    FAILED = "failed"


@dataclass(frozen=True)
class _Record:
    rank: int
    fields: List[ShardFields]
    generation: int


class VerdictCache:
    """Per process group, this rank's shard metadata at the last passing check.

    Args:
        max_groups: records kept (least recently used dropped first).
    """

    def __init__(self, max_groups: int = MAX_GROUPS) -> None:
        self.max_groups = max_groups
        self._records: "OrderedDict[Tuple[int, ...], _Record]" = OrderedDict()
        self._agreed: Dict[Tuple[int, ...], int] = {}
        self._lock = threading.Lock()

    def agree(self, fields: Optional[List[ShardFields]], group: Optional[ProcessGroup] = None) -> Agreement:
        """Collective: whether every rank of ``group`` has ``fields`` recorded from the same passing check.

        ``fields`` is None on a rank that could not describe its shards: then every rank gets
        ``Agreement.FAILED`` (and exchanges the error). Every rank gets the same answer.
        """
        return self.decide(all_reduce_max(self.votes(fields, group), group), group)

    def votes(self, fields: Optional[List[ShardFields]], group: Optional[ProcessGroup] = None) -> List[int]:
        """This rank's `VOTES` ints for `agree()`'s all-reduce (local; no communication).

        With `decide()`, for a caller that folds them into an all-reduce of its own: every rank
        of ``group`` all-reduces (maximum) its votes, in the same place of the same collective,
        and passes the first `VOTES` results to `decide()`.
        """
        key = group_identity(group)
        with self._lock:
            record = self._records.get(key)
            if record is not None:
                self._records.move_to_end(key)
        hit = fields is not None and record is not None and record.rank == get_rank(group) and record.fields == fields
        generation = record.generation if record is not None else 0
        return [int(fields is None), 0 if hit else 1, generation, -generation]

    def decide(self, reduced: Sequence[int], group: Optional[ProcessGroup] = None) -> Agreement:
        """The agreement from the element-wise maximum of every rank's `votes()` (local; the same
        on every rank, since every rank has the same maximum)."""
        failed, miss, newest, minus_oldest = reduced
        with self._lock:
            self._agreed[group_identity(group)] = newest
        if failed:
            return Agreement.FAILED
        return Agreement.HIT if miss == 0 and newest == -minus_oldest else Agreement.MISS

    def record(self, fields: List[ShardFields], group: Optional[ProcessGroup] = None) -> None:
        """Remember ``fields`` after a check passed on every rank (all ranks call it, after `agree()`)."""
        key = group_identity(group)
        with self._lock:
            generation = self._agreed.pop(key, 0) + 1  # the same on every rank: the all-reduced maximum
            self._records[key] = _Record(get_rank(group), list(fields), generation)
            self._records.move_to_end(key)
            while len(self._records) > self.max_groups:
                self._records.popitem(last=False)

    def clear(self) -> None:
        """Forget every recorded check (the next save of every group checks in full)."""
        with self._lock:
            self._records.clear()
            self._agreed.clear()

    def __len__(self) -> int:
        return len(self._records)


#: the process's cache, used by every save (one per process: saves are functions, not objects)
VERDICTS = VerdictCache()
