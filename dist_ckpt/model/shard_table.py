"""Shard metadata as columns: what ranks exchange for validation, and what rank 0 checks.

A rank's ShardedTensors and ShardedObjects (data excluded) become one `ShardTable`: a key
table, a dtype table, a small table of *signatures* (kind, dtype, prepend_axis_num,
allow_shape_mismatch, global shape, local shape with the prepended axes, axis fragmentations:
what a tensor's shards usually share) and one row per shard (key, signature, global offset,
flattened range, main-replica flag, rank, replica id). Many ranks' tables concatenate into one
(`concat_tables()`), whose columns the vectorized sharding check reads
(`dist_ckpt.engine.checks.coverage`), so rank 0 never builds a Python object per shard.

Shapes are padded to the table's widest rank ``D``: global and local shapes with 1, offsets and
fragmentations with 0; ``ndim`` says how many entries are real.

Example:

```python
table = ShardTable.from_shards(local_metadata, rank=3)
blob = encode_table(table)                       # bytes, a few dozen per shard
again = decode_table(blob, rank=3, where="rank 3's shard metadata")
```
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Any, Dict, List, MutableMapping, Optional, Sequence, Tuple

import numpy as np
import torch

from dist_ckpt.errors import CorruptCheckpointError
from dist_ckpt.model.columns import pack_columns, unpack_columns
from dist_ckpt.model.sharded import ShardedBase, ShardedObject, ShardedTensor

__all__ = [
    "KIND_OBJECT",
    "KIND_TENSOR",
    "SIG",
    "ShardFields",
    "ShardTable",
    "concat_tables",
    "decode_table",
    "dtype_from_token",
    "dtype_token",
    "encode_table",
    "shard_fields",
]

KIND_TENSOR = 0
KIND_OBJECT = 1
_FORMAT = "dist_ckpt.shard_table"
_VERSION = 1


class SIG:
    """Column positions in a signature row: 6 scalars, then ``D`` global sizes, ``D`` local
    sizes (prepended axes included) and ``D`` axis fragmentations."""

    KIND, DTYPE, PREPEND, ALLOW, NDIM, HAS_FRAGM = range(6)
    SCALARS = 6

    @staticmethod
    def global_(d: int) -> slice:
        return slice(SIG.SCALARS, SIG.SCALARS + d)

    @staticmethod
    def local(d: int) -> slice:
        return slice(SIG.SCALARS + d, SIG.SCALARS + 2 * d)

    @staticmethod
    def fragm(d: int) -> slice:
        return slice(SIG.SCALARS + 2 * d, SIG.SCALARS + 3 * d)


def dtype_token(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` for any torch dtype (storable or not)."""
    return str(dtype).rsplit(".", 1)[-1]


