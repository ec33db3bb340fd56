"""The index of stored safetensors shards: its data model and the backend's ``index.json``.

:class:`TensorIndex` says where every stored tensor lives (file, byte range, box of the global
tensor): the ``safetensors`` backend reads it from its ``index.json`` (:func:`read_index`),
HuggingFace folders build it from their files' headers (:mod:`dist_ckpt.hf.folder`), and one
loader reads any sharding from it (:mod:`.load`). Dependencies point one way: :mod:`.format`
(the file format) <- this module <- :mod:`.write`, :mod:`.load`, :mod:`.verify` <- :mod:`.strategy`.

Layout inside a checkpoint directory::

    safetensors/index.json                      the global index (written last, by rank 0)
    safetensors/rank<rank>_<i>.safetensors      rank's main-replica shards, one file per writer
                                                thread (a valid safetensors file each)

``index.json`` (version 1) says which file and byte range holds which shard of which key::

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

A tensor saved as flattened ranges (distributed-optimizer state) has ``"flattened": true`` in its
entry (absent otherwise), so its metadata describes it as saved even when none of its shards
holds an element; indexes written before the field existed are read from the shards'
``flat_range``.

Version 2 adds crc32c checksums (see :mod:`dist_ckpt.integrity.checksums`); everything else is unchanged::

    {
      "format": "dist_ckpt.safetensors",
      "version": 2,
      "checksum": {"algorithm": "crc32c", "block_bytes": 1048576},
      "files": {"rank00000_0.safetensors": {"size": 1048704, "rank": 0,
                                            "header_crc32c": "1a2b3c4d"}, ...},   # the header bytes
      "tensors": {"decoder.w": {..., "shards": [{..., "crc32c": "0f1e2d3c..."}]}}
    }

A shard's ``crc32c`` holds 8 hex digits per block of its ``byte_range``: block ``i`` covers bytes
``begin + i * block_bytes`` up to the next block or the range's end, so a partial read verifies
only the blocks it touches. Version 1 indexes (no checksums) are still read; a save without
checksums (``SafetensorsSaveOptions(checksum_block_bytes=None)``) still writes version 1.

Every file, tensor and shard entry is a JSON object, so later versions can add fields without
changing the existing ones; readers ignore unknown fields. No pickle anywhere: the index is
plain JSON and the files are safetensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from dist_ckpt.backends.stored_shards import StoredShardInfo
from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError, IncompatibleStrategyError
from dist_ckpt.integrity.checksums import ALGORITHM, block_count, crc_from_hex, decode_block_crcs
from dist_ckpt.model.dtypes import dtype_from_name
from dist_ckpt.model.geometry import Box, ShardPiece, shard_pieces
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor
from dist_ckpt.model.stored_metadata import stored_tensor_metadata
from dist_ckpt.storage import Storage
from dist_ckpt.storage.location import LocationLike, resolve_location

__all__ = [
    "INDEX_FILENAME",
    "INDEX_FORMAT",
    "INDEX_VERSION",
    "READABLE_VERSIONS",
    "SAFETENSORS_DIR",
    "RankIndex",
    "StoredShard",
    "StoredTensor",
    "TensorIndex",
    "describe_tensor_index",
    "encode_shard",
    "file_name",
    "merge_rank_indexes",
    "parse_index",
    "rank_index",
    "read_index",
    "shard_name",
    "tensor_entry",
    "tensors_metadata",
]

SAFETENSORS_DIR = "safetensors"
INDEX_FILENAME = "index.json"
INDEX_FORMAT = "dist_ckpt.safetensors"
#: the version written with checksums; a save without them writes version 1
INDEX_VERSION = 2
READABLE_VERSIONS = (1, 2)

RankIndex = Dict[str, Any]  # {"files": {...}, "tensors": {...}} of one rank
#: field of a tensor entry: the tensor was saved as flattened ranges
FLATTENED = "flattened"
Shape = Tuple[int, ...]


# --------------------------------------------------------------------------- the data model


@dataclass(frozen=True)
class StoredShard:
    """One stored shard: a box (or a flattened range of a box) of a global tensor in a file.

    Attributes:
        file: file name, relative to the index's directory.
        name: tensor name inside the file.
        global_offset: offset of the shard's box in the global tensor.
        chunk_shape: shape of the shard's box (all global axes).
        flat_range: ``(start, stop)`` of the box's row-major flattening held, or None for all.
        byte_range: absolute ``(begin, end)`` byte offsets of the data in the file.
        crcs: crc32c of each block of ``byte_range`` (see ``TensorIndex.block_bytes``), or None
            when the checkpoint recorded none.
    """

    file: str
    name: str
    global_offset: Shape
    chunk_shape: Shape
    flat_range: Optional[Tuple[int, int]]
    byte_range: Tuple[int, int]
    crcs: Optional[Tuple[int, ...]] = None

    @property
    def stored_shape(self) -> Shape:
        """Shape of the tensor as written in the file (before any dtype re-encoding)."""
        if self.flat_range is not None:
            return (self.flat_range[1] - self.flat_range[0],)
        return self.chunk_shape

    def pieces(self) -> List[ShardPiece]:
        """The global boxes this shard holds; ``flat_offset`` is relative to its first element."""
        return shard_pieces(self.global_offset, self.chunk_shape, 0, self.flat_range)


@dataclass
class StoredTensor:
    """Everything stored about one global tensor; ``flattened``: it was saved as flattened
    ranges (distributed-optimizer state), which :func:`tensors_metadata` reports."""

    key: str
    dtype: torch.dtype
    global_shape: Shape
    shards: List[StoredShard] = field(default_factory=list)
    _grid: Optional[Dict[Shape, List[StoredShard]]] = field(default=None, repr=False)
    flattened: bool = False

    @property
    def bounds(self) -> Box:
        return Box((0,) * len(self.global_shape), self.global_shape)

    def overlapping(self, region: Box) -> Iterator[StoredShard]:
        """Stored shards whose box overlaps ``region`` (via the chunk grid when it is regular)."""
        if self._grid is None:
            self._grid = _grid_of(self.shards)
        if not self._grid:
            yield from (s for s in self.shards if Box(s.global_offset, s.chunk_shape).intersect(region))
            return
        chunk = self.shards[0].chunk_shape
        ranges = [range(o // c, (o + n - 1) // c + 1) for o, n, c in zip(region.offset, region.shape, chunk)]
        for idx in product(*ranges):
            yield from self._grid.get(tuple(idx), ())


def _grid_of(shards: Sequence[StoredShard]) -> Dict[Shape, List[StoredShard]]:
    """Shards by chunk index, or {} when the shards do not form a regular grid."""
    if not shards:
        return {}
    chunk = shards[0].chunk_shape
    grid: Dict[Shape, List[StoredShard]] = {}
    for s in shards:
        if s.chunk_shape != chunk or any(c == 0 or o % c for o, c in zip(s.global_offset, chunk)):
            return {}
        grid.setdefault(tuple(o // c for o, c in zip(s.global_offset, chunk)), []).append(s)
    return grid


@dataclass
class TensorIndex:
    """Where every stored tensor lives: which file, which byte range, which box.

    Both the ``safetensors`` backend (from its ``index.json``) and HuggingFace folders (from the
    files' headers) describe their tensors this way, so one loader
    (:func:`~dist_ckpt.backends.safetensors.load.load_from_index`) reads any sharding of either.

    Attributes:
        storage: the storage rooted at the files' directory (a ``LocalStorage`` of a local
            directory, or an object store); shards name their files relative to it.
        tensors: stored tensors by key.
        aliases: keys served by another stored key (tied parameters stored once).
        file_sizes: expected size of each file, when the index records it.
        description: names the checkpoint in error messages.
        from_headers: the index was built from the files' validated headers (HuggingFace
            folders), so a load does not read and check them again.
        block_bytes: block size of the shards' checksums (None: no checksums recorded).
        header_crcs: crc32c of each file's header bytes, when recorded.
    """

    storage: Storage
    tensors: Dict[str, StoredTensor]
    aliases: Dict[str, str] = field(default_factory=dict)
    file_sizes: Dict[str, int] = field(default_factory=dict)
    description: str = ""
    from_headers: bool = False
    block_bytes: Optional[int] = None
    header_crcs: Dict[str, int] = field(default_factory=dict)

    def file_location(self, name: str) -> str:
        """Where file ``name`` is, for messages: its path, or its object's URL."""
        return self.storage.url_of(name)

    def lookup(self, key: str) -> Optional[StoredTensor]:
        """The stored tensor for ``key`` (following an alias), or None."""
        found = self.tensors.get(key)
        if found is None and key in self.aliases:
            found = self.tensors.get(self.aliases[key])
        return found


