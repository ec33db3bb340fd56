"""The on-disk layout of zarr-format checkpoints, shared by every engine that reads or writes it.

Both the zarr-python engine (:mod:`.zarr`) and the TensorStore one (:mod:`.tensorstore`) use
this module; it imports neither library. It knows where each tensor lives, parses the zarr v3
metadata (plain JSON), and turns a requested ShardedTensor into a list of :class:`ReadOp` --
which region of which array goes where -- checking coverage before any byte is read. For
writing it gives the nodes' metadata and attributes as plain data, so that both engines write
the same checkpoint, and names damaged chunk files after a failed read.

Layout::

    zarr/zarr.json                              root group
    zarr/<encoded key>/zarr.json                array, chunk shape = saved shard shape
    zarr/<encoded key>/c/<i>/<j>/...            one chunk per main-replica shard
    zarr/<encoded key>/zarr.json                group (tensor saved as flattened ranges)
    zarr/<encoded key>/<chunk idx>_<start>/     one 1-D fragment array per flattened shard

Attributes under ``"dist_ckpt"``: ``key``, ``dtype`` and ``layout`` on each tensor; for the
flattened layout also ``global_shape`` and ``chunk_shape``, and on each fragment its
``dtype``, ``global_offset`` and ``flat_range``.

Data types: an array's ``data_type`` is the tensor's dtype, except for the dtypes zarr-python 3
has no data type for (bfloat16 and the float8 types), which are stored as the unsigned integers
of their width holding the raw bits (``uint16``, ``uint8``) so that any zarr v3 reader opens
them; the ``dtype`` attribute names the tensor's dtype (:func:`stored_numpy_dtype`). Readers
take the dtype from the attribute and view the bits, so checkpoints written with the
zarr-extensions names (``"data_type": "bfloat16"``) load as well.

Locations: every function here takes a :data:`~dist_ckpt.storage.object_path.Node` -- a local
:class:`~pathlib.Path` or an :class:`~dist_ckpt.storage.object_path.ObjectPath` under an S3
storage -- so one layout serves local directories and ``s3://`` checkpoints
(:func:`checkpoint_node`). On object stores nothing is fsynced (an object is durable when its
PUT returns) and no directory is created.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from dist_ckpt.backends.request_checks import check_requested_tensors
from dist_ckpt.errors import (
    CheckpointingException,
    CorruptCheckpointError,
    IncompatibleStrategyError,
    LoadMismatchError,
    format_keys,
)
from dist_ckpt.integrity.checksums import read_manifest
from dist_ckpt.model.dtypes import dtype_from_name, dtype_info, numpy_to_tensor
from dist_ckpt.model.geometry import Box, ShardPiece, shard_pieces
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor
from dist_ckpt.storage import encode_key, fsync_dir, fsync_file, write_bytes_atomic
from dist_ckpt.storage.location import CheckpointLocation
from dist_ckpt.storage.object_path import Node, ObjectPath, subdirs

ZARR_DIR = "zarr"
ATTR = "dist_ckpt"
LAYOUT_CHUNKED = "chunked"
LAYOUT_FLATTENED = "flattened"
#: fragments of flattened tensors are split into zarr chunks of at most this many elements, so a
#: load that needs part of a fragment reads a bounded amount more than it needs
FRAGMENT_CHUNK_ELEMENTS = 1 << 22

Shape = Tuple[int, ...]


def checkpoint_node(location: CheckpointLocation, engine: str) -> Node:
    """The checkpoint directory as a :data:`Node`: the local directory, or the root of an S3
    storage (the zarr engines reach S3 through their own clients: zarr-python through obstore,
    TensorStore through its ``s3`` driver, so the storage must be an ``S3Storage``).

    Raises:
        IncompatibleStrategyError: an object store other than S3.

    Example::

        root = checkpoint_node(resolve_location("s3://bucket/ckpt"), "the zarr backend") / ZARR_DIR
    """
    if isinstance(location, Path):
        return location
    from dist_ckpt.storage.s3 import S3Storage

    if not isinstance(location, S3Storage):
        raise IncompatibleStrategyError(
            f"{engine} reaches object stores through its own S3 client and cannot use {location!r} "
            f"({location.url}); use an s3:// location or a local path"
        )
    return ObjectPath(location)


def make_dirs(node: Node) -> None:
    """Create a local directory (and its parents); nothing to do on an object store."""
    if isinstance(node, Path):
        node.mkdir(parents=True, exist_ok=True)


def fragment_name(sh: ShardedTensor) -> str:
    """Directory name of a flattened shard's fragment array: ``<chunk index>_<flat start>``."""
    assert sh.flattened_range is not None
    chunk = ".".join(map(str, sh.local_chunk_offset_in_global()))
    return f"{chunk}_{sh.flattened_range.start}"


