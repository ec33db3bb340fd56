"""Reading the metadata of a zarr-format checkpoint: plain JSON, no array library needed.

Every tensor's ``zarr.json`` is parsed and checked here (`open_tensor_info()`): its key,
dtype, shape, chunk grid, and for tensors saved as flattened ranges every fragment; a malformed
document is a [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError] naming the file. The tensors of a
checkpoint are found by listing ``zarr/`` (`list_tensor_names()`), checked against the
checksum manifest so that a deleted tensor directory is noticed. After a failed read,
`damaged_chunks()` names the missing or wrongly sized chunk files; `describe_zarr()`
describes the stored pieces for ``dist-ckpt inspect``.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from itertools import product
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from dist_ckpt.backends.stored_shards import StoredShardInfo, stored_key
from dist_ckpt.backends.zarr.layout import (
    ATTR,
    CHECKSUMS_FILENAME,
    LAYOUT_CHUNKED,
    LAYOUT_FLATTENED,
    ZARR_DIR,
    chunk_coords,
    chunk_key,
    tensor_dir_name,
)
from dist_ckpt.backends.zarr.nodes import stored_numpy_dtype
from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError, format_keys
from dist_ckpt.integrity.safe_json import MAX_SMALL_JSON_BYTES, check_tensor_bytes, loads, shown, want_object
from dist_ckpt.model.dtypes import dtype_from_name, dtype_info
from dist_ckpt.model.geometry import Box, ShardPiece, shard_pieces
from dist_ckpt.model.sharded import ShardedStateDict
from dist_ckpt.model.stored_metadata import stored_tensor_metadata
from dist_ckpt.model.tiling import tiling_problem
from dist_ckpt.storage import encode_key
from dist_ckpt.storage.object_path import ObjectPath, subdirs

__all__ = [
    "FragmentInfo",
    "JsonCheck",
    "JsonIndex",
    "StoredTensorInfo",
    "check_tensor_dirs_present",
    "chunk_separator",
    "damaged_chunks",
    "describe_zarr",
    "find_tensor_info",
    "list_tensor_names",
    "open_tensor_info",
    "plain_chunk_bytes",
    "read_zarr_json",
    "tensors_metadata",
]

Shape = Tuple[int, ...]

#: checks the bytes of a ``zarr.json`` just read (against the checksum manifest; see
#: :func:`dist_ckpt.backends.zarr.checksums.manifest_check`), raising if they differ
JsonCheck = Optional[Callable[[ObjectPath, bytes], None]]

#: ``zarr.json`` bytes already read and checked, by path: the root group's index of a checkpoint
#: (`dist_ckpt.backends.zarr.metadata_index`), used instead of reading those files
JsonIndex = Optional[Mapping[ObjectPath, bytes]]


def read_zarr_json(node_dir: ObjectPath, check: JsonCheck = None, index: JsonIndex = None) -> Optional[Dict[str, Any]]:
    """The parsed ``zarr.json`` of a node, or None if the node does not exist; with ``check``,
    its bytes are verified before they are parsed; a file ``index`` holds (checked already) is
    not read. Damage of any kind (size, depth, encoding,
    type) is a [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError] naming the file; a link leading out
    of the checkpoint is refused by the storage ([`UnsafeLinkError`][dist_ckpt.errors.UnsafeLinkError])."""
    path = node_dir / "zarr.json"
    indexed = index.get(path) if index else None
    if indexed is not None:
        return want_object(loads(indexed, str(path), MAX_SMALL_JSON_BYTES), str(path))
    try:
        if path.storage.local_paths and path.stat().st_size > MAX_SMALL_JSON_BYTES:  # a stat is cheap there
            raise CorruptCheckpointError(f"{path} has {path.stat().st_size} bytes: it is not a zarr.json this writes")
        raw = path.read_bytes()
    except FileNotFoundError:  # ObjectNotFoundError is one
        return None
    if check is not None:
        check(path, raw)
    return want_object(loads(raw, str(path), MAX_SMALL_JSON_BYTES), str(path))


@dataclass(frozen=True)
class FragmentInfo:
    """One 1-D fragment array of a tensor saved as flattened ranges."""

    path: ObjectPath
    global_offset: Shape
    flat_range: Tuple[int, int]
    pieces: List[ShardPiece]


@dataclass
class StoredTensorInfo:
    """What the metadata says about one stored tensor (no data read)."""

    key: str
    path: ObjectPath
    dtype: torch.dtype
    global_shape: Shape
    layout: str
    chunk_shape: Shape
    fragments: List[FragmentInfo] = field(default_factory=list)
    #: every chunk file holds its chunk's values as they are in memory on this host (see
    #: `plain_chunk_bytes()`): a chunk file can be read without an array library, a whole chunk
    #: straight into a tensor
    plain_chunks: bool = False
    #: the chunk key separator of the array (`chunk_separator()`): ``.`` or, in checkpoints
    #: saved before it, ``/``
    chunk_separator: str = "/"

    @property
    def bounds(self) -> Box:
        return Box((0,) * len(self.global_shape), self.global_shape)


def _attrs(doc: Dict[str, Any], path: ObjectPath) -> Dict[str, Any]:
    attrs = doc.get("attributes", {}).get(ATTR) if isinstance(doc.get("attributes"), dict) else None
    if not isinstance(attrs, dict):
        raise CorruptCheckpointError(f"{path / 'zarr.json'} lacks the {ATTR!r} attributes")
    return attrs


def _ints(value: Any, what: str, path: ObjectPath) -> Shape:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise CorruptCheckpointError(
            f"{path / 'zarr.json'}: {what} must be a list of non-negative ints, found {shown(value)}"
        )
    return tuple(value)


def open_tensor_info(
    root: ObjectPath, name: str, check: JsonCheck = None, index: JsonIndex = None
) -> Optional[StoredTensorInfo]:
    """Parse the metadata of the tensor stored under ``root/name`` (None if absent), its
    ``zarr.json`` documents from ``index`` where it holds them.

    Where the storage has directories (``local_paths``), a tensor directory without its
    ``zarr.json`` is damage ([`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError]): a tensor is removed
    by renaming its directory away, never by deleting ``zarr.json`` first. On an object store, which cannot
    rename, removal deletes ``zarr.json`` first, so a prefix without it is a removed key (see
    `tensors_metadata()` for the damage the manifest reveals)."""
    path = root / name
    doc = read_zarr_json(path, check, index)
    if doc is None:
        if root.storage.local_paths and path.is_dir():
            raise CorruptCheckpointError(
                f"{path / 'zarr.json'} is missing: the tensor stored in {str(path)!r} cannot be read; the checkpoint "
                "is damaged"
            )
        return None
    try:
        attrs = _attrs(doc, path)
        key, dtype_name = attrs["key"], attrs["dtype"]
        if not isinstance(key, str) or not isinstance(dtype_name, str):
            raise CorruptCheckpointError(
                f"{path / 'zarr.json'}: 'key' and 'dtype' must be strings, found {shown(key)}, {shown(dtype_name)}"
            )
        stored_key(key, str(path / "zarr.json"))
        dtype = dtype_from_name(dtype_name)
        if attrs.get("layout") == LAYOUT_FLATTENED:
            info = StoredTensorInfo(
                key,
                path,
                dtype,
                _ints(attrs["global_shape"], "global_shape", path),
                LAYOUT_FLATTENED,
                _ints(attrs["chunk_shape"], "chunk_shape", path),
            )
            _same_rank(info.global_shape, info.chunk_shape, path)
            check_tensor_bytes(info.global_shape, dtype.itemsize, str(path / "zarr.json"))
            check_tensor_bytes(info.chunk_shape, dtype.itemsize, str(path / "zarr.json"))
            info.fragments = _list_fragments(path, info.chunk_shape, check, index)
            _check_fragments(info)
            return info
        if doc.get("node_type") != "array":
            raise CorruptCheckpointError(
                f"{path / 'zarr.json'} describes a {shown(doc.get('node_type'))}, expected an array"
            )
        grid = _get(doc, "chunk_grid", "configuration", "chunk_shape")
        info = StoredTensorInfo(
            key, path, dtype, _ints(doc.get("shape"), "shape", path), LAYOUT_CHUNKED, _ints(grid, "chunk_shape", path)
        )
        _same_rank(info.global_shape, info.chunk_shape, path)
        check_tensor_bytes(info.global_shape, dtype.itemsize, str(path / "zarr.json"))
        check_tensor_bytes(info.chunk_shape, dtype.itemsize, str(path / "zarr.json"))
        info.plain_chunks = plain_chunk_bytes(doc, dtype)
        info.chunk_separator = chunk_separator(doc)
        return info
    except CheckpointingException:  # already names the file (and keeps its type)
        raise
    except KeyError as e:
        raise CorruptCheckpointError(f"{path / 'zarr.json'} lacks the field {e}") from e
    except (TypeError, ValueError, AttributeError) as e:  # fields of unexpected types or values
        raise CorruptCheckpointError(f"{path / 'zarr.json'} is malformed: {type(e).__name__}: {e}") from e


def plain_chunk_bytes(doc: Dict[str, Any], dtype: torch.dtype) -> bool:
    """Whether the chunk files of the array ``doc`` describes hold each chunk's values exactly
    as a contiguous tensor of ``dtype`` holds them in memory on this host: the ``bytes`` codec
    alone in the host's byte order (no compression, no sharding, no transposition), a data type
    of ``dtype``'s width (its own name, or the raw-bits integer), chunk keys ``c.i.j`` or ``c/i/j``
    (the ``default`` encoding; `chunk_separator()`). Such a
    chunk is read whole into its destination without an array library (see
    `dist_ckpt.backends.zarr.direct`); any other array goes through the engine."""
    info = dtype_info(dtype)
    if doc.get("data_type") not in {info.name, stored_numpy_dtype(dtype).name}:
        return False
    if _get(doc, "chunk_key_encoding", "name") != "default" or _get(
        doc, "chunk_key_encoding", "configuration", "separator"
    ) not in (None, "/", "."):
        return False
    if doc.get("storage_transformers") not in (None, []):
        return False
    codecs = doc.get("codecs")
    if not isinstance(codecs, list) or len(codecs) != 1 or not isinstance(codecs[0], dict):
        return False
    if codecs[0].get("name") != "bytes":
        return False
    endian = _get(codecs[0], "configuration", "endian")
    return endian == sys.byteorder or (endian is None and info.numpy_dtype.itemsize == 1)


def chunk_separator(doc: Dict[str, Any]) -> str:
    """The separator of the chunk keys of the array ``doc`` describes (``default`` chunk key
    encoding): ``.`` in checkpoints saved now (`CHUNK_SEPARATOR`), ``/`` in older ones and where
    the document names none (the zarr v3 default).

    Example:

    ```python
    chunk_key((0, 1), chunk_separator(read_zarr_json(array_dir)))   # "c.0.1" (or "c/0/1")
    ```
    """
    separator = _get(doc, "chunk_key_encoding", "configuration", "separator")
    return separator if separator in ("/", ".") else "/"


def _get(doc: Any, *fields: str) -> Any:
    """``doc[f0][f1]...``, or None where a level is missing or not an object."""
    for name in fields:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(name)
    return doc


def _same_rank(shape: Shape, chunk_shape: Shape, path: ObjectPath) -> None:
    if len(shape) != len(chunk_shape) or any(c == 0 and n > 0 for n, c in zip(shape, chunk_shape)):
        raise CorruptCheckpointError(
            f"{path / 'zarr.json'}: chunk shape {list(chunk_shape)} does not fit an array of shape {list(shape)}"
        )


def _list_fragments(
    path: ObjectPath, chunk_shape: Shape, check: JsonCheck = None, index: JsonIndex = None
) -> List[FragmentInfo]:
    fragments = []
    for entry in sorted(subdirs(path)):
        if entry.startswith(".") or entry == "zarr.json":
            continue
        doc = read_zarr_json(path / entry, check, index)
        if doc is None:
            if path.storage.local_paths:  # a listed directory without its zarr.json (see open_tensor_info)
                raise CorruptCheckpointError(
                    f"{path / entry / 'zarr.json'} is missing: a fragment of the tensor in {str(path)!r} cannot be "
                    "read; the checkpoint is damaged"
                )
            continue
        attrs = _attrs(doc, path / entry)
        rng = _ints(attrs.get("flat_range"), "flat_range", path / entry)
        offset = _ints(attrs.get("global_offset"), "global_offset", path / entry)
        if len(rng) != 2 or rng[0] > rng[1] or len(offset) != len(chunk_shape):
            raise CorruptCheckpointError(
                f"{path / entry / 'zarr.json'}: invalid flat_range {list(rng)} or global_offset {list(offset)} "
                f"for chunks of shape {list(chunk_shape)}"
            )
        try:
            pieces = shard_pieces(offset, chunk_shape, 0, (rng[0], rng[1]))
        except (ValueError, CheckpointingException) as e:
            raise CorruptCheckpointError(f"{path / entry / 'zarr.json'}: {e}") from e
        fragments.append(FragmentInfo(path / entry, offset, (rng[0], rng[1]), pieces))
    return fragments


def _check_fragments(info: StoredTensorInfo) -> None:
    """Raise CorruptCheckpointError unless the fragments of a flattened tensor cover it exactly
    once (`tiling_problem()`): forged ranges that overlap as much as they leave out would
    otherwise load the missing elements as zeros, and ``verify`` runs this same check."""
    boxes = [(p.box.offset, p.box.shape) for f in info.fragments for p in f.pieces if p.box.numel]
    problem = tiling_problem(info.global_shape, boxes)
    if problem is not None:
        raise CorruptCheckpointError(
            f"{info.path / 'zarr.json'}: the fragments of tensor {info.key!r} {list(info.global_shape)} do not cover "
            f"it exactly once: {problem}"
        )


def list_tensor_names(root: ObjectPath) -> List[str]:
    """Directory names of every stored tensor (on an object store: every prefix under ``zarr/``)."""
    if not root.is_dir():
        raise CorruptCheckpointError(f"{str(root)!r} is missing: the zarr part of the checkpoint is gone")
    return sorted(
        e
        for e in subdirs(root)
        if not e.startswith(".") and e != "zarr.json" and not (e == CHECKSUMS_FILENAME and (root / e).is_file())
    )


def check_tensor_dirs_present(root: ObjectPath, manifest: Optional[Mapping[str, Any]]) -> None:
    """Refuse a checkpoint whose checksum ``manifest`` lists tensor directories that are gone.

    The tensors of a zarr checkpoint are found by listing ``zarr/``; without this check a
    deleted tensor directory would make the tensor silently absent from whatever lists them
    (``unshard``, ``convert``, ``inspect``). Checkpoints saved without a manifest are not checked.
    """
    if manifest is None:
        return
    missing = sorted({name.split("/", 1)[0] for name in manifest if "/" in name} - set(list_tensor_names(root)))
    if missing:
        raise CorruptCheckpointError(
            f"{str(root)!r}: the tensor directories {format_keys(missing)} listed in {CHECKSUMS_FILENAME} are "
            "missing: the checkpoint is damaged ('dist-ckpt verify' lists every missing file)"
        )


def find_tensor_info(
    root: ObjectPath, key: str, check: JsonCheck = None, index: JsonIndex = None
) -> Optional[StoredTensorInfo]:
    """The stored tensor ``key``, or None (see `open_tensor_info()`). A key that is now a reserved
    name (``checksums.json``) is also looked up under the name checkpoints saved before the
    reservation gave it."""
    info = open_tensor_info(root, tensor_dir_name(key), check, index)
    legacy = encode_key(key)
    if info is None and legacy != tensor_dir_name(key) and (root / legacy).is_dir():
        info = open_tensor_info(root, legacy, check)
    return info


def tensors_metadata(
    root: ObjectPath, check: JsonCheck = None, manifest: Optional[Mapping[str, Any]] = None
) -> ShardedStateDict:
    """``{key: ShardedTensor}`` (whole, unsharded, data on the meta device) for every tensor, as
    it was saved: a tensor of the flattened layout is one flattened range covering all of it
    (see `dist_ckpt.model.stored_metadata`).

    Every tensor directory is listed or raises: a directory without its ``zarr.json`` is damage
    (`open_tensor_info()`); on an object store, whose "directories" exist only through their
    objects, a prefix without a ``zarr.json`` is damage when ``manifest`` lists that file (else
    it is what an interrupted ``remove_sharded_tensors`` leaves: the key is gone).
    """
    out: ShardedStateDict = {}
    for name in list_tensor_names(root):
        info = open_tensor_info(root, name, check)
        if info is None and manifest is not None and f"{name}/zarr.json" in manifest:
            raise CorruptCheckpointError(
                f"{str(root / name / 'zarr.json')!r} is missing: the tensor stored in {str(root / name)!r} cannot be "
                "read; the checkpoint is damaged"
            )
        if info is not None:
            flattened = info.layout == LAYOUT_FLATTENED
            out[info.key] = stored_tensor_metadata(info.key, info.dtype, info.global_shape, flattened)
    return out


def damaged_chunks(array_path: ObjectPath, region: Box) -> List[str]:
    """Why the chunk files holding ``region`` of the array at ``array_path`` cannot be read: one
    line per missing or wrongly sized file (empty if they all look intact).

    Engines call this after a failed read, to name the damaged file instead of passing on a
    library message.
    """
    doc = read_zarr_json(array_path)
    if doc is None:
        return [f"{str(array_path / 'zarr.json')!r} is missing"]
    try:
        chunk_shape = [int(c) for c in doc["chunk_grid"]["configuration"]["chunk_shape"]]
        itemsize = dtype_info(dtype_from_name(str(doc["data_type"]))).numpy_dtype.itemsize
    except (KeyError, TypeError, ValueError) as e:
        return [f"{str(array_path / 'zarr.json')!r} is malformed: {e!r}"]
    except Exception as e:  # noqa: BLE001 -- an unknown data_type is one more way to be damaged
        return [f"{str(array_path / 'zarr.json')!r} is unreadable: {e}"]
    expected = math.prod(chunk_shape) * itemsize
    problems = []
    separator = chunk_separator(doc)
    for coords in chunk_coords(region, chunk_shape):
        path = array_path / chunk_key(coords, separator)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"chunk file {str(path)!r} is missing")
            continue
        if size != expected:
            problems.append(f"chunk file {str(path)!r} has {size} bytes, expected {expected} (truncated or damaged)")
    return problems


def describe_zarr(checkpoint_dir: ObjectPath) -> Dict[str, List[StoredShardInfo]]:
    """The stored pieces of every tensor of a zarr-format checkpoint, from its ``zarr.json``
    files: a chunked tensor's chunks (each a saved shard), or a flattened tensor's fragments.

    Example:

    ```python
    describe_zarr(checkpoint_node("ckpt", "inspect"))["w"][0].file    # "zarr/w/c.0.0"
    ```
    """
    root = checkpoint_dir / ZARR_DIR
    out: Dict[str, List[StoredShardInfo]] = {}
    for name in list_tensor_names(root):
        info = open_tensor_info(root, name)
        if info is None:
            continue
        itemsize = info.dtype.itemsize
        pieces: List[StoredShardInfo] = []
        if info.layout == LAYOUT_CHUNKED:
            chunk = info.chunk_shape
            grid = [range(math.ceil(n / c)) if c else range(0) for n, c in zip(info.global_shape, chunk)]
            for coords in product(*grid):
                offset = tuple(i * c for i, c in zip(coords, chunk))
                shape = tuple(min(c, n - o) for c, n, o in zip(chunk, info.global_shape, offset))
                pieces.append(
                    StoredShardInfo(
                        offset,
                        shape,
                        None,
                        f"{ZARR_DIR}/{name}/{chunk_key(coords, info.chunk_separator)}",
                        math.prod(chunk) * itemsize,
                    )
                )
        else:
            for frag in info.fragments:
                start, stop = frag.flat_range
                pieces.append(
                    StoredShardInfo(
                        tuple(frag.global_offset),
                        tuple(info.chunk_shape),
                        (start, stop),
                        f"{ZARR_DIR}/{name}/{frag.path.name}",
                        (stop - start) * itemsize,
                    )
                )
        out[info.key] = pieces
    return out