def tensors_metadata(index: TensorIndex) -> ShardedStateDict:
    """``{key: ShardedTensor}`` (whole, unsharded, data on the meta device) for every tensor, as
    it was saved: a tensor saved as flattened ranges is one flattened range covering all of it
    (see :mod:`dist_ckpt.model.stored_metadata`).

    Example::

        meta = tensors_metadata(read_index(ckpt))
        meta["decoder.w"].global_shape, meta["decoder.w"].dtype
    """
    out: ShardedStateDict = {}
    for key in sorted(set(index.tensors) | set(index.aliases)):
        info = index.lookup(key)
        if info is not None:
            out[key] = stored_tensor_metadata(key, info.dtype, info.global_shape, info.flattened)
    return out


def describe_tensor_index(index: TensorIndex, prefix: str = "") -> Dict[str, List[StoredShardInfo]]:
    """The stored pieces of every tensor of a :class:`TensorIndex` (for ``dist-ckpt inspect``);
    ``prefix`` is the files' directory relative to the checkpoint (``"safetensors/"``). A tied
    name stored once (an alias) is described by the pieces of the name it shares them with.

    Example::

        describe_tensor_index(read_index(ckpt), "safetensors/")["w"][0].nbytes
    """
    out: Dict[str, List[StoredShardInfo]] = {}
    for key in sorted(set(index.tensors) | set(index.aliases)):
        stored = index.lookup(key)
        if stored is None:
            continue
        out[key] = [
            StoredShardInfo(
                tuple(s.global_offset),
                tuple(s.chunk_shape),
                s.flat_range,
                prefix + s.file,
                s.byte_range[1] - s.byte_range[0],
            )
            for s in stored.shards
        ]
    return out


