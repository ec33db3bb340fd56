"""Planning the reads of a load from a zarr-format checkpoint, before any byte is read.

A requested ShardedTensor becomes a `ReadPlan`: which region of which array to read, how
to view it in global coordinates, and which part goes where in the destination
(`ReadOp`), plus the destination parts outside the stored tensor to zero-fill
(``allow_shape_mismatch``). Keys, dtypes and shapes are checked for the whole request first, and
a plan that does not cover the request (missing fragments) is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from dist_ckpt.backends.request_checks import check_requested_tensors
from dist_ckpt.backends.zarr.layout import LAYOUT_CHUNKED, ZARR_DIR, chunk_coords, chunk_key
from dist_ckpt.backends.zarr.metadata import FragmentInfo, JsonCheck, JsonIndex, StoredTensorInfo, find_tensor_info
from dist_ckpt.backends.zarr.nodes import in_threads
from dist_ckpt.errors import CorruptCheckpointError
from dist_ckpt.model.geometry import Box, ShardPiece, piece_view, shard_pieces, sub_view
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.storage.object_path import ObjectPath

__all__ = ["ReadOp", "ReadPlan", "plan_reads", "plan_request"]


@dataclass(frozen=True)
class ReadOp:
    """Read ``region`` of the array at ``array_path``; view it as ``src_box`` (global
    coordinates); copy its ``inter`` part into destination piece ``dst``.

    ``chunk``: the key under the array (``c.0.1``, or ``c/0/1`` in older checkpoints:
    `chunk_key()`) of the one chunk file that holds all of ``region``, when the array's chunks are
    plain bytes (see `plain_chunk_bytes()`) in local files, which are read without an array
    library (`dist_ckpt.backends.zarr.direct`); else None. ``chunk_box``: that chunk's box, what
    its file holds (``region`` is all of it, or a part)."""

    array_path: ObjectPath
    region: Box
    src_box: Box
    dst: ShardPiece
    inter: Box
    chunk: Optional[str] = None
    chunk_box: Optional[Box] = None

    @property
    def whole_chunk(self) -> bool:
        """Whether ``region`` is all of the chunk file ``chunk``."""
        return self.chunk is not None and self.region == self.chunk_box

    def target_in(self, dest: torch.Tensor, prepend_axis_num: int, holder: Box) -> torch.Tensor:
        """The view of ``dest`` (a shard's data, holding the global box ``holder``) that receives
        this op's ``inter`` part."""
        return sub_view(piece_view(dest, self.dst, prepend_axis_num, holder), self.dst.box, self.inter)


@dataclass
class ReadPlan:
    """Every read needed to load one ShardedTensor, and the destination parts to zero-fill.

    ``stored_dtype`` is the dtype of the values read; the request's dtype may differ (each
    piece read is then converted while copied into place: `dist_ckpt.model.dtype_cast`).
    """

    ops: List[ReadOp]
    pad: List[Tuple[ShardPiece, Box]]  # (piece, its part outside the stored tensor)
    stored_dtype: torch.dtype


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
            ops += _chunked_ops(info, region, piece)
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
    return ReadPlan(ops, pad, info.dtype)


def plan_request(
    requested: Sequence[ShardedTensor],
    checkpoint_dir: ObjectPath,
    allow_dtype_cast: bool = True,
    check: JsonCheck = None,
    index: JsonIndex = None,
) -> Dict[int, ReadPlan]:
    """The reads of every requested shard (by ``id``), after checking keys, dtypes and shapes.

    Everything is checked before any tensor byte is read; see
    `check_requested_tensors()` (``allow_dtype_cast``:
    whether a requested dtype may differ from the stored one). ``check`` verifies every
    ``zarr.json`` read (against the checksum manifest); those ``index`` holds are not read
    (`dist_ckpt.backends.zarr.metadata_index`).
    """
    root = checkpoint_dir / ZARR_DIR
    keys = list(dict.fromkeys(sh.key for sh in requested))
    # several zarr.json at a time: a cold load waits on each file's read (none with an index)
    infos = dict(zip(keys, in_threads(lambda key: find_tensor_info(root, key, check, index), keys)))

    def lookup(key: str) -> Optional[Tuple[torch.dtype, Tuple[int, ...]]]:
        info = infos[key]
        return None if info is None else (info.dtype, info.global_shape)

    check_requested_tensors(requested, lookup, repr(str(checkpoint_dir)), allow_dtype_cast)
    return {id(sh): plan_reads(sh, infos[sh.key]) for sh in requested}  # type: ignore[arg-type]


def _chunked_ops(info: StoredTensorInfo, region: Box, piece: ShardPiece) -> List[ReadOp]:
    """The reads of ``region`` of a chunked array into ``piece``: where its chunks are plain bytes
    in local files, one per chunk it overlaps (each read from its file: a shard loaded in another
    layout than it was saved spans several chunks, or part of one); else one, through the
    engine's library."""
    if not (info.plain_chunks and info.path.storage.local_paths):
        return [ReadOp(info.path, region, region, piece, region)]
    ops = []
    for coords in chunk_coords(region, info.chunk_shape):
        chunk_box = Box(tuple(i * c for i, c in zip(coords, info.chunk_shape)), tuple(info.chunk_shape))
        part = region.intersect(chunk_box)
        assert part is not None  # chunk_coords() lists only the chunks region overlaps
        key = chunk_key(coords, info.chunk_separator)
        ops.append(ReadOp(info.path, part, part, piece, part, key, chunk_box))
    return ops


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
