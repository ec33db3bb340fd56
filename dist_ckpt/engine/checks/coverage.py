"""The sharding check, vectorized: every problem of a `ShardTable`.

Rank 0 runs it on every rank's shard metadata at each save, so it must stay fast at a million
shards: every step is a numpy operation over the table's columns, and Python runs only per
problem found (to word its message). The verdicts and messages are those of the per-shard
definition, key by key in sorted order:

1. a key that is a ShardedTensor on some ranks and a ShardedObject on others;
2. ranks that disagree on a tensor's global shape, dtype, local shape (prepended axes included)
   or prepend_axis_num, or an object's global shape (the first attribute that differs, the
   first rank that differs from the first shard of the key);
3. a tensor held as flattened ranges by some ranks and as whole shards by others;
4. (a tensor of zero elements has no other problem) a local size that does not divide the
   global size;
5. coverage: the main replicas' chunks on the regular grid of the tensor (objects: the grid of
   objects). A chunk held by several main replicas overlaps; with flattened ranges, the ranges
   of each chunk must tile it (an overlap or a gap per range, a gap at its end); chunks that no
   main replica holds are a gap, reported once with the first missing chunk in row-major order.

Chunk positions are linear indices on each tensor's grid. A grid too large for 64-bit linear
indices (more than 2**62 chunks: only metadata that cannot be valid has it) is ranked by the
chunks its shards hold instead, which orders them the same way.

Example:

```python
find_table_problems(ShardTable.from_global(global_metadata))   # [] for a valid sharding
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import numpy as np

from dist_ckpt.model.shard_table import KIND_OBJECT, SIG, ShardTable, dtype_from_token

__all__ = ["FLATTENED_GAP", "find_table_problems"]

#: bound on products and combined sort keys computed in int64
_SAFE = 1 << 62
#: Megatron-Core's words for a gap between flattened ranges (spelling included): callers match on them
FLATTENED_GAP = "Flattened ranges dont cover the whole shard"


def _ints(values: np.ndarray) -> Tuple[int, ...]:
    return tuple(int(v) for v in values)


def _ids(rows: np.ndarray) -> np.ndarray:
    """A small int per distinct row of ``rows`` (equal rows, equal ids)."""
    if rows.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    return np.unique(rows, axis=0, return_inverse=True)[1].reshape(-1)


def _unravel(linear: int, grid: Tuple[int, ...]) -> Tuple[int, ...]:
    out = []
    for size in reversed(grid):
        linear, i = divmod(linear, size)
        out.append(i)
    return tuple(reversed(out))


@dataclass
class _Groups:
    """Main-replica rows sorted by chunk, split into runs of one chunk each."""

    rows: np.ndarray  # row indices into the table, sorted
    starts: np.ndarray  # start of each run in ``rows``
    key: np.ndarray  # key of each run
    lin: np.ndarray  # chunk position of each run on its key's grid (or its rank among held chunks)

    @classmethod
    def of(cls, rows: np.ndarray, comb: np.ndarray, key: np.ndarray, lin: np.ndarray) -> "_Groups":
        new = np.ones(len(rows), dtype=bool)
        new[1:] = comb[1:] != comb[:-1]
        starts = np.flatnonzero(new)
        return cls(rows, starts, key[starts], lin[starts])

    def sizes(self) -> np.ndarray:
        return np.diff(np.append(self.starts, len(self.rows)))


class _Checker:
    """One run of the check: per-key arrays, then each step of the module docstring."""

    def __init__(self, table: ShardTable) -> None:
        self.t = table
        self.width = table.width
        self.found: Dict[int, List[str]] = {}
        nkeys = len(table.keys)
        small = np.int16 if nkeys < 2**15 else np.int32 if nkeys < 2**31 else np.int64
        self.key = table.key.astype(small)
        self.sig = table.sig.astype(np.int64)
        self.sigs = table.sigs.astype(np.int64)
        self.order = np.argsort(self.key, kind="stable")  # rows by key, each key in rank order
        self.counts = np.bincount(self.key, minlength=nkeys)
        self.starts = np.concatenate(([0], np.cumsum(self.counts)[:-1]))
        present = self.counts > 0
        self.first = np.where(present, self.order[np.minimum(self.starts, max(len(self.order) - 1, 0))], -1)
        self.ref = np.where(present, self.sig[self.first], 0)  # the signature of each key's first shard
        self.active = present.copy()
        self.is_object = self.sigs[self.ref, SIG.KIND] == KIND_OBJECT

    def rows_of(self, k: int) -> np.ndarray:
        return self.order[self.starts[k] : self.starts[k] + self.counts[k]]

    def name(self, k: int) -> str:
        return repr(self.t.keys[k])

    def report(self, k: int, message: str) -> None:
        self.found.setdefault(k, []).append(message)

    def problems(self) -> List[str]:
        self.kinds()
        self.differences()
        self.flat_mix()
        self.tiling()
        self.coverage()
        return [m for k in sorted(self.found, key=lambda k: self.t.keys[k]) for m in self.found[k]]

    # ----------------------------------------------------------------------- steps 1 to 4

    def kinds(self) -> None:
        kind = self.sigs[self.sig, SIG.KIND][self.order]
        present = np.flatnonzero(self.counts > 0)
        lo = np.minimum.reduceat(kind, self.starts[present])
        hi = np.maximum.reduceat(kind, self.starts[present])
        for k in present[lo != hi]:
            rows = self.rows_of(int(k))
            is_obj = self.sigs[self.sig[rows], SIG.KIND] == KIND_OBJECT
            tensors = sorted({int(r) for r in self.t.rank[rows[~is_obj]]})
            objects = sorted({int(r) for r in self.t.rank[rows[is_obj]]})
            self.report(
                int(k),
                f"{self.name(int(k))} is a ShardedTensor on ranks {tensors} and a ShardedObject on ranks {objects}",
            )
            self.active[k] = False

    def differences(self) -> None:
        d, s = self.width, self.sigs
        ndim = s[:, [SIG.NDIM]]
        attrs = [
            ("global_shape", _ids(np.hstack([ndim, s[:, SIG.global_(d)]]))),
            ("dtype", s[:, SIG.DTYPE]),
            ("full_local_shape", _ids(np.hstack([ndim, s[:, SIG.local(d)]]))),
            ("prepend_axis_num", s[:, SIG.PREPEND]),
        ]
        checked = _ids(np.column_stack([a for _, a in attrs]))
        differs = checked[self.sig] != checked[self.ref[self.key]]
        for key in np.unique(self.key[differs]):
            k = int(key)
            if not self.active[k]:
                continue
            rows = self.rows_of(k)
            for attr, ids in attrs[:1] if self.is_object[k] else attrs:
                mismatch = ids[self.sig[rows]] != ids[self.sig[rows[0]]]
                if mismatch.any():
                    other = rows[int(np.argmax(mismatch))]
                    self.report(
                        k,
                        f"{self.name(k)}: {attr} differs between ranks: rank {int(self.t.rank[rows[0]])} has "
                        f"{self.attr_value(attr, int(self.sig[rows[0]]))}, rank {int(self.t.rank[other])} has "
                        f"{self.attr_value(attr, int(self.sig[other]))}",
                    )
                    break
            self.active[k] = False

    def attr_value(self, attr: str, sig: int) -> object:
        row, d = self.sigs[sig], int(self.sigs[sig, SIG.NDIM])
        if attr == "global_shape":
            return _ints(row[SIG.global_(self.width)][:d])
        if attr == "full_local_shape":
            return _ints(row[SIG.local(self.width)][:d])
        if attr == "dtype":
            return dtype_from_token(self.t.dtypes[int(row[SIG.DTYPE])])
        return int(row[SIG.PREPEND])

    def flat_mix(self) -> None:
        flat = (self.t.flat[:, 0] >= 0).astype(np.int64)
        nflat = np.bincount(self.key, weights=flat, minlength=len(self.counts)).astype(np.int64)
        mixed = self.active & (nflat > 0) & (nflat < self.counts)
        for k in np.flatnonzero(mixed):
            rows = self.rows_of(int(k))
            ranks = [int(r) for r in self.t.rank[rows[flat[rows] == 1]]]
            self.report(
                int(k),
                f"{self.name(int(k))}: ranks {ranks} hold flattened shards and other ranks hold whole shards; "
                f"use one form per tensor",
            )
        self.active &= ~mixed
        self.flat_key = nflat > 0

    def tiling(self) -> None:
        d = self.width
        self.glob = self.sigs[self.ref][:, SIG.global_(d)]
        self.chunk = self.sigs[self.ref][:, SIG.local(d)]
        tensor = self.active & ~self.is_object
        self.active &= ~(tensor & (self.glob == 0).any(axis=1))  # nothing to cover
        bad = (self.chunk == 0) | (self.glob % np.maximum(self.chunk, 1) != 0)
        for k in np.flatnonzero(self.active & ~self.is_object & bad.any(axis=1)):
            axis = int(np.argmax(bad[k]))
            glob = self.shape(self.glob, int(k))
            self.report(
                int(k),
                f"{self.name(int(k))}: global size {glob[axis]} along axis {axis} is not a multiple of the local "
                f"size {int(self.chunk[k, axis])}; equal shards cannot tile global shape {glob}",
            )
            self.active[k] = False

    def shape(self, table: np.ndarray, k: int) -> Tuple[int, ...]:
        return _ints(table[k, : int(self.sigs[self.ref[k], SIG.NDIM])])

    # ----------------------------------------------------------------------- step 5

    def coverage(self) -> None:
        keys = np.flatnonzero(self.active)
        if len(keys) == 0:
            return
        grid = np.ones_like(self.glob)
        grid[keys] = self.glob[keys] // self.chunk[keys]
        self.grid = grid
        huge = np.zeros(len(self.counts), dtype=bool)
        huge[keys] = np.prod(grid[keys].astype(np.float64), axis=1) >= _SAFE
        self.huge = huge
        # row-major strides (exact in int64 where the grid is not huge)
        strides = np.ones_like(grid)
        for axis in range(self.width - 2, -1, -1):
            strides[:, axis] = np.where(huge, 1, strides[:, axis + 1] * grid[:, axis + 1])
        rows = np.flatnonzero((self.t.main != 0) & self.active[self.key])
        key = self.key[rows].astype(np.int64)
        idx = self.t.offset[rows].astype(np.int64) // self.chunk[key]
        inside = (idx < grid[key]).all(axis=1)
        for r in rows[~inside]:
            self.outside(int(r))
        rows, key, idx = rows[inside], key[inside], idx[inside]
        lin = (idx * strides[key]).sum(axis=1)
        held_huge = huge[key]
        if held_huge.any():
            lin[held_huge] = _ids(np.column_stack([key[held_huge], idx[held_huge]]))
        span = int(lin.max()) + 1 if len(lin) else 1
        if span * len(self.counts) < _SAFE:
            comb = key * span + lin
        else:  # dense ranks of (key, lin): same order, no overflow
            comb = _ids(np.column_stack([key, lin]))
        flat = self.flat_key[key]
        self.whole_groups(rows[~flat], comb[~flat], key[~flat], lin[~flat])
        self.flat_groups(rows[flat], comb[flat], key[flat], lin[flat])
        self.gaps(keys)

    def outside(self, r: int) -> None:
        k = int(self.key[r])
        self.report(
            k,
            f"{self.name(k)}: the shard of rank {int(self.t.rank[r])} at global offset "
            f"{_ints(self.t.offset[r, : int(self.sigs[self.ref[k], SIG.NDIM])])} lies outside global shape "
            f"{self.shape(self.glob, k)}",
        )

    def chunk_offset(self, k: int, position: Tuple[int, ...]) -> Tuple[int, ...]:
        return tuple(i * c for i, c in zip(position, self.shape(self.chunk, k)))

    def position(self, group: _Groups, g: int) -> Tuple[int, ...]:
        r = int(group.rows[group.starts[g]])
        k = int(group.key[g])
        return _ints(self.t.offset[r, : int(self.sigs[self.ref[k], SIG.NDIM])] // self.chunk[k, : self.ndim(k)])

    def ndim(self, k: int) -> int:
        return int(self.sigs[self.ref[k], SIG.NDIM])

    def whole_groups(self, rows: np.ndarray, comb: np.ndarray, key: np.ndarray, lin: np.ndarray) -> None:
        order = np.argsort(comb, kind="stable")  # ties keep rank order
        groups = _Groups.of(rows[order], comb[order], key[order], lin[order])
        self.groups = [groups]
        sizes = groups.sizes()
        for g in np.flatnonzero(sizes > 1):
            k = int(groups.key[g])
            members = groups.rows[groups.starts[g] : groups.starts[g] + sizes[g]]
            ranks = [int(r) for r in self.t.rank[members]]
            position = self.position(groups, int(g))
            if self.is_object[k]:
                self.report(k, f"{self.name(k)}: object shard {position} is a main replica on ranks {ranks} (overlap)")
            else:
                self.report(
                    k,
                    f"{self.name(k)}: the shard at global offset {self.chunk_offset(k, position)} is a main replica "
                    f"on ranks {ranks} (overlap); give all but one a non-zero replica_id",
                )

    def flat_groups(self, rows: np.ndarray, comb: np.ndarray, key: np.ndarray, lin: np.ndarray) -> None:
        start, stop = self.t.flat[rows, 0].astype(np.int64), self.t.flat[rows, 1].astype(np.int64)
        order = np.lexsort((stop, start, comb))  # stable: ties stay in row order, which is rank order
        rows, comb, key, lin, start, stop = rows[order], comb[order], key[order], lin[order], start[order], stop[order]
        groups = _Groups.of(rows, comb, key, lin)
        self.groups.append(groups)
        if len(rows) == 0:
            return
        gid = np.cumsum(np.append(1, comb[1:] != comb[:-1])) - 1
        before, end = _running_max(gid, stop, groups.starts)
        numel = np.prod(self.chunk[groups.key], axis=1)
        events: List[Tuple[int, int, int, str]] = []  # (group, position in group, key, message)
        for i in np.flatnonzero(start != before):
            g, k = int(gid[i]), int(key[i])
            where = f"the chunk at global offset {self.chunk_offset(k, self.position(groups, g))}"
            a, b, pos = int(start[i]), int(stop[i]), int(before[i])
            if a < pos:
                text = (
                    f"{self.name(k)}: flattened ranges overlap in {where}: rank {int(self.t.rank[rows[i]])} "
                    f"holds [{a}, {b}) but elements up to {pos} are already held"
                )
            else:
                text = f"{self.name(k)}: {FLATTENED_GAP}: no rank holds flat elements [{pos}, {a}) of {where}"
            events.append((g, int(i), k, text))
        for tail in np.flatnonzero(end < numel):
            k = int(groups.key[tail])
            where = f"the chunk at global offset {self.chunk_offset(k, self.position(groups, int(tail)))}"
            text = (
                f"{self.name(k)}: {FLATTENED_GAP}: no rank holds flat elements [{int(end[tail])}, "
                f"{int(numel[tail])}) of {where}"
            )
            events.append((int(tail), len(rows), k, text))
        for _, _, k, text in sorted(events, key=lambda e: (e[0], e[1])):
            self.report(k, text)

    def gaps(self, keys: np.ndarray) -> None:
        """Step 5's gap: chunks held by no main replica, with the first one in row-major order."""
        owners = np.zeros(len(self.counts), dtype=np.int64)
        first_missing: Dict[int, int] = {}
        for groups in self.groups:
            owners += np.bincount(groups.key.astype(np.int64), minlength=len(owners))
            first_missing.update(_first_missing(groups))
        total64 = np.prod(self.grid[keys], axis=1)  # exact where the grid is not huge
        short = keys[self.huge[keys] | (owners[keys] < total64)]  # only these can have a gap
        for key in short:
            k = int(key)
            grid = self.shape(self.grid, k)
            total = 1
            for g in grid:
                total *= g
            if owners[k] >= total:
                continue
            if self.huge[k]:
                position = _first_missing_huge(self.held(k), grid)
            else:
                position = _unravel(first_missing.get(k, int(owners[k])), grid)
            missing = total - int(owners[k])
            if self.is_object[k]:
                self.report(
                    k,
                    f"{self.name(k)}: no main replica holds object shard {position}; {missing} of {total} are missing",
                )
            else:
                self.report(
                    k,
                    f"{self.name(k)}: no main replica holds the shard at global offset "
                    f"{self.chunk_offset(k, position)} (shape {self.shape(self.chunk, k)}); {missing} of {total} "
                    f"shards are missing (gap in coverage)",
                )

    def held(self, k: int) -> List[Tuple[int, ...]]:
        """The chunk positions held by main replicas of key ``k``, sorted."""
        held = set()
        for groups in self.groups:
            for g in np.flatnonzero(groups.key == k):
                held.add(self.position(groups, int(g)))
        return sorted(held)