# --------------------------------------------------------------------------- writing the document


def file_name(rank: int, writer: int) -> str:
    """Name of the file that writer thread ``writer`` of ``rank`` writes.

    Example::

        file_name(3, 1)   # "rank00003_1.safetensors"
    """
    return f"rank{rank:05d}_{writer}.safetensors"


def shard_name(sh: ShardedTensor) -> str:
    """Name of a shard inside its safetensors file: key, chunk offset and flat start.

    Example::

        shard_name(ShardedTensor.from_rank_offsets("w", torch.empty(2, 4), (0, 1, 2)))   # "w@2.0"
    """
    name = f"{sh.key}@{'.'.join(map(str, sh.global_offset))}"
    if sh.flattened_range is not None:
        name += f"+{sh.flattened_range.start}"
    return name


def encode_shard(
    sh: ShardedTensor, file: str, byte_range: Tuple[int, int], crcs: Optional[str] = None
) -> Dict[str, Any]:
    """The index entry of one saved shard; ``crcs`` its encoded block checksums (version 2).

    Example::

        encode_shard(sh, "rank00000_0.safetensors", (128, 160))["byte_range"]   # [128, 160]
    """
    rng = sh.flattened_range
    entry: Dict[str, Any] = {
        "file": file,
        "name": shard_name(sh),
        "global_offset": list(sh.global_offset),
        "chunk_shape": list(sh.full_local_shape),
        "flat_range": None if rng is None else [rng.start, rng.stop],
        "byte_range": [byte_range[0], byte_range[1]],
    }
    if crcs is not None:
        entry[ALGORITHM] = crcs
    return entry


