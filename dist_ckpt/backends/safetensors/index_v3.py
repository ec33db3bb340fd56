"""Version 3 of the safetensors index: a small JSON document and a binary table of shards.

A checkpoint of a thousand ranks holds a million shards; versions 1 and 2 describe each shard as
a JSON object, so every loading rank would parse hundreds of megabytes of JSON and build a
million Python objects to plan its own few reads. Version 3 keeps ``index.json`` small -- the
files, and per tensor its dtype, global shape and where its rows are -- and stores the shards in
``index.<crc>.bin``, one fixed-size row of little-endian int64 per shard, each tensor's rows
contiguous, followed by the block crcs (uint32) of every shard, each tensor's contiguous too:

```text
{
  "format": "dist_ckpt.safetensors",
  "version": 3,
  "checksum": {"algorithm": "crc32c", "block_bytes": 1048576},     # absent: no block crcs
  "files": [{"name": "rank00000_0.safetensors", "size": 1048704, "rank": 0,
             "header_crc32c": "1a2b3c4d"}, ...],                   # a row's "file" indexes this list
  "shard_table": {"file": "index.0f1e2d3c.bin", "size": 200, "rows": 2, "ndim": 2, "blocks": 2,
                  "columns": ["file", "flat_start", "flat_stop", "byte_begin", "byte_end",
                              "offset", "chunk"]},
  "tensors": {"decoder.w": {"dtype": "bfloat16", "global_shape": [1024, 512],
                            "rows": [0, 2], "blocks": [0, 2], "table_crc32c": "9a71bb4c"},
              "optimizer.exp_avg": {..., "flattened": true}}    # saved as flattened ranges
}
```

A row holds, for ``D = ndim``: the file id, the flattened range (``-1, -1`` for a whole chunk),
the absolute byte range in the file, the ``D`` offsets and the ``D`` chunk sizes of the shard's
box (a tensor of fewer axes leaves the rest 0). The shard's name inside its safetensors file is
not stored: it is ``<key>@<offsets joined by ".">`` (``+<flat start>`` for a flattened range),
as every writer of this backend names it. ``table_crc32c`` covers the tensor's rows and then
its block crcs, so a reader checks exactly the bytes it uses. ``"flattened": true`` marks a tensor
saved as flattened ranges (absent otherwise), as in versions 1 and 2, so that its metadata
describes it as saved without reading its rows.

A loading rank reads ``index.json`` (O(tensors)) and, for each tensor it requests, only that
tensor's rows (memory-mapped where the storage has ``local_paths``; elsewhere the table is
fetched once), checks them with numpy and builds Python objects only for the shards that overlap
what it reads.

Example:

```python
doc, table, name = v3_document(merged, block_bytes=1 << 20, header={"format": ..., "version": 3})
index = parse_v3(json.loads(raw), LocalStorage("ckpt/safetensors"), "ckpt/safetensors/index.json", 1 << 20, "")
```
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from dist_ckpt.backends.safetensors.index_parts import COLUMNS, MergedIndex
from dist_ckpt.backends.safetensors.tensor_index import FLATTENED, StoredShard, StoredTensor, TensorIndex
from dist_ckpt.backends.stored_shards import stored_key
from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError
from dist_ckpt.integrity.checksums import ALGORITHM, crc32c, crc_from_hex, crc_to_hex
from dist_ckpt.integrity.safe_json import check_tensor_bytes, shown
from dist_ckpt.model.dtypes import dtype_from_name
from dist_ckpt.model.geometry import Box
from dist_ckpt.storage import Storage

__all__ = ["VERSION", "TableTensor", "parse_v3", "table_file_name", "v3_document"]

VERSION = 3
_TABLE_PREFIX = "index."
_TABLE_SUFFIX = ".bin"
_ROW = np.dtype("<i8")
_CRC = np.dtype("<u4")
#: a tensor entry, checked: dtype, global shape, rows (first, count), blocks (first, count),
#: crc32c of its rows and blocks, saved as flattened ranges
_Entry = Tuple[torch.dtype, Tuple[int, ...], Tuple[int, int], Tuple[int, int], int, bool]


def table_file_name(crc: int) -> str:
    """Name of the shard table whose bytes have crc32c ``crc`` (new content, new name: the
    table is never overwritten in place, so ``index.json`` and its table change atomically)."""
    return f"{_TABLE_PREFIX}{crc_to_hex(crc)}{_TABLE_SUFFIX}"


def is_table_file(name: str) -> bool:
    """Whether ``name`` is a shard table's name."""
    return name.startswith(_TABLE_PREFIX) and name.endswith(_TABLE_SUFFIX) and len(name) == 18


