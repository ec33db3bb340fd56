"""The on-disk layout of zarr-format checkpoints, shared by every engine that reads or writes it.

Both the zarr-python backend (:mod:`.zarr`) and a TensorStore one use this module; it imports
neither library. It knows where each tensor lives, parses the zarr v3 metadata (plain JSON), and
turns a requested ShardedTensor into a list of :class:`ReadOp` -- which region of which array
goes where -- checking coverage before any byte is read.

Layout::

    zarr/zarr.json                              root group
    zarr/<encoded key>/zarr.json                array, chunk shape = saved shard shape
    zarr/<encoded key>/c/<i>/<j>/...            one chunk per main-replica shard
    zarr/<encoded key>/zarr.json                group (tensor saved as flattened ranges)
    zarr/<encoded key>/<chunk idx>_<start>/     one 1-D fragment array per flattened shard

Attributes under ``"dist_ckpt"``: ``key``, ``dtype`` and ``layout`` on each tensor; for the
flattened layout also ``global_shape`` and ``chunk_shape``, and on each fragment its
``global_offset`` and ``flat_range``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..dtypes import dtype_from_name, numpy_to_tensor
from ..errors import CorruptCheckpointError, LoadMismatchError
from ..geometry import Box, ShardPiece, shard_pieces
from ..mapping import ShardedStateDict, ShardedTensor
from ..storage import encode_key

ZARR_DIR = "zarr"
ATTR = "dist_ckpt"
LAYOUT_CHUNKED = "chunked"
LAYOUT_FLATTENED = "flattened"
#: fragments of flattened tensors are split into zarr chunks of at most this many elements, so a
#: load that needs part of a fragment reads a bounded amount more than it needs
FRAGMENT_CHUNK_ELEMENTS = 1 << 22

Shape = Tuple[int, ...]


def fragment_name(sh: ShardedTensor) -> str:
    """Directory name of a flattened shard's fragment array: ``<chunk index>_<flat start>``."""
    assert sh.flattened_range is not None
    chunk = ".".join(map(str, sh.local_chunk_offset_in_global()))
    return f"{chunk}_{sh.flattened_range.start}"


def read_zarr_json(node_dir: Path) -> Optional[Dict[str, Any]]:
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

    path: Path
    global_offset: Shape
    flat_range: Tuple[int, int]
    pieces: List[ShardPiece]


@dataclass
class StoredTensorInfo:
    """What the metadata says about one stored tensor (no data read)."""

    key: str
    path: Path
    dtype: torch.dtype
    global_shape: Shape
    layout: str
    chunk_shape: Shape
    fragments: List[FragmentInfo] = field(default_factory=list)

    @property
    def bounds(self) -> Box:
        return Box((0,) * len(self.global_shape), self.global_shape)


def _attrs(doc: Dict[str, Any], path: Path) -> Dict[str, Any]:
    attrs = doc.get("attributes", {}).get(ATTR) if isinstance(doc.get("attributes"), dict) else None
    if not isinstance(attrs, dict):
        raise CorruptCheckpointError(f"{path / 'zarr.json'} lacks the {ATTR!r} attributes")
    return attrs


def _ints(value: Any, what: str, path: Path) -> Shape:
    if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise CorruptCheckpointError(f"{path / 'zarr.json'}: {what} must be a list of non-negative ints, found {value!r}")
    return tuple(value)


def open_tensor_info(root: Path, name: str) -> Optional[StoredTensorInfo]:
    """Parse the metadata of the tensor stored under ``root/name`` (None if absent)."""
    path = root / name
    doc = read_zarr_json(path)
    if doc is None:
        return None
    try:
        attrs = _attrs(doc, path)
        key, dtype = attrs["key"], dtype_from_name(attrs["dtype"])
        if not isinstance(key, str):
            raise CorruptCheckpointError(f"{path / 'zarr.json'}: 'key' must be a string")
        if attrs.get("layout") == LAYOUT_FLATTENED:
            info = StoredTensorInfo(
                key, path, dtype, _ints(attrs["global_shape"], "global_shape", path), LAYOUT_FLATTENED,
                _ints(attrs["chunk_shape"], "chunk_shape", path),
            )
            info.fragments = _list_fragments(path, info.chunk_shape)
            return info
        if doc.get("node_type") != "array":
            raise CorruptCheckpointError(f"{path / 'zarr.json'} describes a {doc.get('node_type')!r}, expected an array")
        grid = doc.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape")
        return StoredTensorInfo(
            key, path, dtype, _ints(doc.get("shape"), "shape", path), LAYOUT_CHUNKED, _ints(grid, "chunk_shape", path)
        )
    except KeyError as e:
        raise CorruptCheckpointError(f"{path / 'zarr.json'} lacks the field {e}") from e