def _running_max(gid: np.ndarray, stop: np.ndarray, starts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Per sorted row, the largest ``stop`` of the rows before it in its group (0 for the first);
    per group, the largest ``stop`` of all its rows."""
    span = int(stop.max()) + 1
    if (int(gid[-1]) + 1) * span < _SAFE:
        shifted = gid * span + stop
        running = np.maximum.accumulate(shifted)
        before = np.maximum(np.concatenate(([-1], running[:-1])) - gid * span, 0)
        ends = np.append(starts[1:], len(gid)) - 1
        return before, running[ends] - gid[ends] * span
    before = np.zeros_like(stop)
    end = np.zeros(len(starts), dtype=np.int64)
    bounds = np.append(starts, len(gid))
    for g in range(len(starts)):
        part = np.maximum.accumulate(stop[bounds[g] : bounds[g + 1]])
        before[bounds[g] + 1 : bounds[g + 1]] = part[:-1]
        end[g] = part[-1]
    return before, end


def _first_missing(groups: _Groups) -> Dict[int, int]:
    """Per key of ``groups`` whose held chunks are not 0, 1, 2, ...: the first position missing."""
    if len(groups.key) == 0:
        return {}
    new_key = np.ones(len(groups.key), dtype=bool)
    new_key[1:] = groups.key[1:] != groups.key[:-1]
    key_start = np.maximum.accumulate(np.where(new_key, np.arange(len(groups.key)), 0))
    expected = np.arange(len(groups.key)) - key_start
    skipped = np.flatnonzero(groups.lin != expected)
    found: Dict[int, int] = {}
    for i in skipped:
        found.setdefault(int(groups.key[i]), int(expected[i]))
    return found


def _first_missing_huge(held: List[Tuple[int, ...]], grid: Tuple[int, ...]) -> Tuple[int, ...]:
    """The first position of ``grid`` in row-major order that is not in the sorted ``held``."""
    for i, position in enumerate(held):
        expected = _unravel(i, grid)
        if position != expected:
            return expected
    return _unravel(len(held), grid)


def find_table_problems(table: ShardTable) -> List[str]:
    """Every way in which the shards of ``table`` fail to form a valid sharding (pure).

    The same verdicts and messages as the per-shard definition (see the module docstring).
    """
    return _Checker(table).problems() if len(table) else []