def v3_document(
    merged: MergedIndex, block_bytes: Optional[int], header: Dict[str, Any]
) -> Tuple[Dict[str, Any], bytes, str]:
    """``(index.json document, shard table bytes, table file name)`` of a merged index.

    ``header`` holds the leading fields (format and version); ``block_bytes`` is recorded when
    the shards have block crcs.
    """
    rows = np.ascontiguousarray(merged.rows, dtype=_ROW)
    crcs = np.ascontiguousarray(merged.crcs, dtype=_CRC)
    row_bytes, crc_bytes = rows.tobytes(), crcs.tobytes()
    width = rows.shape[1] * _ROW.itemsize
    tensors: Dict[str, Any] = {}
    for i, key in enumerate(merged.keys):
        (r0, rn), (b0, bn) = (int(v) for v in merged.key_rows[i]), (int(v) for v in merged.key_blocks[i])
        crc = crc32c(crc_bytes[b0 * 4 : (b0 + bn) * 4], crc32c(row_bytes[r0 * width : (r0 + rn) * width]))
        tensors[key] = {
            "dtype": merged.dtypes[i],
            "global_shape": list(merged.shapes[i]),
            "rows": [r0, rn],
            "blocks": [b0, bn],
            "table_crc32c": crc_to_hex(crc),
        }
        if merged.flattened[i]:
            tensors[key][FLATTENED] = True
    table = row_bytes + crc_bytes
    name = table_file_name(crc32c(table))
    doc = dict(header)
    if block_bytes is not None and merged.checksums:
        doc["checksum"] = {"algorithm": ALGORITHM, "block_bytes": block_bytes}
    doc["files"] = [
        {"name": n, "size": size, "rank": rank, **({} if crc is None else {f"header_{ALGORITHM}": crc_to_hex(crc)})}
        for n, size, rank, crc in merged.files
    ]
    doc["shard_table"] = {
        "file": name,
        "size": len(table),
        "rows": int(rows.shape[0]),
        "ndim": merged.ndim,
        "blocks": int(crcs.shape[0]),
        "columns": [*COLUMNS, "offset", "chunk"],
    }
    doc["tensors"] = tensors
    return doc, table, name


# --------------------------------------------------------------------------- reading


class _Fail:
    """Errors naming the index file (and the tensor)."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __call__(self, problem: str, key: Optional[str] = None) -> CorruptCheckpointError:
        tensor = "" if key is None else f" (tensor {key!r})"
        return CorruptCheckpointError(f"safetensors index {self.where!r}{tensor}: {problem}")


def _int(value: Any) -> Optional[int]:
    """``value`` if it is a non-negative JSON int, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _ints(value: Any, length: Optional[int] = None) -> Optional[Tuple[int, ...]]:
    """``value`` as a tuple if it is a list of non-negative ints (of ``length``), else None."""
    if not isinstance(value, list) or (length is not None and len(value) != length):
        return None
    out = tuple(_int(v) for v in value)
    return None if any(v is None for v in out) else out  # type: ignore[return-value]


