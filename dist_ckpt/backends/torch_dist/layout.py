"""How ShardedTensors and ShardedObjects map onto DCP's metadata, both ways (pure functions).

The mapping is Megatron-Core's (``megatron.core.dist_checkpointing.strategies.torch``):

* a ShardedTensor is stored under its key, verbatim, as one DCP chunk per main replica:
  ``offsets = global_offset`` and ``sizes = (1,) * prepend_axis_num + local_shape`` (prepended axes
  included), in a DCP tensor of size ``global_shape``;
* a ShardedTensor with a ``flattened_range`` (distributed optimizer, megatron-core <= 0.15) is
  stored in the *reformulated* layout: a tensor of ``global_shape // full_local_shape`` blocks along
  each axis plus one flat axis of ``prod(local_shape)`` elements, the original shape recorded in the
  metadata's ``mcore_data[key]["nd_reformulated_orig_global_shape"]``; the piece ``[s, e)`` of the
  flattened chunk at block index ``c`` is the DCP chunk ``offsets = c + (s,)``, ``sizes = (1,) *
  len(c) + (e - s,)``;
* a ShardedObject is a bytes item keyed by its unique key ``<key>/shard_<offset>_<shape>``, holding
  ``torch.save`` of a list of the values this rank saved under that key (normally one).

`parse_layout()` reads what a ``.metadata`` describes into `StoredTensor` records (with
every chunk's file and byte range); `write_chunk()` gives the chunk a ShardedTensor is saved as.

Example:

```python
layout = parse_layout(read_metadata(ckpt), str(ckpt))
layout.tensors["decoder.w"].shape, layout.tensors["decoder.w"].chunks[0].file
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from dist_ckpt.backends.stored_shards import StoredShardInfo, stored_key
from dist_ckpt.backends.torch_dist.metadata import mcore_data
from dist_ckpt.errors import CorruptCheckpointError, InvalidShardedTensorError
from dist_ckpt.model.sharded import ShardedObject, ShardedStateDict, ShardedTensor
from dist_ckpt.model.stored_metadata import stored_tensor_metadata
from dist_ckpt.model.tiling import tiling_problem

__all__ = [
    "REFORMULATED_SHAPE",
    "StoredChunk",
    "StoredItem",
    "StoredTensor",
    "TorchDistLayout",
    "chunk_data",
    "describe_layout",
    "parse_layout",
    "sharded_metadata",
    "tensors_metadata",
    "write_chunk",
]

Shape = Tuple[int, ...]

#: the ``mcore_data`` entry holding the original shape of a tensor stored reformulated
REFORMULATED_SHAPE = "nd_reformulated_orig_global_shape"


@dataclass(frozen=True)
class StoredItem:
    """Where one DCP item (a tensor chunk or a bytes entry) lies: its file, relative to the
    checkpoint directory, and its byte range there."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class StoredChunk:
    """One stored chunk of a DCP tensor: a box of the stored tensor and where its bytes are."""

    offsets: Shape
    sizes: Shape
    item: StoredItem