def read_zarr_json(node_dir: Node) -> Optional[Dict[str, Any]]:
    """The parsed ``zarr.json`` of a node, or None if the node does not exist."""
    path = node_dir / "zarr.json"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CorruptCheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{path} must hold a JSON object")
    return doc


@dataclass(frozen=True)
class FragmentInfo:
    """One 1-D fragment array of a tensor saved as flattened ranges."""

    path: Node
    global_offset: Shape
    flat_range: Tuple[int, int]
    pieces: List[ShardPiece]


@dataclass
class StoredTensorInfo:
    """What the metadata says about one stored tensor (no data read)."""

    key: str
    path: Node
    dtype: torch.dtype
    global_shape: Shape
    layout: str
    chunk_shape: Shape
    fragments: List[FragmentInfo] = field(default_factory=list)

    @property
    def bounds(self) -> Box:
        return Box((0,) * len(self.global_shape), self.global_shape)


def _attrs(doc: Dict[str, Any], path: Node) -> Dict[str, Any]:
    attrs = doc.get("attributes", {}).get(ATTR) if isinstance(doc.get("attributes"), dict) else None
    if not isinstance(attrs, dict):
        raise CorruptCheckpointError(f"{path / 'zarr.json'} lacks the {ATTR!r} attributes")
    return attrs


def _ints(value: Any, what: str, path: Node) -> Shape:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise CorruptCheckpointError(
            f"{path / 'zarr.json'}: {what} must be a list of non-negative ints, found {value!r}"
        )
    return tuple(value)


def open_tensor_info(root: Node, name: str) -> Optional[StoredTensorInfo]:
    """Parse the metadata of the tensor stored under ``root/name`` (None if absent)."""
    path = root / name
    doc = read_zarr_json(path)
    if doc is None:
        return None
    try:
        attrs = _attrs(doc, path)
        key, dtype_name = attrs["key"], attrs["dtype"]
        if not isinstance(key, str) or not isinstance(dtype_name, str):
            raise CorruptCheckpointError(
                f"{path / 'zarr.json'}: 'key' and 'dtype' must be strings, found {key!r}, {dtype_name!r}"
            )
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
            info.fragments = _list_fragments(path, info.chunk_shape)
            return info
        if doc.get("node_type") != "array":
            raise CorruptCheckpointError(
                f"{path / 'zarr.json'} describes a {doc.get('node_type')!r}, expected an array"
            )
        grid = _get(doc, "chunk_grid", "configuration", "chunk_shape")
        info = StoredTensorInfo(
            key, path, dtype, _ints(doc.get("shape"), "shape", path), LAYOUT_CHUNKED, _ints(grid, "chunk_shape", path)
        )
        _same_rank(info.global_shape, info.chunk_shape, path)
        return info
    except KeyError as e:
        raise CorruptCheckpointError(f"{path / 'zarr.json'} lacks the field {e}") from e
    except (TypeError, ValueError, AttributeError) as e:  # fields of unexpected types or values
        raise CorruptCheckpointError(f"{path / 'zarr.json'} is malformed: {type(e).__name__}: {e}") from e


def _get(doc: Any, *fields: str) -> Any:
    """``doc[f0][f1]...``, or None where a level is missing or not an object."""
    for name in fields:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(name)
    return doc


def _same_rank(shape: Shape, chunk_shape: Shape, path: Node) -> None:
    if len(shape) != len(chunk_shape) or any(c == 0 and n > 0 for n, c in zip(shape, chunk_shape)):
        raise CorruptCheckpointError(
            f"{path / 'zarr.json'}: chunk shape {list(chunk_shape)} does not fit an array of shape {list(shape)}"
        )