class ShardTableFile:
    """The binary shard table, opened on first use: memory-mapped where the storage has local
    files (``local_paths``: pages are read only for the rows used), fetched whole otherwise."""

    def __init__(self, spec: Dict[str, Any], storage: Storage, fail: _Fail) -> None:
        self.fail = fail
        name = spec.get("file")
        if not isinstance(name, str) or not is_table_file(name):
            raise fail(f"'shard_table' field 'file' must name an index.<crc>.bin file, found {shown(name)}")
        for field in ("size", "rows", "ndim", "blocks"):
            if _int(spec.get(field)) is None:
                raise fail(f"'shard_table' field {field!r} must be a non-negative int, found {shown(spec.get(field))}")
        self.name, self.nrows, self.ndim, self.nblocks = name, spec["rows"], spec["ndim"], spec["blocks"]
        self.columns = len(COLUMNS) + 2 * self.ndim
        if spec.get("columns") != [*COLUMNS, "offset", "chunk"]:
            expected = [*COLUMNS, "offset", "chunk"]
            raise fail(f"'shard_table' field 'columns' is {shown(spec.get('columns'))}, expected {expected}")
        if spec["size"] != self.nrows * self.columns * _ROW.itemsize + self.nblocks * _CRC.itemsize:
            raise fail(
                f"'shard_table' size {spec['size']} does not match its {self.nrows} rows and {self.nblocks} crcs"
            )
        self.size = spec["size"]
        self.storage = storage
        self._rows: Optional[np.ndarray] = None
        self._crcs: Optional[np.ndarray] = None

    def open(self) -> Tuple[np.ndarray, np.ndarray]:
        """The rows ``(rows, columns)`` and the crcs, memory-mapped (local) or in memory."""
        if self._rows is None or self._crcs is None:
            where = self.storage.url_of(self.name)
            try:
                if not self.storage.local_paths:
                    raw = np.frombuffer(self.storage.read(self.name), dtype=np.uint8)
                else:  # its size first: np.memmap refuses an empty file with a bare ValueError
                    self._check_size(self.storage.size(self.name), where)
                    path = self.storage.local_path(self.name)
                    raw = np.memmap(path, dtype=np.uint8, mode="r") if self.size else np.zeros(0, dtype=np.uint8)
            except FileNotFoundError:  # ObjectNotFoundError is one
                raise self.fail(f"its shard table {where!r} is missing") from None
            self._check_size(raw.shape[0], where)
            split = self.nrows * self.columns * _ROW.itemsize
            self._rows = raw[:split].view(_ROW).reshape(self.nrows, self.columns)
            self._crcs = raw[split:].view(_CRC)
        return self._rows, self._crcs

    def _check_size(self, found: int, where: str) -> None:
        if found != self.size:
            raise self.fail(f"its shard table {where!r} has {found} bytes, the index says {self.size}")


