"""Which DCP items a load reads, and where their values go: a DCP ``LoadPlanner`` for ShardedTensors.

DCP reshards with `torch.distributed.checkpoint.planner_helpers.create_read_items_for_chunk_list()`:
given the chunks a rank wants of a stored tensor, it returns ``ReadItem`` s (which stored chunk,
which box of it, which box of the wanted chunk). DCP's reader then loads each stored item,
narrows it and ``copy_`` s it into the tensor the planner's ``resolve_tensor`` returns -- casting
to that tensor's dtype on the way. This module turns dist_ckpt requests into wanted chunks:

* a ShardedTensor wants the box ``global_offset`` / ``(1,) * prepend_axis_num + local_shape``; a
  flattened one the few boxes its flat range is made of (`shard_pieces()`);
  each box's destination is a view of the result tensor, so DCP copies straight into it (in place
  when the request's ``data`` is allocated);
* with ``allow_shape_mismatch`` the box is clipped to the stored tensor and the rest zero-filled;
* a tensor stored *reformulated* (Megatron-Core's flattened layout, see `layout`) keeps each
  block's elements in row-major order on its flat axis: a flattened request of the saved layout,
  or a whole block wanted in contiguous memory, is read straight into place; otherwise, for each
  block a box overlaps, the plan reads the flat range from the box's first to its last element
  into a scratch tensor, and ``commit_tensor`` copies the box's elements out of it once every item
  of the range arrived.

Every wanted chunk must be covered exactly by stored chunks; a gap (a damaged ``.metadata``)
raises [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError] before anything is read.

ShardedObjects are ``BYTE_IO`` items; ``load_bytes`` unpickles them with
``torch.load(weights_only=True)`` (see `objects`), never with DCP's default full pickle.
"""

from __future__ import annotations

import dataclasses
import io
import math
from dataclasses import dataclass
from itertools import product
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from dist_ckpt.backends.base import load_destination
from dist_ckpt.backends.torch_dist.layout import StoredTensor, TorchDistLayout
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import CorruptCheckpointError
from dist_ckpt.model.geometry import Box, flat_range_boxes, piece_view, shard_pieces, sub_view
from dist_ckpt.model.sharded import ShardedTensor

__all__ = ["ReadPlanner", "object_read_item", "plan_tensor_reads"]

Shape = Tuple[int, ...]


@dataclass
class _Target:
    """Where the values of one wanted chunk go.

    ``view`` is shaped like the chunk; it is a view of the result (DCP copies into it), or a
    scratch tensor that ``scatter`` copies out of once ``pending`` items have arrived.
    """

    view: torch.Tensor
    pending: int = 0
    scatter: Optional[Callable[[torch.Tensor], None]] = None


def _flat_index(shape: Shape, index: Sequence[int]) -> int:
    flat = 0
    for dim, i in zip(shape, index):
        flat = flat * dim + i
    return flat


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, offset, length)
    return tensor


class _Wanted:
    """The chunks one key is read into: ``(offsets, sizes)`` in the stored tensor, and targets."""

    def __init__(self) -> None:
        self.chunks: List[ChunkStorageMetadata] = []
        self.targets: List[_Target] = []

    def add(self, offsets: Shape, sizes: Shape, target: _Target) -> None:
        self.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        self.targets.append(target)


def _plain_boxes(sh: ShardedTensor, dest: torch.Tensor) -> List[Tuple[Box, torch.Tensor]]:
    """The boxes of the global tensor ``sh`` wants, each with the view of ``dest`` it fills."""
    rng = None if sh.flattened_range is None else (sh.flattened_range.start, sh.flattened_range.stop)
    holder = Box(tuple(sh.global_offset), tuple(sh.full_local_shape))
    return [
        (piece.box, piece_view(dest, piece, sh.prepend_axis_num, holder))
        for piece in shard_pieces(sh.global_offset, sh.local_shape, sh.prepend_axis_num, rng)
        if piece.box.numel
    ]


