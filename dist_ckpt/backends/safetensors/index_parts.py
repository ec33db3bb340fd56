"""Each rank's part of the safetensors index, as compact bytes, and rank 0's merge of them.

After writing its files, each rank describes what it wrote -- its files (name, size, header
crc), its tensors (dtype, global shape, whether saved as flattened ranges) and one row per shard
(file, box, flattened range, byte range, block crcs) -- as one column blob
(`dist_ckpt.model.columns`), a few dozen bytes per shard. Rank 0 gathers the blobs and
merges them with numpy into a `MergedIndex`: the tensors sorted by key, each tensor's
shard rows contiguous, its block crcs contiguous too; that is what index version 3 stores
(`index_v3`). Nothing here is per-shard Python work on rank 0, so a million shards merge
in well under a second.

Example:

```python
part = IndexPart(rank, shards, planned_files)           # before writing: no tensor data kept
blob = part.encode(part_results, checksums=True)        # after writing
merged = merge_index_parts(gather_bytes(blob))          # rank 0
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from dist_ckpt.backends.safetensors.write import PartResult, PlannedFile
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.model.columns import pack_columns, unpack_columns
from dist_ckpt.model.dtypes import dtype_to_name
from dist_ckpt.model.sharded import ShardedTensor

__all__ = ["COLUMNS", "IndexPart", "MergedIndex", "merge_index_parts"]

_FORMAT = "dist_ckpt.safetensors.index_part"
_VERSION = 2  # 2: each tensor says whether it was saved as flattened ranges
#: the integer columns of a shard row, before the ``ndim`` offsets and ``ndim`` chunk sizes
COLUMNS = ("file", "flat_start", "flat_stop", "byte_begin", "byte_end")
NO_CRC = -1


@dataclass
class MergedIndex:
    """Every rank's index parts, merged (what index version 3 stores).

    Attributes:
        files: per file (in file-id order): name, size, rank, header crc (or None).
        keys: tensor keys, sorted.
        dtypes: dtype name of each tensor.
        shapes: global shape of each tensor.
        flattened: whether each tensor was saved as flattened ranges (by any rank).
        ndim: ``D``, the widest global shape.
        rows: ``(R, 5 + 2 * D)`` int64 shard rows (`COLUMNS`, offsets, chunk sizes),
            the rows of each tensor contiguous, tensors in key order.
        key_rows: ``(K, 2)`` first row and row count of each tensor.
        crcs: block crc32c of every shard, in row order (uint32).
        key_blocks: ``(K, 2)`` first crc and crc count of each tensor.
        checksums: whether block crcs were recorded.
    """

    files: List[Tuple[str, int, int, Optional[int]]]
    keys: List[str]
    dtypes: List[str]
    shapes: List[Tuple[int, ...]]
    flattened: List[bool]
    ndim: int
    rows: np.ndarray
    key_rows: np.ndarray
    crcs: np.ndarray
    key_blocks: np.ndarray
    checksums: bool


def _crc_ints(hex_crcs: Sequence[str]) -> np.ndarray:
    return np.frombuffer(bytes.fromhex("".join(hex_crcs)), dtype=">u4").astype(np.int64)


class IndexPart:
    """This rank's index part, described from its write plan (no tensor data is kept), and
    encoded once the files are written and their checksums known.

    Args:
        rank: this rank.
        shards: every main-replica shard of the rank (tensors without bytes are listed too).
        files: the planned files and the shards each holds, in file order.
    """

    def __init__(
        self, rank: int, shards: Sequence[ShardedTensor], files: Sequence[Tuple[PlannedFile, Sequence[ShardedTensor]]]
    ) -> None:
        self.rank = rank
        key_ids: Dict[str, int] = {}
        dtype_ids: Dict[str, int] = {}
        self.t_dtype: List[int] = []
        self.t_shape: List[Tuple[int, ...]] = []
        self.t_flat: List[bool] = []
        for sh in shards:  # keys with no bytes on any rank (0-size tensors) are still listed
            if sh.key not in key_ids:
                key_ids[sh.key] = len(key_ids)
                self.t_dtype.append(dtype_ids.setdefault(dtype_to_name(sh.dtype), len(dtype_ids)))
                self.t_shape.append(sh.global_shape)
                self.t_flat.append(False)
            if sh.flattened_range is not None:
                self.t_flat[key_ids[sh.key]] = True
        self.keys, self.dtypes = list(key_ids), list(dtype_ids)
        self.files = [(plan.name, plan.size, len(group)) for plan, group in files]
        self.rows: List[Tuple[int, ...]] = []
        self.geometry: List[Tuple[Tuple[int, ...], Tuple[int, ...]]] = []
        for f, (plan, group) in enumerate(files):
            for sh, (begin, end) in zip(group, plan.ranges):
                rng = sh.flattened_range
                flat = (-1, -1) if rng is None else (rng.start, rng.stop)
                self.rows.append((key_ids[sh.key], f, *flat, begin, end))
                self.geometry.append((sh.global_offset, sh.full_local_shape))

    def encode(self, results: Sequence[PartResult], checksums: bool) -> bytes:
        """The part as bytes, with each shard's block crcs (and each header's) from ``results``.

        Raises:
            CheckpointingException: a file's results do not cover all its tensors.
        """
        crcs: Dict[str, List[str]] = {}
        header_crcs: Dict[str, int] = {}
        for result in sorted(results, key=lambda r: (r.file, r.first)):
            crcs.setdefault(result.file, []).extend(result.crcs)
            if result.header_crc is not None:
                header_crcs[result.file] = int(result.header_crc, 16)
        row_crcs: List[str] = []
        for name, _, count in self.files:
            written = crcs.get(name, [])
            if len(written) != count:
                raise CheckpointingException(
                    f"[rank {self.rank}] {name}: {len(written)} of its {count} tensors were written"
                )
            row_crcs += written if checksums else [""] * count
        width = max([len(s) for s in self.t_shape] + [len(o) for o, _ in self.geometry], default=0)
        offset, chunk = np.zeros((len(self.rows), width), np.int64), np.zeros((len(self.rows), width), np.int64)
        shape = np.zeros((len(self.t_shape), width), np.int64)
        for i, (o, c) in enumerate(self.geometry):
            offset[i, : len(o)], chunk[i, : len(c)] = o, c
        for i, s in enumerate(self.t_shape):
            shape[i, : len(s)] = s
        columns = {
            "t_dtype": np.asarray(self.t_dtype, dtype=np.int64),
            "t_ndim": np.asarray([len(s) for s in self.t_shape], dtype=np.int64),
            "t_shape": shape,
            "t_flat": np.asarray(self.t_flat, dtype=np.int64),
            "f_size": np.asarray([size for _, size, _ in self.files], dtype=np.int64),
            "f_header_crc": np.asarray([header_crcs.get(n, NO_CRC) if checksums else NO_CRC for n, _, _ in self.files]),
            "rows": np.asarray(self.rows, dtype=np.int64).reshape(len(self.rows), 6),
            "offset": offset,
            "chunk": chunk,
            "nblocks": np.asarray([len(c) // 8 for c in row_crcs], dtype=np.int64),
            "crcs": _crc_ints(row_crcs).astype(np.uint32).view(np.int32).astype(np.int64),
        }
        strings = {"keys": self.keys, "dtypes": self.dtypes, "files": [name for name, _, _ in self.files]}
        meta = {"format": _FORMAT, "v": _VERSION, "rank": self.rank, "checksums": checksums}
        return pack_columns(columns, strings, meta)


@dataclass
class _Part:
    """One rank's decoded part."""

    rank: int
    keys: List[str]
    dtypes: List[str]
    files: List[str]
    c: Dict[str, np.ndarray]
    checksums: bool