def _list_fragments(path: Node, chunk_shape: Shape) -> List[FragmentInfo]:
    fragments = []
    for entry in sorted(subdirs(path)):
        if entry.startswith(".") or entry == "zarr.json":
            continue
        doc = read_zarr_json(path / entry)
        if doc is None:
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


#: the checksum manifest of the zarr backend (see zarr_checksums), beside the root group
CHECKSUMS_FILENAME = "checksums.json"


def list_tensor_names(root: Node) -> List[str]:
    """Directory names of every stored tensor (on an object store: every prefix under ``zarr/``)."""
    if not root.is_dir():
        raise CorruptCheckpointError(f"{str(root)!r} is missing: the zarr part of the checkpoint is gone")
    return sorted(
        e
        for e in subdirs(root)
        if not e.startswith(".") and e != "zarr.json" and not (e == CHECKSUMS_FILENAME and (root / e).is_file())
    )


def check_tensor_dirs_present(root: Node) -> None:
    """Refuse a checkpoint whose checksum manifest lists tensor directories that are gone.

    The tensors of a zarr checkpoint are found by listing ``zarr/``; without this check a
    deleted tensor directory would make the tensor silently absent from whatever lists them
    (``unshard``, ``convert``, ``inspect``). Checkpoints saved without a manifest are not checked.
    """
    manifest = read_manifest(root / CHECKSUMS_FILENAME)
    if manifest is None:
        return
    missing = sorted({name.split("/", 1)[0] for name in manifest if "/" in name} - set(list_tensor_names(root)))
    if missing:
        raise CorruptCheckpointError(
            f"{str(root)!r}: the tensor directories {format_keys(missing)} listed in {CHECKSUMS_FILENAME} are "
            "missing: the checkpoint is damaged ('dist-ckpt verify' lists every missing file)"
        )


def find_tensor_info(root: Node, key: str) -> Optional[StoredTensorInfo]:
    """The stored tensor ``key``, or None. A key that is now a reserved name (``checksums.json``)
    is also looked up under the name checkpoints saved before the reservation gave it."""
    info = open_tensor_info(root, tensor_dir_name(key))
    legacy = encode_key(key)
    if info is None and legacy != tensor_dir_name(key) and (root / legacy).is_dir():
        info = open_tensor_info(root, legacy)
    return info


def tensors_metadata(root: Node) -> ShardedStateDict:
    """``{key: ShardedTensor}`` (whole, unsharded, data on the meta device) for every tensor."""
    out: ShardedStateDict = {}
    for name in list_tensor_names(root):
        info = open_tensor_info(root, name)
        if info is not None:
            meta = torch.empty(info.global_shape, dtype=info.dtype, device="meta")
            out[info.key] = ShardedTensor.from_rank_offsets(info.key, meta)
    return out


@dataclass(frozen=True)
class ReadOp:
    """Read ``region`` of the array at ``array_path``; view it as ``src_box`` (global
    coordinates); copy its ``inter`` part into destination piece ``dst``."""

    array_path: Node
    region: Box
    src_box: Box
    dst: ShardPiece
    inter: Box


@dataclass
class ReadPlan:
    """Every read needed to load one ShardedTensor, and the destination parts to zero-fill."""

    ops: List[ReadOp]
    pad: List[Tuple[ShardPiece, Box]]  # (piece, its part outside the stored tensor)


def plan_reads(sh: ShardedTensor, info: StoredTensorInfo) -> ReadPlan:
    """The reads that load ``sh`` from ``info``; raises if the stored data does not cover it."""
    rng = None if sh.flattened_range is None else (sh.flattened_range.start, sh.flattened_range.stop)
    ops: List[ReadOp] = []
    pad: List[Tuple[ShardPiece, Box]] = []
    expected = covered = 0
    for piece in shard_pieces(sh.global_offset, sh.local_shape, sh.prepend_axis_num, rng):
        region = piece.box.intersect(info.bounds)
        if region != piece.box:
            pad.append((piece, piece.box))  # allow_shape_mismatch: zero first, then overwrite
        if region is None:
            continue
        expected += region.numel
        if info.layout == LAYOUT_CHUNKED:
            ops.append(ReadOp(info.path, region, region, piece, region))
            covered += region.numel
            continue
        for frag in info.fragments:
            for fp in frag.pieces:
                inter = region.intersect(fp.box)
                if inter is None:
                    continue
                ops.append(_fragment_op(frag, fp, piece, inter))
                covered += inter.numel
    if covered != expected:
        raise CorruptCheckpointError(
            f"tensor {sh.key!r} in {str(info.path)!r}: the stored fragments cover {covered} of the "
            f"{expected} requested elements (fragments are missing or overlap)"
        )
    return ReadPlan(ops, pad)