def _list_fragments(path: Path, chunk_shape: Shape) -> List[FragmentInfo]:
    fragments = []
    for entry in sorted(os.listdir(path)):
        if entry.startswith(".") or entry == "zarr.json":
            continue
        doc = read_zarr_json(path / entry)
        if doc is None:
            continue
        attrs = _attrs(doc, path / entry)
        rng = _ints(attrs.get("flat_range"), "flat_range", path / entry)
        offset = _ints(attrs.get("global_offset"), "global_offset", path / entry)
        if len(rng) != 2 or rng[0] > rng[1]:
            raise CorruptCheckpointError(f"{path / entry / 'zarr.json'}: invalid flat_range {rng}")
        pieces = shard_pieces(offset, chunk_shape, 0, (rng[0], rng[1]))
        fragments.append(FragmentInfo(path / entry, offset, (rng[0], rng[1]), pieces))
    return fragments


def list_tensor_names(root: Path) -> List[str]:
    """Directory names of every stored tensor."""
    if not root.is_dir():
        raise CorruptCheckpointError(f"{str(root)!r} is missing: the zarr part of the checkpoint is gone")
    return sorted(e for e in os.listdir(root) if not e.startswith(".") and e != "zarr.json")


def tensors_metadata(root: Path) -> ShardedStateDict:
    """``{key: ShardedTensor}`` (whole, unsharded, data on the meta device) for every tensor."""
    out: ShardedStateDict = {}
    for name in list_tensor_names(root):
        info = open_tensor_info(root, name)
        if info is not None:
            meta = torch.empty(info.global_shape, dtype=info.dtype, device="meta")
            out[info.key] = ShardedTensor.from_rank_offsets(info.key, meta)
    return out


def check_request(sh: ShardedTensor, info: StoredTensorInfo) -> List[str]:
    """Why ``sh`` cannot be loaded from ``info`` (empty if it can)."""
    problems = []
    if sh.dtype != info.dtype:
        problems.append(f"{sh.key!r} is stored as {info.dtype}, requested as {sh.dtype}")
    if len(sh.global_shape) != len(info.global_shape) or (
        sh.global_shape != info.global_shape and not sh.allow_shape_mismatch
    ):
        problems.append(
            f"{sh.key!r} has global shape {info.global_shape} in the checkpoint, requested "
            f"{sh.global_shape} (set allow_shape_mismatch=True to pad or crop)"
        )
    return problems


def raise_mismatches(problems: Sequence[str], checkpoint_dir: Path, rank: int) -> None:
    """Raise one :class:`LoadMismatchError` listing ``problems`` (if any)."""
    if problems:
        raise LoadMismatchError(
            f"[rank {rank}] checkpoint {str(checkpoint_dir)!r} does not match the requested tensors: "
            + "; ".join(problems[:10])
            + (f"; ... and {len(problems) - 10} more" if len(problems) > 10 else "")
        )


@dataclass(frozen=True)
class ReadOp:
    """Read ``region`` of the array at ``array_path``; view it as ``src_box`` (global
    coordinates); copy its ``inter`` part into destination piece ``dst``."""

    array_path: Path
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
    checkpoint_dir: Path, get_shape_dtype_fn: Callable[[str], Tuple[Tuple[int, ...], np.dtype]]
) -> ShardedStateDict:
    """``{key: ShardedTensor}`` for every stored tensor, shapes read with ``get_shape_dtype_fn``.

    Args:
        checkpoint_dir: checkpoint root directory.
        get_shape_dtype_fn: returns ``(shape, numpy dtype)`` of the zarr array at a path; lets
            each engine (zarr-python, TensorStore) open arrays its own way.
    """
    root = Path(checkpoint_dir) / ZARR_DIR
    out = tensors_metadata(root)
    for name in list_tensor_names(root):
        info = open_tensor_info(root, name)
        if info is None or info.layout != LAYOUT_CHUNKED:
            continue
        shape, np_dtype = get_shape_dtype_fn(str(info.path))
        if tuple(shape) != info.global_shape or np.dtype(np_dtype).itemsize != info.dtype.itemsize:
            raise CorruptCheckpointError(
                f"{info.path}: the array is {tuple(shape)} {np_dtype}, its attributes say {info.global_shape} {info.dtype}"
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
        raise LoadMismatchError(
            f"{expected_sharded_ten.key!r}: cannot pad a {x.ndim}-d tensor to local shape {target}"
        )
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
_RESERVED = ("zarr.json",)


def tensor_dir_name(key: str) -> str:
    """Directory name (under ``zarr/``) of the tensor stored under ``key``.

    The encoded key, with its first character percent-encoded when the name would collide with
    the root group's ``zarr.json`` or start with zarr's reserved ``__``.
    """
    name = encode_key(key)
    if name in _RESERVED or name.startswith("__"):
        name = f"%{ord(name[0]):02X}{name[1:]}"
    return name


def tensor_dir(root: Path, key: str) -> Path:
    """Directory of the tensor stored under ``key``."""
    return root / tensor_dir_name(key)
