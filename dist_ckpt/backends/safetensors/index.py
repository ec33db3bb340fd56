"""The safetensors backend's index: ``index.json`` (and, from version 3, its shard table).

`read_index()` reads it into a `TensorIndex` (the data model every
safetensors reader shares: where every stored tensor lives -- file, byte range, box of the global
tensor), from which one loader reads any sharding (`load`). Dependencies point one way:
`format` <- `write` <- `index_parts` <- `index_v3` (with
`tensor_index`) <- this module <- `index_write`, `load`, `verify` <-
[`strategy`][dist_ckpt.backends.safetensors.strategy].

Layout inside a checkpoint directory:

```text
safetensors/index.json                      the global index (written last, by rank 0)
safetensors/index.<crc>.bin                 its shard table (version 3, written just before)
safetensors/rank<rank>_<i>.safetensors      rank's main-replica shards, one file per writer
                                            thread (a valid safetensors file each)
```

``index.json`` (version 1) says which file and byte range holds which shard of which key:

```text
{
  "format": "dist_ckpt.safetensors",
  "version": 1,
  "files": {"rank00000_0.safetensors": {"size": 1048704, "rank": 0}, ...},
  "tensors": {
    "decoder.w": {
      "dtype": "bfloat16",                 # dist_ckpt.model.dtypes name
      "global_shape": [1024, 512],
      "shards": [
        {"file": "rank00000_0.safetensors", "name": "decoder.w@0.0",
         "global_offset": [0, 0], "chunk_shape": [512, 512],
         "flat_range": null,               # or [start, stop] of the chunk's flattening
         "byte_range": [128, 524416]}      # absolute offsets in the file
      ]
    }
  }
}
```

A tensor saved as flattened ranges (distributed-optimizer state) has ``"flattened": true`` in its
entry (absent otherwise), so its metadata describes it as saved even when none of its shards
holds an element; indexes of versions 1 and 2 written before the field existed are read from the
shards' ``flat_range`` (version 3 records it from the start).

Version 2 adds crc32c checksums (see [`dist_ckpt.integrity.checksums`][dist_ckpt.integrity.checksums]); everything else
is unchanged:

```text
{
  "format": "dist_ckpt.safetensors",
  "version": 2,
  "checksum": {"algorithm": "crc32c", "block_bytes": 1048576},
  "files": {"rank00000_0.safetensors": {"size": 1048704, "rank": 0,
                                        "header_crc32c": "1a2b3c4d"}, ...},   # the header bytes
  "tensors": {"decoder.w": {..., "shards": [{..., "crc32c": "0f1e2d3c..."}]}}
}
```

A shard's ``crc32c`` holds 8 hex digits per block of its ``byte_range``: block ``i`` covers bytes
``begin + i * block_bytes`` up to the next block or the range's end, so a partial read verifies
only the blocks it touches.

Version 3 (what a save writes, with or without checksums) keeps ``index.json`` small -- the files,
and per tensor its dtype, global shape and where its shards are -- and stores the shards as rows
of a binary table, ``index.<crc>.bin``, so that a rank loading a checkpoint of a million shards
reads and checks only the rows of the tensors it loads (see `index_v3`). Versions 1 and 2
are still read.

Every file, tensor and shard entry of versions 1 and 2 is a JSON object, so later versions can
add fields without changing the existing ones; readers ignore unknown fields. No pickle anywhere:
the index is plain JSON (and, from version 3, a table of little-endian integers) and the files are
safetensors.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional, Sequence, Tuple

from dist_ckpt.backends.safetensors import index_v3
from dist_ckpt.backends.safetensors.index_parts import MergedIndex
from dist_ckpt.backends.safetensors.tensor_index import (
    FLATTENED,
    StoredShard,
    StoredTensor,
    TensorIndex,
    describe_tensor_index,
    tensors_metadata,
)
from dist_ckpt.backends.stored_shards import stored_key
from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError, IncompatibleStrategyError
from dist_ckpt.integrity.checksums import ALGORITHM, block_count, crc_from_hex, decode_block_crcs
from dist_ckpt.integrity.safe_json import check_tensor_bytes, loads, shown
from dist_ckpt.model.dtypes import dtype_from_name
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.record.commit import METADATA_FILENAME, lacks_dist_ckpt_record, read_integrity_records
from dist_ckpt.record.records import read_recorded
from dist_ckpt.storage import Storage
from dist_ckpt.storage.location import LocationLike, resolve_location

__all__ = [
    "FLATTENED",
    "INDEX_FILENAME",
    "INDEX_FORMAT",
    "INDEX_VERSION",
    "READABLE_VERSIONS",
    "SAFETENSORS_DIR",
    "StoredShard",
    "StoredTensor",
    "TensorIndex",
    "describe_tensor_index",
    "file_name",
    "index_files",
    "parse_index",
    "read_index",
    "shard_name",
    "tensors_metadata",
]

SAFETENSORS_DIR = "safetensors"
INDEX_FILENAME = "index.json"
INDEX_FORMAT = "dist_ckpt.safetensors"
#: the version a save writes (with or without block checksums)
INDEX_VERSION = index_v3.VERSION
READABLE_VERSIONS = (1, 2, 3)


# --------------------------------------------------------------------------- writing the document


def file_name(rank: int, writer: int) -> str:
    """Name of the file that writer thread ``writer`` of ``rank`` writes.

    Example:

    ```python
    file_name(3, 1)   # "rank00003_1.safetensors"
    ```
    """
    return f"rank{rank:05d}_{writer}.safetensors"


def shard_name(sh: ShardedTensor) -> str:
    """Name of a shard inside its safetensors file: key, chunk offset and flat start.

    Example:

    ```python
    shard_name(ShardedTensor.from_rank_offsets("w", torch.empty(2, 4), (0, 1, 2)))   # "w@2.0"
    ```
    """
    name = f"{sh.key}@{'.'.join(map(str, sh.global_offset))}"
    if sh.flattened_range is not None:
        name += f"+{sh.flattened_range.start}"
    return name


def index_files(merged: MergedIndex, block_bytes: Optional[int]) -> Tuple[bytes, bytes, str]:
    """``(index.json bytes, shard table bytes, shard table file name)`` of the current version
    for a merged index (block checksums of ``block_bytes``, or none).

    Example:

    ```python
    doc, table, table_name = index_files(merge_index_parts(gather_bytes(part)), 1 << 20)   # rank 0
    ```
    """
    doc, table, name = index_v3.v3_document(merged, block_bytes, {"format": INDEX_FORMAT, "version": INDEX_VERSION})
    return json.dumps(doc, separators=(",", ":")).encode("utf-8"), table, name


# --------------------------------------------------------------------------- reading


class _Parser:
    """Validates an index document field by field; every error names the index and the key."""

    def __init__(self, path: str, block_bytes: Optional[int] = None) -> None:
        self.path = path
        self.block_bytes = block_bytes  # checksums are required per shard when set (version 2)

    def fail(self, problem: str, key: Optional[str] = None) -> CorruptCheckpointError:
        where = f" (tensor {key!r})" if key is not None else ""
        return CorruptCheckpointError(f"safetensors index {self.path!r}{where}: {problem}")

    def obj(self, value: Any, what: str, key: Optional[str] = None) -> Dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{what} must be a JSON object, found {shown(value)}", key)
        return value

    def ints(self, value: Any, what: str, key: str, length: Optional[int] = None) -> Tuple[int, ...]:
        if (
            not isinstance(value, list)
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
            or (length is not None and len(value) != length)
        ):
            size = "" if length is None else f" of length {length}"
            raise self.fail(f"{what} must be a list{size} of non-negative ints, found {shown(value)}", key)
        return tuple(value)

    def shard(self, raw: Any, key: str, ndim: int, files: Dict[str, int]) -> StoredShard:
        entry = self.obj(raw, "a shard entry", key)
        file, name = entry.get("file"), entry.get("name")
        if not isinstance(file, str) or file not in files:
            raise self.fail(f"shard names file {shown(file)}, which the index does not list", key)
        if not isinstance(name, str):
            raise self.fail(f"shard 'name' must be a string, found {shown(name)}", key)
        offset = self.ints(entry.get("global_offset"), "global_offset", key, ndim)
        chunk = self.ints(entry.get("chunk_shape"), "chunk_shape", key, ndim)
        flat = entry.get("flat_range")
        rng = None if flat is None else self.ints(flat, "flat_range", key, 2)
        if rng is not None and not rng[0] <= rng[1] <= _prod(chunk):
            raise self.fail(f"flat_range {list(rng)} does not fit a chunk of shape {list(chunk)}", key)
        byte_range = self.ints(entry.get("byte_range"), "byte_range", key, 2)
        if not byte_range[0] <= byte_range[1] <= files[file]:
            raise self.fail(f"byte_range {list(byte_range)} lies outside {file!r} ({files[file]} bytes)", key)
        flat_range = None if rng is None else (rng[0], rng[1])
        crcs = None
        if self.block_bytes is not None:
            blocks = block_count(byte_range[1] - byte_range[0], self.block_bytes)
            where = f"safetensors index {self.path!r} (tensor {key!r}, shard {name!r})"
            crcs = decode_block_crcs(entry.get(ALGORITHM), blocks, where)
        return StoredShard(file, name, offset, chunk, flat_range, (byte_range[0], byte_range[1]), crcs)

    def tensor(self, key: str, raw: Any, files: Dict[str, int]) -> StoredTensor:
        stored_key(key, f"safetensors index {self.path!r}")
        entry = self.obj(raw, "a tensor entry", key)
        dtype_name = entry.get("dtype")
        try:
            dtype = dtype_from_name(dtype_name if isinstance(dtype_name, str) else shown(dtype_name))
        except CheckpointingException as e:
            raise self.fail(str(e), key) from None
        shape = self.ints(entry.get("global_shape"), "global_shape", key)
        check_tensor_bytes(shape, dtype.itemsize, f"safetensors index {self.path!r} (tensor {key!r})")
        shards = entry.get("shards")
        if not isinstance(shards, list):
            raise self.fail(f"'shards' must be a list, found {shown(shards)}", key)
        stored = [self.shard(s, key, len(shape), files) for s in shards]
        flag = entry.get(FLATTENED, False)
        if not isinstance(flag, bool):
            raise self.fail(f"'{FLATTENED}' must be true or false, found {shown(flag)}", key)
        for s in stored:
            if any(o + c > g for o, c, g in zip(s.global_offset, s.chunk_shape, shape)):
                raise self.fail(
                    f"shard at {list(s.global_offset)} of shape {list(s.chunk_shape)} exceeds {list(shape)}", key
                )
            numel = _prod(s.stored_shape)
            if s.byte_range[1] - s.byte_range[0] != numel * dtype.itemsize:
                raise self.fail(
                    f"shard {s.name!r} spans {s.byte_range[1] - s.byte_range[0]} bytes, expected "
                    f"{numel * dtype.itemsize}",
                    key,
                )
        flattened = flag or any(s.flat_range is not None for s in stored)
        return StoredTensor(key, dtype, shape, stored, flattened=flattened)


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def parse_index(doc: Any, storage: Storage) -> TensorIndex:
    """The `TensorIndex` described by an index document; validates every field.

    ``storage`` is rooted at the files' directory (``<checkpoint>/safetensors``, which holds the
    index itself); messages name the index by its path or URL.

    Raises:
        CorruptCheckpointError: naming the index file and the key, for any malformed entry.
        IncompatibleStrategyError: for an index of a newer version.

    Example:

    ```python
    index = parse_index(json.loads(raw), LocalStorage("ckpt/iter_10/safetensors"))
    ```
    """
    p = _Parser(storage.url_of(INDEX_FILENAME))
    doc = p.obj(doc, "the index")
    if doc.get("format") != INDEX_FORMAT:
        raise p.fail(f"'format' is {shown(doc.get('format'))}, expected {INDEX_FORMAT!r}")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version not in READABLE_VERSIONS:
        raise IncompatibleStrategyError(
            f"safetensors index {p.path!r} has version {shown(version)}; this dist_ckpt reads versions "
            f"{list(READABLE_VERSIONS)}: upgrade dist_ckpt"
        )
    description = repr(storage.url.rsplit("/", 1)[0])
    if version == index_v3.VERSION:
        block = None if doc.get("checksum") is None else _checksum_spec(p, doc.get("checksum"))
        return index_v3.parse_v3(doc, storage, p.path, block, description)
    if version >= 2:
        p.block_bytes = _checksum_spec(p, doc.get("checksum"))
    files: Dict[str, int] = {}
    header_crcs: Dict[str, int] = {}
    for name, entry in p.obj(doc.get("files"), "'files'").items():
        size = p.obj(entry, f"file entry {name!r}").get("size")
        if "/" in name or name.startswith(".") or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise p.fail(f"file entry {name!r} needs a plain file name and a non-negative 'size', found {shown(entry)}")
        files[name] = size
        if p.block_bytes is not None:
            field_name = f"header_{ALGORITHM}"
            header_crcs[name] = crc_from_hex(
                entry.get(field_name), f"safetensors index {p.path!r}, file entry {name!r} field {field_name!r}"
            )
    tensors = {key: p.tensor(key, raw, files) for key, raw in p.obj(doc.get("tensors"), "'tensors'").items()}
    return TensorIndex(
        storage, tensors, file_sizes=files, description=description, block_bytes=p.block_bytes, header_crcs=header_crcs
    )


def _checksum_spec(p: _Parser, raw: Any) -> int:
    spec = p.obj(raw, "'checksum'")
    if spec.get("algorithm") != ALGORITHM:
        raise p.fail(f"'checksum' field 'algorithm' is {shown(spec.get('algorithm'))}, expected {ALGORITHM!r}")
    block = spec.get("block_bytes")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise p.fail(f"'checksum' field 'block_bytes' must be a positive int, found {shown(block)}")
    return block


def read_index(checkpoint_dir: LocationLike) -> TensorIndex:
    """Read and validate ``<checkpoint_dir>/safetensors/index.json`` (a directory or an object store).

    Example:

    ```python
    index = read_index("ckpt/iter_1000")
    index.tensors["decoder.w"].shards[0].file   # "rank00000_0.safetensors"
    ```
    """
    location = resolve_location(checkpoint_dir)
    storage = location.child(SAFETENSORS_DIR)  # the index names its files relative to safetensors/
    where = storage.url_of(INDEX_FILENAME)
    raw = read_recorded(location, f"{SAFETENSORS_DIR}/{INDEX_FILENAME}")  # fails closed
    if read_integrity_records(location) is None and lacks_dist_ckpt_record(location):
        # only dist_ckpt writes this backend, and every save records itself: both were removed,
        # which would otherwise read as another tool's checkpoint and load unverified
        raise CorruptCheckpointError(
            f"{location.url_of(METADATA_FILENAME)!r} has neither the 'dist_ckpt' record nor integrity records, "
            f"which every save of the safetensors backend writes: they were removed, and {where!r} cannot be "
            "checked; the checkpoint is corrupt ('dist-ckpt verify' lists every problem)"
        )
    if raw is None:
        raise CorruptCheckpointError(
            f"{where!r} is missing: the safetensors part of checkpoint {location.url!r} is incomplete"
        )
    return parse_index(loads(raw, f"safetensors index {where!r}"), storage)