def plan_request(requested: Sequence[ShardedTensor], checkpoint_dir: Node) -> Dict[int, ReadPlan]:
    """The reads of every requested shard (by ``id``), after checking keys, dtypes and shapes.

    Everything is checked before any tensor byte is read; see
    :func:`~dist_ckpt.backends.request_checks.check_requested_tensors`.
    """
    root = checkpoint_dir / ZARR_DIR
    infos: Dict[str, Optional[StoredTensorInfo]] = {}
    for sh in requested:
        if sh.key not in infos:
            infos[sh.key] = find_tensor_info(root, sh.key)

    def lookup(key: str) -> Optional[Tuple[torch.dtype, Tuple[int, ...]]]:
        info = infos[key]
        return None if info is None else (info.dtype, info.global_shape)

    check_requested_tensors(requested, lookup, repr(str(checkpoint_dir)))
    return {id(sh): plan_reads(sh, infos[sh.key]) for sh in requested}  # type: ignore[arg-type]


def _fragment_op(frag: FragmentInfo, fp: ShardPiece, dst: ShardPiece, inter: Box) -> ReadOp:
    """Read whole rows of fragment piece ``fp`` around ``inter`` (one contiguous 1-D range)."""
    assert fp.flat_offset is not None
    if not fp.box.shape:  # a 0-d tensor: one element
        return ReadOp(frag.path, Box((fp.flat_offset,), (1,)), fp.box, dst, inter)
    row = math.prod(fp.box.shape[1:])
    first = inter.offset[0] - fp.box.offset[0]
    rows = inter.shape[0]
    src_box = Box((inter.offset[0],) + fp.box.offset[1:], (rows,) + fp.box.shape[1:])
    return ReadOp(frag.path, Box((fp.flat_offset + first * row,), (rows * row,)), src_box, dst, inter)


def load_zarr_based_sharded_metadata(
    checkpoint_dir: Union[Node, str], get_shape_dtype_fn: Callable[[Any], Tuple[Tuple[int, ...], np.dtype]]
) -> ShardedStateDict:
    """``{key: ShardedTensor}`` for every stored tensor, shapes read with ``get_shape_dtype_fn``.

    Args:
        checkpoint_dir: checkpoint root directory (or an :class:`ObjectPath` of an S3 checkpoint).
        get_shape_dtype_fn: returns ``(shape, numpy dtype)`` of the zarr array at a path (a
            ``str`` for a local array, the :class:`ObjectPath` for one on S3); lets each engine
            (zarr-python, TensorStore) open arrays its own way.
    """
    root = (checkpoint_dir if isinstance(checkpoint_dir, ObjectPath) else Path(checkpoint_dir)) / ZARR_DIR
    check_tensor_dirs_present(root)
    out = tensors_metadata(root)
    for name in list_tensor_names(root):
        info = open_tensor_info(root, name)
        if info is None or info.layout != LAYOUT_CHUNKED:
            continue
        shape, np_dtype = get_shape_dtype_fn(str(info.path) if isinstance(info.path, Path) else info.path)
        if tuple(shape) != info.global_shape or np.dtype(np_dtype).itemsize != info.dtype.itemsize:
            raise CorruptCheckpointError(
                f"{info.path}: the array is {tuple(shape)} {np_dtype}, its attributes say {info.global_shape} "
                f"{info.dtype}"
            )
    return out