def dtype_from_token(token: str) -> torch.dtype:
    """Inverse of `dtype_token()`."""
    dtype = getattr(torch, token, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {token!r} in exchanged shard metadata")
    return dtype


@dataclass
class ShardTable:
    """Shard metadata of one or more ranks, as columns (see the module docstring).

    Attributes:
        keys: the key table; ``key`` indexes it.
        dtypes: dtype tokens (`dtype_token()`); a signature's DTYPE indexes it (-1: object).
        sigs: ``(S, 6 + 3 * D)`` signature rows (`SIG` says which column is what).
        key: ``(N,)`` key of each shard.
        sig: ``(N,)`` signature of each shard.
        offset: ``(N, D)`` global offset (ShardedObject: position in the grid of objects).
        flat: ``(N, 2)`` flattened range ``[start, stop)``, ``-1`` for none.
        main: ``(N,)`` 1 for a main replica (the one that is saved).
        rank: ``(N,)`` rank that holds the shard.
        replica_len: ``(N,)`` length of a tuple replica id, -1 for an int.
        replica: the replica ids' values, concatenated (one per int replica id).
    """

    keys: List[str]
    dtypes: List[str]
    sigs: np.ndarray
    key: np.ndarray
    sig: np.ndarray
    offset: np.ndarray
    flat: np.ndarray
    main: np.ndarray
    rank: np.ndarray
    replica_len: np.ndarray
    replica: np.ndarray

    @property
    def width(self) -> int:
        """``D``: the widest number of axes."""
        return int(self.offset.shape[1])

    def __len__(self) -> int:
        return int(self.key.shape[0])

    @classmethod
    def from_shards(cls, shards: Sequence[ShardedBase], rank: int = 0) -> "ShardTable":
        """The table of one rank's shards (data is ignored)."""
        return _Builder(shard_fields(shards)).table(rank)

    @classmethod
    def from_fields(cls, fields: Sequence[ShardFields], rank: int = 0) -> "ShardTable":
        """The table of one rank's `shard_fields()`."""
        return _Builder(fields).table(rank)

    @classmethod
    def from_global(cls, global_metadata: Sequence[Sequence[ShardedBase]]) -> "ShardTable":
        """The table of every rank's shards (``global_metadata[r]`` is rank r's list)."""
        return concat_tables([cls.from_shards(shards, rank) for rank, shards in enumerate(global_metadata)])

    def to_shards(self, world_size: int) -> List[List[ShardedBase]]:
        """Per rank, the ShardedTensors and ShardedObjects (``data=None``) of the table's rows.

        O(rows) Python objects: the exchange and the checks never need it; Megatron-Core's API
        (``determine_global_metadata``) does.
        """
        out: List[List[ShardedBase]] = [[] for _ in range(world_size)]
        ends = np.cumsum(np.where(self.replica_len < 0, 1, self.replica_len))
        dtypes = [dtype_from_token(t) for t in self.dtypes]
        for i in range(len(self)):
            out[int(self.rank[i])].append(self._shard(i, int(ends[i]), dtypes))
        return out

    def _shard(self, i: int, end: int, dtypes: List[torch.dtype]) -> ShardedBase:
        s = self.sigs[int(self.sig[i])]
        d = int(s[SIG.NDIM])
        n = int(self.replica_len[i])
        values = tuple(int(v) for v in self.replica[end - max(n, 1) : end])
        replica_id: Any = values[0] if n < 0 else values[:n]
        glob = tuple(int(v) for v in s[SIG.global_(self.width)][:d])
        offset = tuple(int(v) for v in self.offset[i, :d])
        key = self.keys[int(self.key[i])]
        if s[SIG.KIND] == KIND_OBJECT:
            return ShardedObject(key, None, glob, offset, replica_id)
        prepend = int(s[SIG.PREPEND])
        local = tuple(int(v) for v in s[SIG.local(self.width)][prepend:d])
        fragm = tuple(int(v) for v in s[SIG.fragm(self.width)][:d]) if s[SIG.HAS_FRAGM] else None
        start, stop = (int(v) for v in self.flat[i])
        return ShardedTensor(
            key,
            None,
            dtypes[int(s[SIG.DTYPE])],
            local,
            glob,
            offset,
            fragm,
            replica_id,
            prepend,
            bool(s[SIG.ALLOW]),
            None if start < 0 else slice(start, stop),
        )


_TENSOR_FIELDS = attrgetter(
    "key",
    "dtype",
    "prepend_axis_num",
    "allow_shape_mismatch",
    "global_shape",
    "local_shape",
    "axis_fragmentations",
    "global_offset",
    "flattened_range",
    "replica_id",
)


#: what :func:`shard_fields` returns per shard: immutable values (str, ints, tuples, a dtype, a slice)
ShardFields = Tuple[Any, ...]


def _fields(sh: ShardedBase) -> ShardFields:
    """The fields of a shard in `_TENSOR_FIELDS` order; an object has dtype None."""
    if isinstance(sh, ShardedTensor):
        return _TENSOR_FIELDS(sh)
    if isinstance(sh, ShardedObject):
        return (sh.key, None, 0, False, sh.global_shape, (), None, sh.global_offset, None, sh.replica_id)
    raise TypeError(f"cannot describe {type(sh).__name__} ({getattr(sh, 'key', sh)!r}) as shard metadata")


def shard_fields(shards: Sequence[ShardedBase]) -> List[ShardFields]:
    """Every field of every shard that the sharding check depends on, as one tuple per shard.

    Two lists are equal exactly when the shards have the same keys, kinds, dtypes, shapes,
    offsets, axis fragmentations, replica ids, prepended axes, shape-mismatch flags and
    flattened ranges, in the same order (what the check of an unchanged structure compares).
    When every shard is a ShardedTensor this is one C-level pass.

    Raises:
        TypeError: a shard is neither a ShardedTensor nor a ShardedObject.
    """
    if all(type(sh) is ShardedTensor for sh in shards):
        return list(map(_TENSOR_FIELDS, shards))
    return [_fields(sh) for sh in shards]


class _Builder:
    """The columns of one rank's shards.

    A save describes every shard of every rank, repeated or not, so this runs once per shard
    per save: the per-shard work is a C-level attribute fetch and a few dict lookups, the rest
    is done per distinct key and signature.
    """

    def __init__(self, rows: Sequence[ShardFields]) -> None:
        self.n = len(rows)
        columns = list(zip(*rows)) if rows else [()] * 10
        keys, dtypes, prepend, allow, glob, local, fragm, offsets, flat, replica = columns
        key_ids: Dict[str, int] = {}
        self.key = [key_ids.setdefault(k, len(key_ids)) for k in keys]
        self.keys = list(key_ids)
        sig_ids: Dict[Tuple[Any, ...], int] = {}
        self.sig = [sig_ids.setdefault(sig, len(sig_ids)) for sig in zip(dtypes, prepend, allow, glob, local, fragm)]
        self.signatures = list(sig_ids)
        self.ndims = [len(o) for o in offsets]
        self.offsets = list(chain.from_iterable(offsets))
        if any(r is not None for r in flat):
            self.flat = [v for r in flat for v in ((-1, -1) if r is None else (r.start, r.stop))]
        else:
            self.flat = [-1] * (2 * self.n)
        self.replica_len = [-1 if type(r) is int else len(r) for r in replica]
        self.replica = list(chain.from_iterable((r,) if type(r) is int else r for r in replica))
        # is_main_replica, inlined: replica ids are validated non-negative ints or tuples of them
        self.main = [r == 0 if type(r) is int else not any(r) for r in replica]

    def _sig_rows(self, width: int) -> Tuple[np.ndarray, List[str]]:
        rows = np.zeros((len(self.signatures), SIG.SCALARS + 3 * width), dtype=np.int64)
        rows[:, SIG.global_(width)] = 1
        rows[:, SIG.local(width)] = 1
        dtype_ids: Dict[torch.dtype, int] = {}
        for i, (dtype, prepend, allow, glob, local, fragm) in enumerate(self.signatures):
            row = rows[i]
            d = len(glob)
            row[SIG.SCALARS : SIG.SCALARS + d] = glob
            if dtype is None:
                row[SIG.KIND], row[SIG.DTYPE], row[SIG.NDIM] = KIND_OBJECT, -1, d
                continue
            dtype_id = dtype_ids.setdefault(dtype, len(dtype_ids))
            row[: SIG.SCALARS] = (KIND_TENSOR, dtype_id, prepend, bool(allow), d, fragm is not None)
            row[SIG.SCALARS + width + prepend : SIG.SCALARS + width + d] = local
            if fragm is not None:
                row[SIG.SCALARS + 2 * width : SIG.SCALARS + 2 * width + d] = fragm
        return rows, [dtype_token(d) for d in dtype_ids]

    def table(self, rank: int) -> ShardTable:
        n = self.n
        width = max(self.ndims, default=0)
        ndims = np.asarray(self.ndims, dtype=np.int64)
        offset = np.zeros((n, width), dtype=np.int64)
        offset[np.arange(width) < ndims[:, None]] = self.offsets
        sigs, dtypes = self._sig_rows(width)
        return ShardTable(
            keys=self.keys,
            dtypes=dtypes,
            sigs=sigs,
            key=np.asarray(self.key, dtype=np.int64),
            sig=np.asarray(self.sig, dtype=np.int64),
            offset=offset,
            flat=np.asarray(self.flat, dtype=np.int64).reshape(n, 2),
            main=np.asarray(self.main, dtype=np.int8),
            rank=np.full(n, rank, dtype=np.int64),
            replica_len=np.asarray(self.replica_len, dtype=np.int64),
            replica=np.asarray(self.replica, dtype=np.int64),
        )


# --------------------------------------------------------------------------- bytes


def encode_table(table: ShardTable) -> bytes:
    """One rank's table as bytes (`dist_ckpt.model.columns`; no pickle)."""
    columns = {
        "sigs": table.sigs,
        "key": table.key,
        "sig": table.sig,
        "offset": table.offset,
        "flat": table.flat,
        "main": table.main,
        "replica_len": table.replica_len,
        "replica": table.replica,
    }
    return pack_columns(columns, {"keys": table.keys, "dtypes": table.dtypes}, {"format": _FORMAT, "v": _VERSION})


def decode_table(
    blob: bytes, rank: int, where: str, string_cache: Optional[MutableMapping[bytes, List[str]]] = None
) -> ShardTable:
    """Inverse of `encode_table()`; the rows get rank ``rank``.

    Raises:
        CorruptCheckpointError: naming ``where``, for bytes that are not such a table.
    """
    unpacked = unpack_columns(blob, where, string_cache)
    if unpacked.meta != {"format": _FORMAT, "v": _VERSION}:
        raise CorruptCheckpointError(f"{where}: not shard metadata of this dist_ckpt version ({unpacked.meta})")
    c = unpacked.columns
    try:
        table = ShardTable(
            keys=unpacked.strings["keys"],
            dtypes=unpacked.strings["dtypes"],
            sigs=c["sigs"],
            key=c["key"],
            sig=c["sig"],
            offset=c["offset"],
            flat=c["flat"],
            main=c["main"],
            rank=np.full(len(c["key"]), rank, dtype=np.int32),
            replica_len=c["replica_len"],
            replica=c["replica"],
        )
    except KeyError as e:
        raise CorruptCheckpointError(f"{where}: column {e} is missing") from None
    _check_shapes(table, where)
    return table


def _check_shapes(t: ShardTable, where: str) -> None:
    n, width = len(t), t.width
    ok = (
        t.sigs.ndim == 2
        and t.sigs.shape[1] == SIG.SCALARS + 3 * width
        and t.offset.shape == (n, width)
        and t.flat.shape == (n, 2)
        and t.sig.shape == t.main.shape == t.replica_len.shape == (n,)
        and (n == 0 or (0 <= t.key.min() and t.key.max() < len(t.keys)))
        and (n == 0 or (0 <= t.sig.min() and t.sig.max() < len(t.sigs)))
        and int(np.where(t.replica_len < 0, 1, t.replica_len).sum()) == len(t.replica)
    )
    if not ok:
        raise CorruptCheckpointError(f"{where}: inconsistent shard table columns")


# --------------------------------------------------------------------------- concatenation


def _widen(sigs: np.ndarray, width: int) -> np.ndarray:
    """Signature rows padded to ``width`` axes (1 for shapes, 0 for fragmentations)."""
    old = (sigs.shape[1] - SIG.SCALARS) // 3
    if old == width:
        return sigs.astype(np.int64, copy=False)
    out = np.zeros((len(sigs), SIG.SCALARS + 3 * width), dtype=np.int64)
    out[:, SIG.global_(width)] = 1
    out[:, SIG.local(width)] = 1
    out[:, : SIG.SCALARS] = sigs[:, : SIG.SCALARS]
    for part in (SIG.global_, SIG.local, SIG.fragm):
        src, dst = part(old), part(width)
        out[:, dst.start : dst.start + old] = sigs[:, src]
    return out


def _widen_offsets(offset: np.ndarray, width: int) -> np.ndarray:
    if offset.shape[1] == width:
        return offset
    out = np.zeros((offset.shape[0], width), dtype=offset.dtype)
    out[:, : offset.shape[1]] = offset
    return out


def concat_tables(tables: Sequence[ShardTable]) -> ShardTable:
    """One table of every row of ``tables``, in order, with shared key, dtype and signature tables.

    Tables that share a key table (the same list object, as `decode_table()` returns for
    equal bytes with a string cache) are mapped once.
    """
    width = max((t.width for t in tables), default=0)
    dtypes: Dict[str, int] = {}
    keys: Dict[str, int] = {}
    key_maps: Dict[int, np.ndarray] = {}
    sig_rows: List[np.ndarray] = []
    key_cols: List[np.ndarray] = []
    sig_cols: List[np.ndarray] = []
    sig_base = 0
    for t in tables:
        key_map = key_maps.get(id(t.keys))
        if key_map is None:
            key_map = np.fromiter((keys.setdefault(k, len(keys)) for k in t.keys), np.int64, len(t.keys))
            key_maps[id(t.keys)] = key_map
        dtype_map = np.array([dtypes.setdefault(d, len(dtypes)) for d in t.dtypes] + [-1], dtype=np.int64)
        sigs = _widen(t.sigs, width).copy()
        sigs[:, SIG.DTYPE] = dtype_map[sigs[:, SIG.DTYPE]]  # -1 (objects) picks the trailing -1
        sig_rows.append(sigs)
        key_cols.append(key_map[t.key])
        sig_cols.append(t.sig.astype(np.int64) + sig_base)
        sig_base += len(sigs)
    all_sigs = np.concatenate(sig_rows) if sig_rows else np.zeros((0, SIG.SCALARS + 3 * width), np.int64)
    unique, inverse = np.unique(all_sigs, axis=0, return_inverse=True)

    def cat(arrays: List[np.ndarray], empty: Tuple[int, ...]) -> np.ndarray:
        return np.concatenate(arrays) if arrays else np.zeros(empty, dtype=np.int64)

    return ShardTable(
        keys=list(keys),
        dtypes=list(dtypes),
        sigs=unique,
        key=cat(key_cols, (0,)),
        sig=inverse.reshape(-1)[cat(sig_cols, (0,))] if sig_cols else np.zeros(0, np.int64),
        offset=cat([_widen_offsets(t.offset, width) for t in tables], (0, width)),
        flat=cat([t.flat for t in tables], (0, 2)),
        main=cat([t.main for t in tables], (0,)),
        rank=cat([t.rank for t in tables], (0,)),
        replica_len=cat([t.replica_len for t in tables], (0,)),
        replica=cat([t.replica for t in tables], (0,)),
    )