def merge_rank_indexes(per_rank: Sequence[RankIndex], block_bytes: Optional[int] = None) -> Dict[str, Any]:
    """The global index document from every rank's part (runs on rank 0): version 2 with
    checksums of ``block_bytes`` blocks, version 1 without (``block_bytes=None``).

    Example::

        doc = merge_rank_indexes(gather_json(local_part), block_bytes=1 << 20)   # on rank 0

    Raises:
        CheckpointingException: two ranks describe a key with different dtypes or global shapes,
            or write the same file.
    """
    files: Dict[str, Any] = {}
    tensors: Dict[str, Any] = {}
    for rank, part in enumerate(per_rank):
        for name, entry in part["files"].items():
            if name in files:
                raise CheckpointingException(f"ranks {files[name]['rank']} and {rank} both wrote {name!r}")
            files[name] = entry
        for key, entry in part["tensors"].items():
            merged = tensors.setdefault(
                key, {"dtype": entry["dtype"], "global_shape": entry["global_shape"], "shards": []}
            )
            if (merged["dtype"], merged["global_shape"]) != (entry["dtype"], entry["global_shape"]):
                raise CheckpointingException(
                    f"tensor {key!r}: rank {rank} saves it as {entry['dtype']} {entry['global_shape']}, another rank "
                    f"as {merged['dtype']} {merged['global_shape']}; every rank must agree"
                )
            if entry.get(FLATTENED):
                merged[FLATTENED] = True
            merged["shards"].extend(entry["shards"])
    doc: Dict[str, Any] = {"format": INDEX_FORMAT, "version": 1}
    if block_bytes is not None:
        doc.update(version=INDEX_VERSION, checksum={"algorithm": ALGORITHM, "block_bytes": block_bytes})
    doc.update(files=files, tensors=dict(sorted(tensors.items())))
    return doc


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
            raise self.fail(f"{what} must be a JSON object, found {value!r}", key)
        return value

    def ints(self, value: Any, what: str, key: str, length: Optional[int] = None) -> Tuple[int, ...]:
        if (
            not isinstance(value, list)
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
            or (length is not None and len(value) != length)
        ):
            size = "" if length is None else f" of length {length}"
            raise self.fail(f"{what} must be a list{size} of non-negative ints, found {value!r}", key)
        return tuple(value)

    def shard(self, raw: Any, key: str, ndim: int, files: Dict[str, int]) -> StoredShard:
        entry = self.obj(raw, "a shard entry", key)
        file, name = entry.get("file"), entry.get("name")
        if not isinstance(file, str) or file not in files:
            raise self.fail(f"shard names file {file!r}, which the index does not list", key)
        if not isinstance(name, str):
            raise self.fail(f"shard 'name' must be a string, found {name!r}", key)
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
        entry = self.obj(raw, "a tensor entry", key)
        dtype_name = entry.get("dtype")
        try:
            dtype = dtype_from_name(dtype_name if isinstance(dtype_name, str) else repr(dtype_name))
        except CheckpointingException as e:
            raise self.fail(str(e), key) from None
        shape = self.ints(entry.get("global_shape"), "global_shape", key)
        shards = entry.get("shards")
        if not isinstance(shards, list):
            raise self.fail(f"'shards' must be a list, found {shards!r}", key)
        stored = [self.shard(s, key, len(shape), files) for s in shards]
        flag = entry.get(FLATTENED, False)
        if not isinstance(flag, bool):
            raise self.fail(f"'{FLATTENED}' must be true or false, found {flag!r}", key)
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
    """The :class:`TensorIndex` described by an index document; validates every field.

    ``storage`` is rooted at the files' directory (``<checkpoint>/safetensors``, which holds the
    index itself); messages name the index by its path or URL.

    Raises:
        CorruptCheckpointError: naming the index file and the key, for any malformed entry.
        IncompatibleStrategyError: for an index of a newer version.

    Example::

        index = parse_index(json.loads(raw), LocalStorage("ckpt/iter_10/safetensors"))
    """
    p = _Parser(storage.url_of(INDEX_FILENAME))
    doc = p.obj(doc, "the index")
    if doc.get("format") != INDEX_FORMAT:
        raise p.fail(f"'format' is {doc.get('format')!r}, expected {INDEX_FORMAT!r}")
    version = doc.get("version")
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        raise IncompatibleStrategyError(
            f"safetensors index {p.path!r} has version {version!r}; this dist_ckpt reads versions "
            f"{list(READABLE_VERSIONS)}: upgrade dist_ckpt"
        )
    if version >= 2:
        p.block_bytes = _checksum_spec(p, doc.get("checksum"))
    files: Dict[str, int] = {}
    header_crcs: Dict[str, int] = {}
    for name, entry in p.obj(doc.get("files"), "'files'").items():
        size = p.obj(entry, f"file entry {name!r}").get("size")
        if "/" in name or name.startswith(".") or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise p.fail(f"file entry {name!r} needs a plain file name and a non-negative 'size', found {entry!r}")
        files[name] = size
        if p.block_bytes is not None:
            field_name = f"header_{ALGORITHM}"
            header_crcs[name] = crc_from_hex(
                entry.get(field_name), f"safetensors index {p.path!r}, file entry {name!r} field {field_name!r}"
            )
    tensors = {key: p.tensor(key, raw, files) for key, raw in p.obj(doc.get("tensors"), "'tensors'").items()}
    return TensorIndex(
        storage,
        tensors,
        file_sizes=files,
        description=repr(storage.url.rsplit("/", 1)[0]),
        block_bytes=p.block_bytes,
        header_crcs=header_crcs,
    )


