"""Skip the sharding check of a save whose shard metadata is the same as at the last check.

Training saves one structure every N steps. Each rank fingerprints its own shard metadata (a
blake2b digest of its :class:`~dist_ckpt.engine.shard_table.ShardTable`, its rank and the
group's members); the ranks then agree in one small all-reduce whether *every* rank's
fingerprint equals the one it recorded at the same successful check. Only then is the gather
and the check skipped; any change on any rank -- of keys, shapes, offsets, dtypes, replica ids,
flattened ranges, the order of shards, the rank or the world -- checks in full.

Why this is safe:

* the global metadata is the concatenation of the ranks' tables in rank order, so if no rank's
  table changed, the checked structure did not change;
* a fingerprint is recorded only after a check succeeded on every rank (the check raises the
  same error everywhere, so no rank records a failing structure);
* each rank keeps one fingerprint per process group, stamped with a generation that the
  all-reduce also compares, so ranks never combine fingerprints of different checks (a rank
  that restarted, or dropped its entry, has none and forces a full check);
* every rank gets the same answer from the all-reduce, so the ranks never disagree about
  whether to gather (which would hang).

The cache is per process: one entry per process group (keyed by its members and the world
size), at most :data:`MAX_GROUPS`, least recently used dropped first. There is no flag to turn
it on or off and nothing to configure: a hit is proof that the check would pass.

Example::

    fp = fingerprint(local_table, group)
    if VERDICTS.agree(fp, group) is Agreement.MISS:   # collective, one all-reduce of 4 ints
        ...gather and check...
        VERDICTS.record(fp, group)         # only after the check passed on every rank
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Tuple

from dist_ckpt.engine.distributed import ProcessGroup, all_reduce_max, get_rank, group_identity
from dist_ckpt.engine.shard_table import ShardTable

__all__ = ["MAX_GROUPS", "VERDICTS", "Agreement", "VerdictCache", "fingerprint"]

#: process groups whose last passing check is remembered
MAX_GROUPS = 8
_SALT = b"dist_ckpt shard-table fingerprint v1"


def fingerprint(table: ShardTable, group: Optional[ProcessGroup] = None) -> bytes:
    """A 32-byte digest of this rank's shard table, its rank and ``group``'s members."""
    h = hashlib.blake2b(_SALT, digest_size=32)
    h.update(json.dumps([group_identity(group), get_rank(group), table.keys, table.dtypes]).encode("utf-8"))
    for data in table.column_bytes():
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


class Agreement(Enum):
    """What the ranks agreed in :meth:`VerdictCache.agree`."""

    #: every rank's metadata is unchanged since the same passing check: skip the check
    HIT = "hit"
    #: some rank's metadata changed (or is unknown): check in full
    MISS = "miss"
    #: some rank could not describe its shards: exchange its error
    FAILED = "failed"


@dataclass(frozen=True)
class _Verdict:
    fingerprint: bytes
    generation: int


class VerdictCache:
    """Per process group, the fingerprint of this rank's metadata at the last passing check.

    Args:
        max_groups: entries kept (least recently used dropped first).
    """

    def __init__(self, max_groups: int = MAX_GROUPS) -> None:
        self.max_groups = max_groups
        self._entries: "OrderedDict[Tuple[int, ...], _Verdict]" = OrderedDict()
        self._lock = threading.Lock()
        self._agreed: dict[Tuple[int, ...], int] = {}

    def agree(self, fp: Optional[bytes], group: Optional[ProcessGroup] = None) -> Agreement:
        """Collective: whether every rank of ``group`` has ``fp`` recorded from the same passing check.

        ``fp`` is None on a rank that could not describe its shards: then every rank gets
        ``Agreement.FAILED`` (and exchanges the error). Every rank gets the same answer.
        """
        key = group_identity(group)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        hit = fp is not None and entry is not None and entry.fingerprint == fp
        generation = entry.generation if entry is not None else 0
        failed, miss, newest, minus_oldest = all_reduce_max(
            [int(fp is None), 0 if hit else 1, generation, -generation], group
        )
        with self._lock:
            self._agreed[key] = newest
        if failed:
            return Agreement.FAILED
        return Agreement.HIT if miss == 0 and newest == -minus_oldest else Agreement.MISS

    def record(self, fp: bytes, group: Optional[ProcessGroup] = None) -> None:
        """Remember ``fp`` after a check passed on every rank (all ranks call it, after :meth:`agree`)."""
        key = group_identity(group)
        with self._lock:
            generation = self._agreed.pop(key, 0) + 1  # the same on every rank: the all-reduced maximum
            self._entries[key] = _Verdict(fp, generation)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_groups:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every recorded check (the next save of every group checks in full)."""
        with self._lock:
            self._entries.clear()
            self._agreed.clear()

    def __len__(self) -> int:
        return len(self._entries)


#: the process's cache, used by every save (one per process: saves are functions, not objects)
VERDICTS = VerdictCache()