def flatten_range(sharded_tensor: ShardedTensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened and cut to ``sharded_tensor.flattened_range`` (unchanged if none)."""
    if sharded_tensor.flattened_range is None:
        return x
    return x.flatten()[sharded_tensor.flattened_range]


def pad_to_expected_shape(x: torch.Tensor, expected_sharded_ten: ShardedTensor) -> torch.Tensor:
    """Crop or zero-pad ``x`` (at the end of each axis) to the expected local shape."""
    target = expected_sharded_ten.local_shape
    if tuple(x.shape) == tuple(target):
        return x
    if x.ndim != len(target):
        raise LoadMismatchError(f"{expected_sharded_ten.key!r}: cannot pad a {x.ndim}-d tensor to local shape {target}")
    out = torch.zeros(target, dtype=x.dtype, device=x.device)
    common = tuple(slice(0, min(a, b)) for a, b in zip(x.shape, target))
    out[common] = x[common]
    return out


def postprocess_numpy_array(
    loaded_array: np.ndarray, sharded_tensor: ShardedTensor, apply_flattened_range: bool = True
) -> torch.Tensor:
    """Turn a loaded numpy array into the tensor ``sharded_tensor`` expects (dtype, padding,
    flattened range)."""
    x = numpy_to_tensor(np.ascontiguousarray(loaded_array), sharded_tensor.dtype)
    if sharded_tensor.allow_shape_mismatch:
        x = pad_to_expected_shape(x, sharded_tensor)
    if apply_flattened_range:
        x = flatten_range(sharded_tensor, x)
    return x


#: names a tensor directory must not take: the root group's metadata, and zarr's reserved prefix
_RESERVED = ("zarr.json", CHECKSUMS_FILENAME)


def tensor_dir_name(key: str) -> str:
    """Directory name (under ``zarr/``) of the tensor stored under ``key``.

    The encoded key, with its first character percent-encoded when the name would collide with
    the root group's ``zarr.json``, the checksum manifest ``checksums.json``, or start with
    zarr's reserved ``__``.
    """
    name = encode_key(key)
    if name in _RESERVED or name.startswith("__"):
        name = f"%{ord(name[0]):02X}{name[1:]}"
    return name


def tensor_dir(root: Node, key: str) -> Node:
    """Directory of the tensor stored under ``key``."""
    return root / tensor_dir_name(key)


# --------------------------------------------------------------------------- writing the layout
# What any engine writes, as plain data: the zarr-python engine (zarr.py) builds the same nodes
# with zarr-python's own API; an engine without group support (TensorStore) uses these helpers.


def is_origin(sh: ShardedTensor) -> bool:
    """Whether ``sh`` is the tensor's first chunk: its holder creates the tensor's node."""
    return not any(sh.global_offset)


def array_chunk_shape(sh: ShardedTensor) -> Shape:
    """Zarr chunk shape of a tensor saved as a grid of shards: the shard shape (at least 1)."""
    return tuple(max(1, c) for c in sh.full_local_shape)


def fragment_chunk_elements(length: int) -> int:
    """Zarr chunk length of a fragment array of ``length`` elements."""
    return min(length, FRAGMENT_CHUNK_ELEMENTS)


def chunked_attributes(sh: ShardedTensor) -> Dict[str, Any]:
    """The ``dist_ckpt`` attributes of a tensor saved as a grid of shards."""
    return {"key": sh.key, "dtype": dtype_info(sh.dtype).name, "layout": LAYOUT_CHUNKED}


def flattened_attributes(sh: ShardedTensor) -> Dict[str, Any]:
    """The ``dist_ckpt`` attributes of the group of a tensor saved as flattened ranges."""
    return {
        "key": sh.key,
        "dtype": dtype_info(sh.dtype).name,
        "layout": LAYOUT_FLATTENED,
        "global_shape": list(sh.global_shape),
        "chunk_shape": list(sh.full_local_shape),
    }


def fragment_attributes(sh: ShardedTensor) -> Dict[str, Any]:
    """The ``dist_ckpt`` attributes of one fragment array (a flattened shard); ``dtype`` too, so
    that a reader of the fragment alone knows how to view its raw bits."""
    assert sh.flattened_range is not None
    return {
        "dtype": dtype_info(sh.dtype).name,
        "global_offset": list(sh.global_offset),
        "flat_range": [sh.flattened_range.start, sh.flattened_range.stop],
    }


def creates_flattened_group(sh: ShardedTensor) -> bool:
    """Whether the holder of flattened shard ``sh`` creates the tensor's group: the shard that
    starts the tensor's first chunk (or the whole first chunk when it is empty)."""
    assert sh.flattened_range is not None
    start, stop = sh.flattened_range.start, sh.flattened_range.stop
    return is_origin(sh) and start == 0 and (stop > 0 or math.prod(sh.local_shape) == 0)


def stored_numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of the zarr array that stores tensors of ``dtype``: the tensor's own, or
    for a dtype numpy lacks (bfloat16, float8: ml_dtypes types, which zarr-python 3 cannot name)
    the unsigned integer of the same width, holding the raw bits.

    Example::

        stored_numpy_dtype(torch.bfloat16)   # dtype('uint16')
        stored_numpy_dtype(torch.float32)    # dtype('float32')
    """
    info = dtype_info(dtype)
    if info.bits_dtype is None:
        return info.numpy_dtype
    return np.dtype(f"uint{8 * info.numpy_dtype.itemsize}")


def as_stored(array: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``array`` (holding ``dtype``'s values) viewed as :func:`stored_numpy_dtype`, no copy."""
    return array.view(stored_numpy_dtype(dtype))


def fill_value_json(dtype: torch.dtype) -> Any:
    """The zarr v3 ``fill_value`` (zero) of ``dtype``'s stored array in its JSON form."""
    if dtype_info(dtype).bits_dtype is not None:
        return 0  # raw bits in an unsigned integer array
    if dtype == torch.bool:
        return False
    if dtype.is_complex:
        return [0.0, 0.0]
    if dtype.is_floating_point:
        return 0.0
    return 0


def array_metadata(
    shape: Sequence[int], chunk_shape: Sequence[int], dtype: torch.dtype, attributes: Dict[str, Any]
) -> Dict[str, Any]:
    """zarr v3 metadata of an uncompressed little-endian array, as the zarr backend writes it."""
    stored = stored_numpy_dtype(dtype)
    bytes_codec: Dict[str, Any] = {"name": "bytes"}
    if stored.itemsize > 1:
        bytes_codec["configuration"] = {"endian": "little"}
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": stored.name if dtype_info(dtype).bits_dtype is not None else dtype_info(dtype).name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill_value_json(dtype),
        "codecs": [bytes_codec],
        "attributes": {ATTR: attributes},
    }