@dataclass(frozen=True)
class StoredTensor:
    """Everything ``.metadata`` says about one tensor.

    Attributes:
        key: the DCP key (the ShardedTensor key).
        dtype: stored dtype.
        stored_shape: the DCP tensor's size.
        chunks: its chunks.
        original_shape: for a tensor stored reformulated (flattened ranges), the tensor's real
            global shape; None otherwise.
    """

    key: str
    dtype: torch.dtype
    stored_shape: Shape
    chunks: Tuple[StoredChunk, ...]
    original_shape: Optional[Shape] = None

    @property
    def shape(self) -> Shape:
        """The tensor's global shape as a ShardedTensor sees it."""
        return self.stored_shape if self.original_shape is None else self.original_shape

    @property
    def block_shape(self) -> Shape:
        """For a reformulated tensor, the shape of one flattened block (the local chunk it was
        saved from, prepended axes of size 1 included)."""
        assert self.original_shape is not None
        return tuple(o // s for o, s in zip(self.original_shape, self.stored_shape))


@dataclass(frozen=True)
class TorchDistLayout:
    """What a DCP checkpoint stores, by key.

    Attributes:
        where: the checkpoint, for messages.
        metadata: the unpickled DCP ``Metadata``.
        tensors: every tensor.
        byte_items: every bytes entry (ShardedObjects of torch_dist, other values of plain DCP).
    """

    where: str
    metadata: Metadata
    tensors: Dict[str, StoredTensor]
    byte_items: Dict[str, StoredItem]

    def items(self) -> List[StoredItem]:
        """Every stored item, tensors' chunks and bytes entries."""
        return [c.item for t in self.tensors.values() for c in t.chunks] + list(self.byte_items.values())


def _item(md: Metadata, index: MetadataIndex, where: str) -> StoredItem:
    info = md.storage_data.get(index)
    if info is None:
        raise CorruptCheckpointError(
            f"{where}: the DCP metadata lists {index.fqn!r} (offset {list(index.offset or ())}) but records no file "
            f"for it"
        )
    path, offset, length = (getattr(info, name, None) for name in ("relative_path", "offset", "length"))
    if not isinstance(path, str) or not isinstance(offset, int) or not isinstance(length, int):
        raise CorruptCheckpointError(f"{where}: the storage entry of {index.fqn!r} is not a file range: {info!r}")
    if "/" in path or path in ("", ".", "..") or offset < 0 or length < 0:
        raise CorruptCheckpointError(f"{where}: the storage entry of {index.fqn!r} names {path!r} at {offset}+{length}")
    if getattr(info, "transform_descriptors", None):
        raise CorruptCheckpointError(
            f"{where}: {index.fqn!r} was written with stream transforms {info.transform_descriptors} "
            f"(DCP extensions), which this loader does not apply"
        )
    return StoredItem(path, offset, length)


def _original_shape(key: str, entry: TensorStorageMetadata, extra: Dict[str, Any], where: str) -> Optional[Shape]:
    """The original shape of a reformulated tensor (checked against its stored size), or None."""
    entry_extra = extra.get(key)
    recorded = entry_extra.get(REFORMULATED_SHAPE) if isinstance(entry_extra, dict) else None
    if recorded is None:
        return None
    original = tuple(int(s) for s in recorded)
    stored = tuple(int(s) for s in entry.size)
    if len(stored) != len(original) + 1 or any(s == 0 or o % s for o, s in zip(original, stored[:-1])):
        raise CorruptCheckpointError(
            f"{where}: {key!r} is stored reformulated as {list(stored)} but its recorded original shape is "
            f"{list(original)}: the two do not describe a grid of flattened blocks"
        )
    block = [o // s for o, s in zip(original, stored[:-1])]
    if math.prod(block) != stored[-1]:
        raise CorruptCheckpointError(
            f"{where}: {key!r}: blocks of {block} elements per axis hold {math.prod(block)} elements, but the stored "
            f"flat axis has {stored[-1]}"
        )
    return original


def _check_chunks(key: str, dtype: torch.dtype, size: Shape, chunks: List[StoredChunk], where: str) -> None:
    """Raise CorruptCheckpointError unless the chunks of tensor ``key`` cover it exactly once and
    each has the bytes its elements need in its file.

    A hostile ``.metadata`` made only of DCP's classes can list a chunk many times (DCP's
    resharding helper is then quadratic in the count), chunks that overlap or leave a gap (a load
    returns elements never stored), or a huge size (allocating it fails with a raw RuntimeError):
    every reader of the layout -- loads, ``load_tensors_metadata``, ``unshard``, ``verify`` -- is
    refused here, before anything is planned or allocated. DCP stores each chunk as ``torch.save``
    of a tensor of exactly its elements, so a chunk's item holds at least their bytes, and a
    declared size is bounded by the bytes of the chunks that tile it.
    """
    for chunk in chunks:
        need = math.prod(chunk.sizes) * dtype.itemsize
        if chunk.item.length < need:
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r}: its chunk at offsets {list(chunk.offsets)} of size {list(chunk.sizes)} "
                f"({dtype}) needs {need} bytes, the DCP metadata gives it {chunk.item.length} bytes in "
                f"{chunk.item.file!r}"
            )
    problem = tiling_problem(size, [(c.offsets, c.sizes) for c in chunks])
    if problem is not None:
        raise CorruptCheckpointError(
            f"{where}: the chunks of tensor {key!r} {list(size)} in the DCP metadata do not cover it exactly once: "
            f"{problem}"
        )


def parse_layout(md: Metadata, where: str) -> TorchDistLayout:
    """The stored tensors and bytes entries of ``md``, each with its file ranges.

    Raises:
        CorruptCheckpointError: an entry of an unknown kind, a chunk with no file, a chunk
            outside its tensor, chunks that do not cover their tensor exactly once (listed twice,
            overlapping, a gap), a chunk with fewer bytes than its elements need, or a
            reformulated tensor whose recorded shape does not fit.

    Example:

    ```python
    layout = parse_layout(md, "ckpt/iter_10")
    [c.item.file for c in layout.tensors["w"].chunks]
    ```
    """
    extra = mcore_data(md)
    tensors: Dict[str, StoredTensor] = {}
    byte_items: Dict[str, StoredItem] = {}
    for key, entry in md.state_dict_metadata.items():
        stored_key(key, f"the DCP metadata of {where}")
        if isinstance(entry, BytesStorageMetadata):
            byte_items[key] = _item(md, MetadataIndex(key), where)
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{where}: {key!r} has metadata of unknown kind {type(entry).__name__}")
        size = tuple(int(s) for s in entry.size)
        chunks = []
        for chunk in entry.chunks:
            offsets, sizes = tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes)
            if (
                len(offsets) != len(size)
                or len(sizes) != len(size)
                or any(o < 0 or o + n > s for o, n, s in zip(offsets, sizes, size))
            ):
                raise CorruptCheckpointError(
                    f"{where}: chunk at {list(offsets)} of size {list(sizes)} lies outside tensor {key!r} {list(size)}"
                )
            chunks.append(StoredChunk(offsets, sizes, _item(md, MetadataIndex(key, offsets), where)))
        dtype = entry.properties.dtype
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpointError(f"{where}: tensor {key!r} has no dtype ({dtype!r})")
        _check_chunks(key, dtype, size, chunks, where)
        tensors[key] = StoredTensor(key, dtype, size, tuple(chunks), _original_shape(key, entry, extra, where))
    return TorchDistLayout(where, md, tensors, byte_items)


