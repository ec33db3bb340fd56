"""Where stored safetensors shards live: the data model every safetensors reader shares.

`TensorIndex` says where every stored tensor lives (file, byte range, box of the global
tensor): the ``safetensors`` backend reads it from its index (`index.read_index()`; the
shard table of index version 3 fills it lazily, see `index_v3`), HuggingFace folders build
it from their files' headers (`dist_ckpt.hf.folder`), and one loader reads any sharding from
it (`load`). It is its own module so that the index readers of every version can build it
without depending on each other.

Example:

```python
shard = StoredShard("rank00000_0.safetensors", "w@0", (0,), (4,), None, (128, 144))
index = TensorIndex(LocalStorage("ckpt/safetensors"), {"w": StoredTensor("w", torch.float32, (4,), [shard])})
```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from dist_ckpt.backends.stored_shards import StoredShardInfo
from dist_ckpt.model.geometry import Box, ShardPiece, shard_pieces
from dist_ckpt.model.sharded import ShardedStateDict
from dist_ckpt.model.stored_metadata import stored_tensor_metadata
from dist_ckpt.storage import Storage

__all__ = ["FLATTENED", "StoredShard", "StoredTensor", "TensorIndex", "describe_tensor_index", "tensors_metadata"]

#: field of a tensor entry of the safetensors index (every version): the tensor was saved as
#: flattened ranges (:attr:`StoredTensor.flattened`)
FLATTENED = "flattened"

Shape = Tuple[int, ...]


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
    ranges (distributed-optimizer state), which `tensors_metadata()` reports."""

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
    (`load_from_index()`) reads any sharding of either.

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
        prefetch: for an index read lazily (version 3), reads what it holds about the given keys
            before they are planned, all at once.
    """

    storage: Storage
    tensors: Dict[str, StoredTensor]
    aliases: Dict[str, str] = field(default_factory=dict)
    file_sizes: Dict[str, int] = field(default_factory=dict)
    description: str = ""
    from_headers: bool = False
    block_bytes: Optional[int] = None
    header_crcs: Dict[str, int] = field(default_factory=dict)
    prefetch: Optional[Callable[[Sequence[str]], None]] = None

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
    (see `dist_ckpt.model.stored_metadata`).

    Example:

    ```python
    meta = tensors_metadata(read_index(ckpt))
    meta["decoder.w"].global_shape, meta["decoder.w"].dtype
    ```
    """
    out: ShardedStateDict = {}
    for key in sorted(set(index.tensors) | set(index.aliases)):
        info = index.lookup(key)
        if info is not None:
            out[key] = stored_tensor_metadata(key, info.dtype, info.global_shape, info.flattened)
    return out


def describe_tensor_index(index: TensorIndex, prefix: str = "") -> Dict[str, List[StoredShardInfo]]:
    """The stored pieces of every tensor of a `TensorIndex` (for ``dist-ckpt inspect``);
    ``prefix`` is the files' directory relative to the checkpoint (``"safetensors/"``). A tied
    name stored once (an alias) is described by the pieces of the name it shares them with.

    Example:

    ```python
    describe_tensor_index(read_index(ckpt), "safetensors/")["w"][0].nbytes
    ```
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