def _want_reformulated(stored: StoredTensor, region: Box, view: torch.Tensor, wanted: _Wanted) -> None:
    """Wanted chunks of a reformulated tensor for ``region`` (original coordinates), whose values go
    to ``view`` (shaped like ``region``): one flat range of each block the region overlaps."""
    block = stored.block_shape
    ranges = [range(o // b, (o + n - 1) // b + 1) for o, n, b in zip(region.offset, region.shape, block)]
    for index in product(*ranges):
        block_box = Box(tuple(i * b for i, b in zip(index, block)), block)
        inter = region.intersect(block_box)
        if inter is None:
            continue
        target_view = sub_view(view, region, inter)
        if inter == block_box and target_view.is_contiguous():  # a whole block into contiguous memory
            flat = (1,) * len(index) + (block_box.numel,)
            wanted.add(tuple(index) + (0,), flat, _Target(target_view.view(flat)))
            continue
        local = Box(tuple(o - bo for o, bo in zip(inter.offset, block_box.offset)), inter.shape)
        lo = _flat_index(block, local.offset)
        hi = _flat_index(block, [o + n - 1 for o, n in zip(local.offset, local.shape)]) + 1
        scratch = torch.empty((1,) * len(index) + (hi - lo,), dtype=view.dtype)

        def scatter(
            values: torch.Tensor, local: Box = local, lo: int = lo, hi: int = hi, out: torch.Tensor = target_view
        ) -> None:
            flat = values.reshape(-1)
            for box, start in flat_range_boxes(block, lo, hi):
                part = local.intersect(box)
                if part is None:
                    continue
                src = flat[start - lo : start - lo + box.numel].view(box.shape)[part.slices_within(box)]
                out[part.slices_within(local)].copy_(src)

        wanted.add(tuple(index) + (lo,), (1,) * len(index) + (hi - lo,), _Target(scratch, scatter=scatter))


def _want_saved_range(sh: ShardedTensor, stored: StoredTensor, dest: torch.Tensor, wanted: _Wanted) -> bool:
    """A flattened request for a range of exactly one stored block (the distributed optimizer loading
    the layout it saved) reads the stored range straight into ``dest``; False if it is not one."""
    if stored.original_shape is None or sh.flattened_range is None or not dest.is_contiguous():
        return False
    block = stored.block_shape
    if tuple(sh.full_local_shape) != block or any(o % b for o, b in zip(sh.global_offset, block)):
        return False
    if tuple(sh.global_shape) != stored.shape:
        return False
    index = tuple(o // b for o, b in zip(sh.global_offset, block))
    start, stop = sh.flattened_range.start, sh.flattened_range.stop
    if stop > start:
        flat = (1,) * len(index) + (stop - start,)
        wanted.add(index + (start,), flat, _Target(dest.view(flat)))
    return True


def plan_tensor_reads(
    requests: Sequence[ShardedTensor], layout: TorchDistLayout
) -> Tuple[Dict[int, torch.Tensor], List[ReadItem], List[_Target]]:
    """The result tensor of each request (by ``id``), the ReadItems and their targets (a
    ReadItem's ``dest_index.index`` is the position of its target).

    Raises:
        CorruptCheckpointError: the stored chunks do not cover a wanted chunk exactly.
    """
    results: Dict[int, torch.Tensor] = {}
    by_key: Dict[str, _Wanted] = {}
    for sh in requests:
        stored = layout.tensors[sh.key]
        dest = load_destination(sh)
        results[id(sh)] = dest
        if dest.numel() == 0:  # nothing to read (an empty range, or a tensor without elements)
            continue
        bounds = Box((0,) * len(stored.shape), stored.shape)
        wanted = by_key.setdefault(sh.key, _Wanted())
        if _want_saved_range(sh, stored, dest, wanted):
            continue
        for box, view in _plain_boxes(sh, dest):
            region = box.intersect(bounds)
            if region != box:  # allow_shape_mismatch: what the checkpoint lacks reads as zeros
                view.zero_()
            if region is None:
                continue
            region_view = sub_view(view, box, region)
            if stored.original_shape is not None:
                _want_reformulated(stored, region, region_view, wanted)
            else:
                wanted.add(region.offset, region.shape, _Target(region_view))
    items: List[ReadItem] = []
    targets: List[_Target] = []
    for key, wanted in by_key.items():
        entry = layout.metadata.state_dict_metadata[key]
        assert isinstance(entry, TensorStorageMetadata)
        found = create_read_items_for_chunk_list(key, entry, wanted.chunks)
        covered = [0] * len(wanted.chunks)
        for item in found:
            local = item.dest_index.index
            assert local is not None
            covered[local] += math.prod(item.lengths)
            position = len(targets) + local
            items.append(dataclasses.replace(item, dest_index=MetadataIndex(key, item.dest_index.offset, position)))
            wanted.targets[local].pending += 1
        for chunk, n in zip(wanted.chunks, covered):
            if n != math.prod(chunk.sizes):
                raise CorruptCheckpointError(
                    f"[rank {get_rank()}] tensor {key!r} in {layout.where}: the stored chunks cover {n} of the "
                    f"{math.prod(chunk.sizes)} elements of the box at {list(chunk.offsets)} of size "
                    f"{list(chunk.sizes)} (chunks are missing from the DCP metadata, or overlap)"
                )
        targets.extend(wanted.targets)
    return results, items, targets


def object_read_item(unique_key: str) -> ReadItem:
    """The ReadItem of a bytes entry (a ShardedObject)."""
    index = MetadataIndex(unique_key)
    zero = torch.Size((0,))
    return ReadItem(LoadItemType.BYTE_IO, index, zero, index, zero, zero)


def _nothing() -> None:
    pass


class ReadPlanner(LoadPlanner):
    """A DCP ``LoadPlanner`` whose plan is made beforehand (`plan_tensor_reads()`), for one rank
    without collectives (``dcp.load(..., no_dist=True)``).

    Args:
        items: the ReadItems of the plan (tensors and bytes entries).
        targets: where each tensor ReadItem's values go (by ``dest_index.index``).
        on_bytes: called with ``(unique_key, bytes)`` for each bytes entry read.
        metadata: the checkpoint's metadata (DCP passes it again to ``set_up_planner``).

    Attributes:
        before_item: called with no argument when an item has been read, before its values are
            used (the reader's checksum check sets it); by default nothing.
    """

    def __init__(self, items: List[ReadItem], targets: List[_Target], on_bytes: Callable[[str, bytes], None]) -> None:
        self._items = items
        self._targets = targets
        self._on_bytes = on_bytes
        self.before_item: Callable[[], None] = _nothing

    def set_up_planner(
        self, state_dict: Dict[str, Any], metadata: Optional[Metadata] = None, is_coordinator: bool = False
    ) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(self._items)

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.before_item()
        self._on_bytes(read_item.storage_index.fqn, value.getvalue())

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        self.before_item()
        target = self._targets[read_item.dest_index.index or 0]
        return _narrow(target.view, read_item.dest_offsets, read_item.lengths)

    def load_tensor(self, read_item: ReadItem, stored: torch.Tensor, where: str) -> None:
        """Put the values of a tensor item, as unpickled from ``where``, in place: what DCP's
        reader does (narrow it to the item's box, copy it into `resolve_tensor()`'s target,
        `commit_tensor()`), after checking that the item holds the dtype ``.metadata`` declares.

        DCP's copy would cast an item of another dtype without a word; a request of another
        dtype than the declared one asked for a cast, and gets the stored values converted.

        Raises:
            CorruptCheckpointError: the item is stored in another dtype than declared (and the
                request did not ask for a cast), or does not have the shape of its chunk.
        """
        values = _narrow(stored, read_item.storage_offsets, read_item.lengths)
        target = self.resolve_tensor(read_item).detach()
        key = read_item.storage_index.fqn
        chunk = (
            f"[rank {get_rank()}] the chunk of tensor {key!r} at offsets {list(read_item.storage_index.offset or ())}"
        )
        entry = self.metadata.state_dict_metadata.get(key) if self.metadata is not None else None
        declared = entry.properties.dtype if isinstance(entry, TensorStorageMetadata) else None
        if stored.dtype != declared and target.dtype == declared:
            raise CorruptCheckpointError(
                f"{chunk} in {where} is stored as {stored.dtype}, the DCP metadata declares {declared}: the metadata "
                f"does not describe the data (request another dtype to convert the stored values)"
            )
        if target.size() != values.size():
            raise CorruptCheckpointError(
                f"{chunk} in {where} holds {list(stored.shape)} elements, which do not fit its box "
                f"{list(read_item.lengths)}"
            )
        target.copy_(values)
        self.commit_tensor(read_item, target)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        target = self._targets[read_item.dest_index.index or 0]
        target.pending -= 1
        if target.pending == 0 and target.scatter is not None:
            target.scatter(target.view)