def _checksum_spec(p: _Parser, raw: Any) -> int:
    spec = p.obj(raw, "'checksum'")
    if spec.get("algorithm") != ALGORITHM:
        raise p.fail(f"'checksum' field 'algorithm' is {spec.get('algorithm')!r}, expected {ALGORITHM!r}")
    block = spec.get("block_bytes")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise p.fail(f"'checksum' field 'block_bytes' must be a positive int, found {block!r}")
    return block


def read_index(checkpoint_dir: LocationLike) -> TensorIndex:
    """Read and validate ``<checkpoint_dir>/safetensors/index.json`` (a directory or an object store).

    Example::

        index = read_index("ckpt/iter_1000")
        index.tensors["decoder.w"].shards[0].file   # "rank00000_0.safetensors"
    """
    location = resolve_location(checkpoint_dir)
    storage = location.child(SAFETENSORS_DIR)  # the index names its files relative to safetensors/
    where = storage.url_of(INDEX_FILENAME)
    try:
        raw = storage.read(INDEX_FILENAME)
    except FileNotFoundError:  # ObjectNotFoundError is one
        raise CorruptCheckpointError(
            f"{where!r} is missing: the safetensors part of checkpoint {location.url!r} is incomplete"
        ) from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"safetensors index {where!r} is not valid JSON: {e}") from e
    return parse_index(doc, storage)


def rank_index(
    files: Dict[str, int], rank: int, tensors: Dict[str, Dict[str, Any]], header_crcs: Optional[Dict[str, str]] = None
) -> RankIndex:
    """One rank's part of the index, as sent to rank 0 (``header_crcs``: hex crc of each file's
    header, with checksums)."""
    entries: Dict[str, Dict[str, Any]] = {name: {"size": size, "rank": rank} for name, size in files.items()}
    for name, crc in (header_crcs or {}).items():
        entries[name][f"header_{ALGORITHM}"] = crc
    return {"files": entries, "tensors": tensors}


def tensor_entry(
    dtype_name: str, global_shape: Sequence[int], shards: List[Dict[str, Any]], flattened: bool = False
) -> Dict[str, Any]:
    """The index entry of one tensor (one rank's shards of it); ``flattened``: saved as
    flattened ranges."""
    entry: Dict[str, Any] = {"dtype": dtype_name, "global_shape": list(global_shape), "shards": shards}
    if flattened:
        entry[FLATTENED] = True
    return entry