def write_group(path: Node, attributes: Dict[str, Any]) -> Node:
    """Write a zarr v3 group node at ``path`` (atomically, fsynced); returns its ``zarr.json``."""
    doc = json.dumps({"attributes": attributes, "zarr_format": 3, "node_type": "group"}, indent=2).encode("utf-8")
    if isinstance(path, ObjectPath):
        target_object = path / "zarr.json"
        target_object.write_bytes(doc)
        return target_object
    path.mkdir(parents=True, exist_ok=True)
    target = path / "zarr.json"
    write_bytes_atomic(target, doc)
    return target


def chunk_key(coords: Sequence[int]) -> str:
    """Path of a chunk under its array, for the default chunk key encoding (``c/i/j``; ``c``
    for a 0-d array)."""
    return "/".join(["c", *map(str, coords)])


def chunk_coords(region: Box, chunk_shape: Sequence[int]) -> List[Shape]:
    """Grid coordinates of every chunk that ``region`` overlaps."""
    ranges = [range(o // c, (o + s - 1) // c + 1) for o, s, c in zip(region.offset, region.shape, chunk_shape)]
    return [tuple(c) for c in itertools.product(*ranges)]


def damaged_chunks(array_path: Node, region: Box) -> List[str]:
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
    for coords in chunk_coords(region, chunk_shape):
        path = array_path / chunk_key(coords)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"chunk file {str(path)!r} is missing")
            continue
        if size != expected:
            problems.append(f"chunk file {str(path)!r} has {size} bytes, expected {expected} (truncated or damaged)")
    return problems


def cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` as contiguous host memory (copied from a device), what both engines write from."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def fsync_written(paths: Sequence[Node], root: Node) -> None:
    """fsync the files an engine wrote, then every directory from their parents up to ``root``,
    so that a crash after a save returns cannot lose them (nothing to do on an object store)."""
    if not isinstance(root, Path):
        return
    dirs = {root}
    for p in paths:
        assert isinstance(p, Path)
        fsync_file(p)
        parent = p.parent
        while parent != root and root in parent.parents:
            dirs.add(parent)
            parent = parent.parent
    for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
        fsync_dir(d)