def _decode(blob: bytes, rank: int, cache: Dict[bytes, List[str]]) -> _Part:
    where = f"the safetensors index part of rank {rank}"
    unpacked = unpack_columns(blob, where, cache)
    meta = unpacked.meta
    if meta.get("format") != _FORMAT or meta.get("v") != _VERSION or meta.get("rank") != rank:
        raise CheckpointingException(f"{where} is not an index part of this dist_ckpt version ({meta})")
    s = unpacked.strings
    return _Part(rank, s["keys"], s["dtypes"], s["files"], unpacked.columns, bool(meta.get("checksums")))


def _widen(a: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((a.shape[0], width), dtype=np.int64)
    out[:, : a.shape[1]] = a
    return out


def _check_agreement(parts: Sequence[_Part], keys: Dict[str, int], width: int) -> Tuple[List[str], np.ndarray]:
    """Each tensor's dtype and global shape, after checking every rank that lists it agrees."""
    dtype_names: Dict[str, int] = {}
    listed = []  # per part: (global key ids, dtype ids, ndim, shape)
    for p in parts:
        kid = np.fromiter((keys.setdefault(k, len(keys)) for k in p.keys), np.int64, len(p.keys))
        dmap = np.fromiter((dtype_names.setdefault(d, len(dtype_names)) for d in p.dtypes), np.int64, len(p.dtypes))
        c = p.c
        listed.append((kid, dmap[c["t_dtype"]] if len(kid) else kid, c["t_ndim"], _widen(c["t_shape"], width)))
    kid = np.concatenate([x[0] for x in listed]) if listed else np.zeros(0, np.int64)
    desc = (
        np.column_stack(
            [np.concatenate([x[i] for x in listed]) for i in (1, 2)] + [np.concatenate([x[3] for x in listed])]
        )
        if listed
        else np.zeros((0, 2 + width), np.int64)
    )
    owner = np.concatenate([np.full(len(x[0]), p.rank) for x, p in zip(listed, parts)]) if listed else kid
    first = np.full(len(keys), -1, dtype=np.int64)
    order = np.argsort(kid, kind="stable")
    is_first = np.ones(len(order), dtype=bool)
    is_first[1:] = kid[order][1:] != kid[order][:-1]
    first[kid[order][is_first]] = order[is_first]
    differs = (desc != desc[first[kid]]).any(axis=1)
    if differs.any():
        i = int(np.flatnonzero(differs)[0])
        j = int(first[kid[i]])
        names = list(dtype_names)

        def show(row: np.ndarray) -> str:
            return f"{names[int(row[0])]} {[int(v) for v in row[2 : 2 + int(row[1])]]}"

        key = list(keys)[int(kid[i])]
        raise CheckpointingException(
            f"tensor {key!r}: rank {int(owner[i])} saves it as {show(desc[i])}, another rank (rank {int(owner[j])}) "
            f"as {show(desc[j])}; every rank must agree"
        )
    return list(dtype_names), desc[first]


def merge_index_parts(blobs: Sequence[bytes]) -> MergedIndex:
    """Merge every rank's `encode_index_part()` (``blobs[r]`` from rank r; runs on rank 0).

    Raises:
        CheckpointingException: two ranks describe a key with different dtypes or global shapes,
            or write a file of the same name.
    """
    cache: Dict[bytes, List[str]] = {}
    parts = [_decode(b, rank, cache) for rank, b in enumerate(blobs)]
    files: List[Tuple[str, int, int, Optional[int]]] = []
    owners: Dict[str, int] = {}
    for p in parts:
        for name, size, crc in zip(p.files, p.c["f_size"].tolist(), p.c["f_header_crc"].tolist()):
            if name in owners:
                raise CheckpointingException(f"ranks {owners[name]} and {p.rank} both wrote {name!r}")
            owners[name] = p.rank
            files.append((name, size, p.rank, None if crc == NO_CRC else crc & 0xFFFFFFFF))
    width = max([p.c["t_shape"].shape[1] for p in parts] + [p.c["offset"].shape[1] for p in parts], default=0)
    keys: Dict[str, int] = {}
    dtype_names, desc = _check_agreement(parts, keys, width)
    if len({p.checksums for p in parts}) > 1:
        with_crcs = [p.rank for p in parts if p.checksums]
        raise CheckpointingException(f"ranks {with_crcs} recorded checksums and the others did not; use one setting")
    merged = _merge_rows(parts, keys, dtype_names, desc, width, bool(parts) and parts[0].checksums)
    merged.files = files
    return merged


def _merge_rows(
    parts: Sequence[_Part], keys: Dict[str, int], dtype_names: List[str], desc: np.ndarray, width: int, checksums: bool
) -> MergedIndex:
    """The shard rows of every part, grouped by key in sorted key order, with their crcs."""
    key_list = list(keys)
    rows, crcs, nblocks, file_base = [], [], [], 0
    flat = np.zeros(len(key_list), dtype=bool)
    for p in parts:
        c = p.c
        key_map = np.fromiter((keys[k] for k in p.keys), np.int64, len(p.keys))
        flat[key_map[c["t_flat"] != 0]] = True
        r = c["rows"].astype(np.int64)
        block = np.empty((len(r), 1 + len(COLUMNS) + 2 * width), dtype=np.int64)
        block[:, 0] = key_map[r[:, 0]] if len(r) else 0
        block[:, 1] = r[:, 1] + file_base
        block[:, 2 : 1 + len(COLUMNS)] = r[:, 2:]
        block[:, 1 + len(COLUMNS) : 1 + len(COLUMNS) + width] = _widen(c["offset"], width)
        block[:, 1 + len(COLUMNS) + width :] = _widen(c["chunk"], width)
        rows.append(block)
        crcs.append(c["crcs"].astype(np.int64))
        nblocks.append(c["nblocks"].astype(np.int64))
        file_base += len(p.files)
    all_rows = np.concatenate(rows) if rows else np.zeros((0, 1 + len(COLUMNS) + 2 * width), np.int64)
    all_crcs = (np.concatenate(crcs) if crcs else np.zeros(0, np.int64)).astype(np.uint32)
    all_blocks = np.concatenate(nblocks) if nblocks else np.zeros(0, np.int64)
    rank_of_key = np.empty(len(key_list), dtype=np.int64)
    sorted_keys = sorted(range(len(key_list)), key=key_list.__getitem__)
    rank_of_key[sorted_keys] = np.arange(len(key_list))
    order = np.argsort(rank_of_key[all_rows[:, 0]], kind="stable")  # by key; each key's rows in rank order
    crc_start = np.concatenate(([0], np.cumsum(all_blocks)[:-1])) if len(all_blocks) else all_blocks
    counts = all_blocks[order]
    crc_index = np.repeat(crc_start[order] - np.concatenate(([0], np.cumsum(counts)[:-1])), counts) + np.arange(
        int(counts.sum())
    )
    sorted_rows = all_rows[order]
    per_key = np.bincount(rank_of_key[sorted_rows[:, 0]], minlength=len(key_list))
    per_key_blocks = np.bincount(rank_of_key[sorted_rows[:, 0]], weights=counts, minlength=len(key_list))
    per_key_blocks = per_key_blocks.astype(np.int64)

    def ranges(n: np.ndarray) -> np.ndarray:
        return np.column_stack([np.concatenate(([0], np.cumsum(n)[:-1])), n]) if len(n) else np.zeros((0, 2), np.int64)

    return MergedIndex(
        files=[],
        keys=[key_list[k] for k in sorted_keys],
        dtypes=[dtype_names[int(desc[k, 0])] for k in sorted_keys],
        shapes=[tuple(int(v) for v in desc[k, 2 : 2 + int(desc[k, 1])]) for k in sorted_keys],
        flattened=flat[sorted_keys].tolist(),
        ndim=width,
        rows=np.ascontiguousarray(sorted_rows[:, 1:]),
        key_rows=ranges(per_key),
        crcs=all_crcs[crc_index] if len(crc_index) else all_crcs[:0],
        key_blocks=ranges(per_key_blocks),
        checksums=checksums,
    )