# --------------------------------------------------------------------------- what loads report


def tensors_metadata(layout: TorchDistLayout) -> ShardedStateDict:
    """``{key: ShardedTensor}`` (data on the meta device) of every stored tensor, described as it
    was saved (`stored_tensor_metadata()`), as Megatron-Core
    describes them: with its global shape, or -- stored reformulated (saved as flattened ranges) --
    by its original shape with one flattened range covering all of it."""
    return {
        key: stored_tensor_metadata(key, stored.dtype, stored.shape, flattened=stored.original_shape is not None)
        for key, stored in sorted(layout.tensors.items())
    }


def sharded_metadata(layout: TorchDistLayout, with_objects: bool) -> ShardedStateDict:
    """`tensors_metadata()` plus, when ``with_objects``, every ShardedObject by unique key
    (bytes entries whose key is not a unique key are skipped)."""
    out = tensors_metadata(layout)
    if with_objects:
        for key in sorted(layout.byte_items):
            try:
                obj = ShardedObject.empty_from_unique_key(key)
            except InvalidShardedTensorError:
                continue
            out[obj.unique_key] = obj
    return out


def describe_layout(layout: TorchDistLayout) -> Dict[str, List[StoredShardInfo]]:
    """Each tensor's stored chunks, as ``dist-ckpt inspect --shards`` shows them: a box of the
    tensor (a flattened range of a box for reformulated tensors), its file and byte count."""
    out: Dict[str, List[StoredShardInfo]] = {}
    for key in sorted(layout.tensors):
        stored = layout.tensors[key]
        infos = []
        for chunk in sorted(stored.chunks, key=lambda c: c.offsets):
            if stored.original_shape is None:
                infos.append(StoredShardInfo(chunk.offsets, chunk.sizes, None, chunk.item.file, chunk.item.length))
                continue
            block = stored.block_shape
            offset = tuple(c * b for c, b in zip(chunk.offsets[:-1], block))
            flat = (chunk.offsets[-1], chunk.offsets[-1] + chunk.sizes[-1])
            infos.append(StoredShardInfo(offset, block, flat, chunk.item.file, chunk.item.length))
        out[key] = infos
    return out


# --------------------------------------------------------------------------- what saves write


def write_chunk(sh: ShardedTensor) -> Tuple[Shape, Shape, Shape]:
    """``(offsets, sizes, stored global shape)`` of the DCP chunk ``sh`` is saved as.

    A flattened tensor without elements (a global shape with a 0) is stored as one empty block
    (a grid of ones and a flat axis of 0), so that its shape is still recorded.

    Raises:
        InvalidShardedTensorError: a flattened ShardedTensor whose local chunks do not tile its
            global shape (the reformulated layout needs a regular grid).

    Example:

    ```python
    write_chunk(ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4), (0, 1, 2)))
    # ((2, 0), (2, 4), (4, 4))
    ```
    """
    full_local = sh.full_local_shape
    if sh.flattened_range is None:
        return tuple(sh.global_offset), tuple(full_local), tuple(sh.global_shape)
    if math.prod(sh.global_shape) == 0:  # nothing to tile: one empty block, recorded with its shape
        ones = (1,) * len(sh.global_shape)
        return (0,) * (len(ones) + 1), ones + (0,), ones + (0,)
    if any(n == 0 or g % n or o % n for g, n, o in zip(sh.global_shape, full_local, sh.global_offset)):
        raise InvalidShardedTensorError(
            f"{sh.key!r}: a flattened ShardedTensor is saved to torch_dist per chunk of a regular grid, but its local "
            f"shape {full_local} does not tile the global shape {sh.global_shape} at offset {sh.global_offset}"
        )
    grid = tuple(g // n for g, n in zip(sh.global_shape, full_local))
    index = tuple(o // n for o, n in zip(sh.global_offset, full_local))
    start, stop = sh.flattened_range.start, sh.flattened_range.stop
    return index + (start,), (1,) * len(index) + (stop - start,), grid + (math.prod(sh.local_shape),)


def chunk_data(sh: ShardedTensor) -> torch.Tensor:
    """``sh.data`` shaped like its DCP chunk (a view whenever the data's strides allow one)."""
    assert sh.data is not None
    _, sizes, _ = write_chunk(sh)
    return sh.data.reshape(sizes)
