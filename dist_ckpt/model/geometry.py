"""Pure shard geometry: which global elements a shard covers, and views onto them.

Resharding reduces to one question asked many times: which part of a stored shard overlaps
which part of a requested shard? A shard covers either a hyper-rectangle ("box") of the global
tensor, or, with ``flattened_range``, a contiguous range of the row-major flattening of such a
box. A flat range splits into at most ``2 * ndim - 1`` boxes that are each contiguous in that
flattening (`flat_range_boxes()`), so every shard is a short list of `ShardPiece`
and any two shards overlap in a few box intersections. Every backend uses this module; nothing
here touches storage or torch.distributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle ``[offset, offset + shape)`` of a global index space."""

    offset: Shape
    shape: Shape

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stop(self) -> Shape:
        return tuple(o + s for o, s in zip(self.offset, self.shape))

    def intersect(self, other: "Box") -> Optional["Box"]:
        """The common part of two boxes of the same rank, or None if they do not overlap."""
        if len(self.offset) != len(other.offset):
            raise ValueError(f"cannot intersect boxes of rank {len(self.offset)} and {len(other.offset)}")
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset))
        hi = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        if any(h <= low for low, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi)))

    def slices_within(self, outer: "Box") -> Tuple[slice, ...]:
        """Index of this box inside a tensor that holds exactly ``outer``."""
        return tuple(slice(o - oo, o - oo + s) for o, s, oo in zip(self.offset, self.shape, outer.offset))


@dataclass(frozen=True)
class ShardPiece:
    """A box of the global tensor held contiguously by a shard.

    ``flat_offset`` is the position of the box's first element in the shard's flat data when the
    shard is flattened, and None when the shard holds its whole box as an n-d tensor.
    """

    box: Box
    flat_offset: Optional[int]


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> List[Tuple[Box, int]]:
    """Split the row-major flat range ``[start, stop)`` of ``shape`` into contiguous boxes.

    Returns ``(box, flat_start)`` pairs in increasing flat order, where each box's elements are
    exactly the flat indices ``[flat_start, flat_start + box.numel)``.
    """
    shape = tuple(shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of {total} elements")
    out: List[Tuple[Box, int]] = []
    _split(shape, start, stop, (), out)
    return out


def _split(shape: Shape, start: int, stop: int, prefix: Shape, out: List[Tuple[Box, int]]) -> None:
    depth = len(prefix)
    rest = shape[depth:]
    if start >= stop:
        return
    if not rest:
        out.append((Box(prefix, ()), _flat_index(shape, prefix)))
        return
    inner = math.prod(rest[1:])
    first_row, end_row = start // inner, stop // inner
    if first_row == end_row:  # the range lies inside one row: descend into it
        _split(shape, start - first_row * inner, stop - first_row * inner, prefix + (first_row,), out)
        return
    if start % inner:  # partial leading row
        _split(shape, start % inner, inner, prefix + (first_row,), out)
        first_row += 1
    if end_row > first_row:  # whole rows
        box = Box(prefix + (first_row,) + (0,) * len(rest[1:]), (1,) * depth + (end_row - first_row,) + rest[1:])
        out.append((box, _flat_index(shape, box.offset)))
    if stop % inner:  # partial trailing row
        _split(shape, 0, stop % inner, prefix + (end_row,), out)


def _flat_index(shape: Shape, index: Shape) -> int:
    """Row-major flat index of the element at ``index`` (padded with zeros) in ``shape``."""
    flat = 0
    padded = tuple(index) + (0,) * (len(shape) - len(index))
    for dim, i in zip(shape, padded):
        flat = flat * dim + i
    return flat


def shard_pieces(
    global_offset: Sequence[int],
    local_shape: Sequence[int],
    prepend_axis_num: int = 0,
    flattened_range: Optional[Tuple[int, int]] = None,
) -> List[ShardPiece]:
    """The global boxes a shard covers.

    Args:
        global_offset: offset of the shard's (unflattened) local box, one entry per global axis.
        local_shape: shape of the local box without the prepended axes.
        prepend_axis_num: number of leading global axes of size 1 in the local box.
        flattened_range: ``(start, stop)`` of the flattened local box the shard holds, if any.
    """
    full_shape = (1,) * prepend_axis_num + tuple(local_shape)
    offset = tuple(global_offset)
    if flattened_range is None:
        return [ShardPiece(Box(offset, full_shape), None)]
    start, stop = flattened_range
    pieces = []
    for box, flat_start in flat_range_boxes(full_shape, start, stop):
        global_box = Box(tuple(o + b for o, b in zip(offset, box.offset)), box.shape)
        pieces.append(ShardPiece(global_box, flat_start - start))
    return pieces


def piece_view(data: torch.Tensor, piece: ShardPiece, prepend_axis_num: int, holder: Box) -> torch.Tensor:
    """A view of ``data`` (a shard's tensor) holding ``piece.box``, shaped like the box.

    ``holder`` is the shard's full (unflattened) global box. For a non-flattened shard the view
    indexes ``data`` with leading size-1 axes added; for a flattened shard it reinterprets a
    slice of the 1-D data. Writing into the view writes into ``data``.
    """
    if piece.flat_offset is None:
        nd = data[(None,) * prepend_axis_num] if prepend_axis_num else data
        return nd[piece.box.slices_within(holder)]
    flat = data[piece.flat_offset : piece.flat_offset + piece.box.numel]
    if flat.is_contiguous():
        return flat.view(piece.box.shape)
    stride = flat.stride(0)
    strides = []
    acc = stride
    for dim in reversed(piece.box.shape):
        strides.append(acc)
        acc *= dim
    return flat.as_strided(piece.box.shape, tuple(reversed(strides)), flat.storage_offset())


def sub_view(view: torch.Tensor, view_box: Box, region: Box) -> torch.Tensor:
    """The part of ``view`` (which holds ``view_box``) that holds ``region``."""
    return view[region.slices_within(view_box)]