class TableTensor(StoredTensor):
    """A stored tensor of an index v3: its shards come from the shard table, on first use.

    `overlapping()` checks the tensor's rows once and builds a `StoredShard` only for
    the rows that overlap the region asked for; `shards` builds all of them.
    """

    #: at most this many rows are searched in Python (cheaper than numpy's per-call overhead)
    PYTHON_SEARCH_ROWS = 8

    def __init__(
        self,
        key: str,
        dtype: torch.dtype,
        global_shape: Tuple[int, ...],
        table: "_TensorRows",
        ordinal: int,
        flattened: bool = False,
    ) -> None:
        # few objects per tensor: an index of many tensors is read by every loading rank
        self.key, self.dtype, self.global_shape, self.flattened = key, dtype, global_shape, flattened
        self._grid = None
        self._table = table
        self.ordinal = ordinal  # its entry in the table's per-tensor arrays
        self._all: Optional[List[StoredShard]] = None
        self._made: Optional[Dict[int, StoredShard]] = None

    @property
    def shards(self) -> List[StoredShard]:
        if self._all is None:
            self._all = [self._shard(i) for i in range(len(self._table.load(self).rows))]
        return self._all

    @shards.setter
    def shards(self, value: List[StoredShard]) -> None:
        self._all = list(value)

    def _shard(self, i: int) -> StoredShard:
        if self._made is None:
            self._made = {}
        made = self._made.get(i)
        if made is None:
            made = self._table.shard(self, i)
            self._made[i] = made
        return made

    def overlapping(self, region: Box) -> Iterator[StoredShard]:
        """Shards whose box overlaps ``region`` and, for a flattened range, whose range reaches the
        part of the row-major flattening of the box between the region's first and last element
        (others cannot hold an element of ``region``)."""
        if self._all is not None:  # replaced or built already
            yield from super().overlapping(region)
            return
        rows = self._table.load(self)
        if len(rows.rows) <= self.PYTHON_SEARCH_ROWS:
            for i, row in enumerate(rows.values()):
                if self._row_overlaps(row, region):
                    yield self._shard(i)
            return
        d, first = len(self.global_shape), len(COLUMNS)
        size = first + self._table.ndim  # where the chunk sizes start
        off, chunk = rows.rows[:, first : first + d], rows.rows[:, size : size + d]
        lo = np.maximum(off, np.asarray(region.offset, dtype=np.int64))
        hi = np.minimum(off + chunk, np.asarray(region.stop, dtype=np.int64))
        hit = (lo < hi).all(axis=1)
        start, stop = rows.rows[:, 1], rows.rows[:, 2]
        if d and (start >= 0).any():  # flattened ranges: where the region starts and ends in the flattening
            strides = np.ones_like(chunk)
            strides[:, :-1] = np.cumprod(chunk[:, :0:-1], axis=1)[:, ::-1]
            begin = ((lo - off) * strides).sum(axis=1)
            last = ((hi - 1 - off) * strides).sum(axis=1)
            hit &= (start < 0) | ((start <= last) & (stop > begin))
        for position in np.flatnonzero(hit):
            yield self._shard(int(position))

    def _row_overlaps(self, row: List[int], region: Box) -> bool:
        """`overlapping()`'s test for one row, in Python."""
        first = len(COLUMNS)
        size = first + self._table.ndim
        begin = last = 0
        for a in range(len(self.global_shape) - 1, -1, -1):  # last axis first: the strides grow
            o, c = row[first + a], row[size + a]
            lo, hi = max(o, region.offset[a]), min(o + c, region.offset[a] + region.shape[a])
            if lo >= hi:
                return False
            stride = 1
            for b in range(a + 1, len(self.global_shape)):
                stride *= row[size + b]
            begin += (lo - o) * stride
            last += (hi - 1 - o) * stride
        start, stop = row[1], row[2]
        return start < 0 or (start <= last and stop > begin)


class _Checked:
    """One tensor's rows of the shard table, checked: the rows, their block crcs, and where each
    row's crcs end."""

    def __init__(self, rows: np.ndarray, crcs: np.ndarray, crc_ends: np.ndarray) -> None:
        self.rows, self.crcs, self.crc_ends = rows, crcs, crc_ends
        self._values: Optional[List[List[int]]] = None

    def values(self) -> List[List[int]]:
        """The rows as Python ints."""
        if self._values is None:
            self._values = self.rows.tolist()
        return self._values


def _ranges(first: np.ndarray, count: np.ndarray) -> np.ndarray:
    """``concatenate([arange(f, f + c) for f, c in zip(first, count)])``, vectorized."""
    starts = np.cumsum(count) - count
    return np.repeat(first - starts, count) + np.arange(int(count.sum()), dtype=np.int64)


