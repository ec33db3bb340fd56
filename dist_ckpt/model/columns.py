"""A compact, pickle-free byte encoding of integer columns and string tables.

Metadata that grows with ranks x tensors (the shard metadata gathered for validation, the
safetensors index parts gathered to rank 0) travels as one *column blob* per rank instead of one
JSON object per shard: a few integer arrays, each stored with the narrowest signed integer type
that holds its values, and a few string tables, each zlib-compressed. Decoding is a handful of
``numpy.frombuffer`` calls, so rank 0 decodes a thousand blobs in milliseconds, and identical
string tables (ranks of one pipeline stage hold the same keys) are decoded once when the caller
passes a cache.

Layout:

```text
b"DCKC" | u32 LE header length | header (JSON) | string sections | column section
```

The header lists each string table (name, count, encoding, compressed size) and each column
(name, numpy dtype, shape); the column section is one zlib stream of every column's bytes in
that order. A string table is its strings joined by ``"\\n"`` (or a JSON list when a string holds
a newline), zlib-compressed.

Example:

```python
blob = pack_columns({"offset": np.array([[0, 4], [4, 0]])}, {"keys": ["a", "b"]}, {"rank": 3})
unpacked = unpack_columns(blob, "rank 3's shard metadata")
unpacked.columns["offset"].tolist(), unpacked.strings["keys"], unpacked.meta["rank"]
```
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, MutableMapping, Optional, Sequence, Tuple

import numpy as np

from dist_ckpt.errors import CorruptCheckpointError

__all__ = ["ColumnBlob", "narrowest", "pack_columns", "unpack_columns"]

_MAGIC = b"DCKC"
_VERSION = 1
_HEADER = struct.Struct("<I")
#: zlib level: 1 is several times faster than the default and loses little on these tables
_LEVEL = 1
_INT_TYPES = (np.int8, np.int16, np.int32, np.int64)


def narrowest(values: np.ndarray) -> np.ndarray:
    """``values`` (integers) as the narrowest signed integer type that holds them.

    Example:

    ```python
    narrowest(np.array([-1, 300])).dtype   # int16
    ```
    """
    if values.size == 0:
        return values.astype(np.int8)
    lo, hi = int(values.min()), int(values.max())
    for t in _INT_TYPES:
        info = np.iinfo(t)
        if info.min <= lo and hi <= info.max:
            return values.astype(t, copy=False)
    raise CorruptCheckpointError(f"integer column values {lo}..{hi} do not fit in 64 bits")


def _encode_strings(strings: Sequence[str]) -> Tuple[str, bytes]:
    if not any("\n" in s for s in strings):
        return "lines", "\n".join(strings).encode("utf-8")
    return "json", json.dumps(list(strings), separators=(",", ":")).encode("utf-8")


def pack_columns(
    columns: Mapping[str, np.ndarray], strings: Mapping[str, Sequence[str]], meta: Optional[Dict[str, Any]] = None
) -> bytes:
    """Encode integer ``columns`` (any shape), string tables and a small JSON-able ``meta``.

    Integer columns are narrowed (`narrowest()`); boolean columns travel as int8.
    """
    header: Dict[str, Any] = {"version": _VERSION, "meta": meta or {}, "strings": [], "columns": []}
    sections: List[bytes] = []
    for name, table in strings.items():
        encoding, raw = _encode_strings(table)
        packed = zlib.compress(raw, _LEVEL)
        header["strings"].append([name, len(table), encoding, len(packed)])
        sections.append(packed)
    raw_columns: List[bytes] = []
    for name, values in columns.items():
        array = narrowest(np.ascontiguousarray(values).astype(np.int64, copy=False))
        header["columns"].append([name, array.dtype.str, list(array.shape)])
        raw_columns.append(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
    sections.append(zlib.compress(b"".join(raw_columns), _LEVEL))
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return b"".join([_MAGIC, _HEADER.pack(len(head)), head, *sections])


@dataclass
class ColumnBlob:
    """What `unpack_columns()` decoded.

    Attributes:
        columns: integer arrays by name (narrowest dtype, little endian, read-only views).
        strings: string tables by name.
        meta: the JSON-able ``meta`` given to `pack_columns()`.
        string_sections: the compressed bytes of each string table (equal bytes, equal table).
    """

    columns: Dict[str, np.ndarray]
    strings: Dict[str, List[str]]
    meta: Dict[str, Any]
    string_sections: Dict[str, bytes]


def _decode_strings(raw: bytes, encoding: str, count: int, where: str) -> List[str]:
    text = raw.decode("utf-8")
    if encoding == "json":
        table = json.loads(text)
    elif encoding == "lines":
        table = text.split("\n") if count else []
    else:
        raise CorruptCheckpointError(f"{where}: unknown string encoding {encoding!r}")
    if not isinstance(table, list) or len(table) != count or not all(isinstance(s, str) for s in table):
        raise CorruptCheckpointError(f"{where}: a string table does not hold the {count} strings its header says")
    return table


def unpack_columns(
    data: bytes, where: str, string_cache: Optional[MutableMapping[bytes, List[str]]] = None
) -> ColumnBlob:
    """Decode a blob of `pack_columns()`; ``where`` names it in errors.

    With ``string_cache`` (compressed section -> strings), a string table seen before is not
    decoded again; the cached list is returned (do not modify it).

    Raises:
        CorruptCheckpointError: the bytes are not such a blob, or are damaged.
    """
    try:
        if data[:4] != _MAGIC:
            raise CorruptCheckpointError(f"{where} is not a dist_ckpt column blob")
        (size,) = _HEADER.unpack_from(data, 4)
        header = json.loads(bytes(data[8 : 8 + size]).decode("utf-8"))
        if not isinstance(header, dict) or header.get("version") != _VERSION:
            raise CorruptCheckpointError(f"{where}: unsupported column blob version; every rank must run one dist_ckpt")
        pos = 8 + size
        strings: Dict[str, List[str]] = {}
        sections: Dict[str, bytes] = {}
        for name, count, encoding, nbytes in header["strings"]:
            packed = bytes(data[pos : pos + nbytes])
            pos += nbytes
            cached = None if string_cache is None else string_cache.get(packed)
            if cached is None:
                cached = _decode_strings(zlib.decompress(packed), encoding, count, where)
                if string_cache is not None:
                    string_cache[packed] = cached
            strings[name], sections[name] = cached, packed
        raw = zlib.decompress(bytes(data[pos:]))
        columns: Dict[str, np.ndarray] = {}
        offset = 0
        for name, dtype, shape in header["columns"]:
            dt = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            columns[name] = np.frombuffer(raw, dtype=dt, count=count, offset=offset).reshape(shape)
            offset += count * dt.itemsize
        if offset != len(raw):
            raise CorruptCheckpointError(f"{where}: the columns hold {len(raw)} bytes, the header describes {offset}")
        return ColumnBlob(columns, strings, header["meta"], sections)
    except CorruptCheckpointError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, struct.error, zlib.error) as e:
        raise CorruptCheckpointError(f"{where} is damaged: {e}") from e