class _TensorRows:
    """Reads and checks the rows of the shard table, once per tensor, for many tensors at a time."""

    def __init__(
        self,
        table: ShardTableFile,
        files: List[str],
        sizes: np.ndarray,
        block_bytes: Optional[int],
        entries: np.ndarray,
        fail: _Fail,
    ) -> None:
        self.table, self.files, self.sizes, self.block_bytes, self.entries, self.fail = (
            table,
            files,
            sizes,
            block_bytes,
            entries,
            fail,
        )
        self.ndim = table.ndim
        self.tensors: Dict[str, TableTensor] = {}
        self._checked: Dict[str, _Checked] = {}

    def load(self, t: TableTensor) -> _Checked:
        found = self._checked.get(t.key)
        if found is None:
            self.prefetch([t.key])
            found = self._checked[t.key]
        return found

    def prefetch(self, keys: Sequence[str]) -> None:
        """Read and check the rows of every tensor of ``keys`` not read yet (unknown keys are
        ignored), all at once: what a load plans next."""
        todo = [self.tensors[k] for k in dict.fromkeys(keys) if k in self.tensors and k not in self._checked]
        if not todo:
            return
        entries = self.entries[np.array([t.ordinal for t in todo], dtype=np.int64)]
        at, blocks_at = entries[:, 0:2], entries[:, 2:4]
        all_rows, all_crcs = self.table.open()
        rows = np.take(all_rows, _ranges(at[:, 0], at[:, 1]), axis=0)
        crcs = np.take(all_crcs, _ranges(blocks_at[:, 0], blocks_at[:, 1]))
        row_end, crc_end = np.cumsum(at[:, 1]), np.cumsum(blocks_at[:, 1])
        self._check_crcs(todo, rows, crcs, row_end, crc_end)
        blocks = self._check_rows(todo, rows, at[:, 1], blocks_at[:, 1])
        for i, t in enumerate(todo):
            r0, c0 = int(row_end[i] - at[i, 1]), int(crc_end[i] - blocks_at[i, 1])
            ends = np.cumsum(blocks[r0 : int(row_end[i])])
            self._checked[t.key] = _Checked(rows[r0 : int(row_end[i])], crcs[c0 : int(crc_end[i])], ends)

    def _check_crcs(
        self, todo: List[TableTensor], rows: np.ndarray, crcs: np.ndarray, row_end: np.ndarray, crc_end: np.ndarray
    ) -> None:
        row_bytes = np.ascontiguousarray(rows).view(np.uint8).reshape(-1)
        crc_bytes = np.ascontiguousarray(crcs).view(np.uint8).reshape(-1)
        width = rows.shape[1] * _ROW.itemsize
        r0 = c0 = 0
        for i, t in enumerate(todo):
            r1, c1 = int(row_end[i]) * width, int(crc_end[i]) * _CRC.itemsize
            actual = crc32c(crc_bytes[c0:c1], crc32c(row_bytes[r0:r1]))
            expected = int(self.entries[t.ordinal, 4])
            if actual != expected:
                raise self.fail(
                    f"its rows of the shard table have crc32c {crc_to_hex(actual)}, the index recorded "
                    f"{crc_to_hex(expected)} (the table is damaged)",
                    t.key,
                )
            r0, c0 = r1, c1

    def _check_rows(
        self, todo: List[TableTensor], rows: np.ndarray, counts: np.ndarray, crc_counts: np.ndarray
    ) -> np.ndarray:
        """Every row's fields against its tensor and the files (vectorized); the block count of each row."""
        width, first = self.ndim, len(COLUMNS)
        tid = np.repeat(np.arange(len(todo)), counts)
        shapes = np.zeros((len(todo), width), dtype=np.int64)
        for i, t in enumerate(todo):
            shapes[i, : len(t.global_shape)] = t.global_shape
        axes = np.arange(width) < np.array([len(t.global_shape) for t in todo], dtype=np.int64)[tid][:, None]
        itemsize = np.array([t.dtype.itemsize for t in todo], dtype=np.int64)[tid]
        file, start, stop, begin, end = (rows[:, i] for i in range(first))
        off, chunk = rows[:, first : first + width], rows[:, first + width :]
        numel = np.where(axes, chunk, 1).prod(axis=1)
        flat = start >= 0
        known = np.clip(file, 0, max(len(self.files) - 1, 0))
        file_size = self.sizes[known] if len(self.files) else np.zeros(len(rows), dtype=np.int64)
        problems: List[Tuple[np.ndarray, Callable[[TableTensor], str]]] = [
            ((file < 0) | (file >= len(self.files)), lambda t: "names a file the index does not list"),
            (
                (axes & ((off < 0) | (chunk < 0) | (off + chunk > shapes[tid]))).any(axis=1),
                lambda t: f"has a box outside {list(t.global_shape)}",
            ),
            (
                (flat & ((stop < start) | (stop > numel))) | (~flat & ((start != -1) | (stop != -1))),
                lambda t: "has a bad flat range",
            ),
            ((begin < 0) | (end < begin) | (end > file_size), lambda t: "has a byte range outside its file"),
            (
                end - begin != np.where(flat, stop - start, numel) * itemsize,
                lambda t: f"spans a byte count that is not its elements times {t.dtype.itemsize}",
            ),
        ]
        for bad, what in problems:
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                t = todo[int(tid[i])]
                row = i - int((np.cumsum(counts) - counts)[tid[i]])
                raise self.fail(f"shard row {row} ({[int(v) for v in rows[i]]}) {what(t)}", t.key)
        blocks = np.zeros(len(rows), dtype=np.int64)
        if self.block_bytes is not None:
            blocks = -(-(end - begin) // self.block_bytes)
        needed = np.bincount(tid, weights=blocks, minlength=len(todo)).astype(np.int64)
        if (needed != crc_counts).any():
            i = int(np.flatnonzero(needed != crc_counts)[0])
            raise self.fail(
                f"its shards need {int(needed[i])} block crcs, the shard table holds {int(crc_counts[i])}", todo[i].key
            )
        return blocks

    def shard(self, t: TableTensor, i: int) -> StoredShard:
        checked = self.load(t)
        row: List[int] = checked.rows[i].tolist()
        d, first = len(t.global_shape), len(COLUMNS)
        offset = tuple(row[first : first + d])
        chunk = tuple(row[first + self.ndim : first + self.ndim + d])
        file, start, stop, begin, end = row[:first]
        name = f"{t.key}@{'.'.join(map(str, offset))}" + (f"+{start}" if start >= 0 else "")
        shard_crcs = None
        if self.block_bytes is not None:
            lo = int(checked.crc_ends[i - 1]) if i else 0
            shard_crcs = tuple(checked.crcs[lo : int(checked.crc_ends[i])].tolist())
        flat = (start, stop) if start >= 0 else None
        return StoredShard(self.files[file], name, offset, chunk, flat, (begin, end), shard_crcs)


def _files(doc: Dict[str, Any], fail: _Fail, checksums: bool) -> Tuple[List[str], List[int], Dict[str, int]]:
    raw = doc.get("files")
    if not isinstance(raw, list):
        raise fail(f"'files' must be a list, found {shown(raw)}")
    names: List[str] = []
    sizes: List[int] = []
    header_crcs: Dict[str, int] = {}
    for entry in raw:
        name = entry.get("name") if isinstance(entry, dict) else None
        size = _int(entry.get("size")) if isinstance(entry, dict) else None
        if not isinstance(name, str) or "/" in name or name.startswith(".") or size is None:
            raise fail(f"file entry {shown(entry)} needs a plain file name and a non-negative 'size'")
        names.append(name)
        sizes.append(size)
        if checksums:
            field = f"header_{ALGORITHM}"
            header_crcs[name] = crc_from_hex(entry.get(field), f"{fail.where!r}, file entry {name!r} field {field!r}")
    if len(set(names)) != len(names):
        raise fail("'files' lists a file twice")
    return names, sizes, header_crcs


def _tensor_entry(key: str, entry: Any, table: ShardTableFile, fail: _Fail) -> _Entry:
    """(dtype, global shape, rows, blocks, table crc, flattened) of a tensor entry, checked.

    Runs once per tensor of the checkpoint on every loading rank, so a well-formed entry takes a
    fast path; anything else gets the checks that word the error.
    """
    try:
        shape, at, blocks, crc_text = entry["global_shape"], entry["rows"], entry["blocks"], entry["table_crc32c"]
        flat = entry.get(FLATTENED, False)
        if (
            type(flat) is bool
            and type(shape) is list
            and type(at) is list
            and type(blocks) is list
            and len(at) == len(blocks) == 2
            and len(shape) <= table.ndim
            and all(type(v) is int and v >= 0 for v in (*shape, *at, *blocks))
            and at[0] + at[1] <= table.nrows
            and blocks[0] + blocks[1] <= table.nblocks
            and type(crc_text) is str
            and len(crc_text) == 8
        ):
            return (
                dtype_from_name(entry["dtype"]),
                tuple(shape),
                (at[0], at[1]),
                (blocks[0], blocks[1]),
                int(crc_text, 16),
                flat,
            )
    except (KeyError, TypeError, ValueError, CheckpointingException):
        pass
    return _checked_tensor_entry(key, entry, table, fail)


def _checked_tensor_entry(key: str, entry: Any, table: ShardTableFile, fail: _Fail) -> _Entry:
    """`_tensor_entry()`'s slow path: raises naming what is wrong."""
    if not isinstance(entry, dict):
        raise fail(f"a tensor entry must be a JSON object, found {shown(entry)}", key)
    name = entry.get("dtype")
    try:
        dtype = dtype_from_name(name if isinstance(name, str) else shown(name))
    except CheckpointingException as e:
        raise fail(str(e), key) from None
    shape, at, blocks = _ints(entry.get("global_shape")), _ints(entry.get("rows"), 2), _ints(entry.get("blocks"), 2)
    if shape is None or at is None or blocks is None or len(shape) > table.ndim:
        raise fail("'global_shape', 'rows' and 'blocks' must be lists of non-negative ints", key)
    if at[0] + at[1] > table.nrows or blocks[0] + blocks[1] > table.nblocks:
        raise fail(f"rows {list(at)} or blocks {list(blocks)} lie outside the shard table", key)
    crc = crc_from_hex(entry.get("table_crc32c"), f"{fail.where!r} (tensor {key!r}) field 'table_crc32c'")
    flat = entry.get(FLATTENED, False)
    if not isinstance(flat, bool):
        raise fail(f"'{FLATTENED}' must be true or false, found {shown(flat)}", key)
    return dtype, shape, (at[0], at[1]), (blocks[0], blocks[1]), crc, flat


def parse_v3(
    doc: Dict[str, Any], storage: Storage, where: str, block_bytes: Optional[int], description: str
) -> TensorIndex:
    """The `TensorIndex` of a version-3 index document (format and version already
    checked; ``block_bytes`` parsed from its ``checksum``, or None). ``storage`` is rooted at the
    files' directory, which holds the shard table; ``where`` names the index in messages.

    Checks the document and the table's size now, each tensor's rows when a load first needs
    them (see `TableTensor`).

    Raises:
        CorruptCheckpointError: naming the index file (and the key), for any malformed entry.
    """
    fail = _Fail(where)
    names, sizes, header_crcs = _files(doc, fail, block_bytes is not None)
    spec = doc.get("shard_table")
    if not isinstance(spec, dict):
        raise fail(f"'shard_table' must be a JSON object, found {shown(spec)}")
    table = ShardTableFile(spec, storage, fail)
    raw_tensors = doc.get("tensors")
    if not isinstance(raw_tensors, dict):
        raise fail(f"'tensors' must be a JSON object, found {shown(raw_tensors)}")
    spans: List[Tuple[int, int, int, int, int]] = []  # rows first, count; blocks first, count; crc
    tensors: Dict[str, StoredTensor] = {}
    rows = _TensorRows(table, names, np.asarray(sizes, dtype=np.int64), block_bytes, np.zeros((0, 5)), fail)
    for key, entry in raw_tensors.items():
        stored_key(key, f"safetensors index {where!r}")
        dtype, shape, at, blocks, crc, flat = _tensor_entry(key, entry, table, fail)
        check_tensor_bytes(shape, dtype.itemsize, f"safetensors index {where!r} (tensor {key!r})")
        tensors[key] = rows.tensors[key] = TableTensor(key, dtype, shape, rows, len(spans), flat)
        spans.append((*at, *blocks, crc))
    rows.entries = np.array(spans, dtype=np.int64).reshape(len(spans), 5)
    return TensorIndex(
        storage,
        tensors,
        file_sizes=dict(zip(names, sizes)),
        description=description,
        block_bytes=block_bytes,
        header_crcs=header_crcs,
        prefetch=rows.prefetch,
    )
