"""A backend-neutral description of how each tensor of a checkpoint is stored.

``dist-ckpt inspect`` shows, for every tensor, how many pieces it was saved in, their shape (or
flattened ranges) and the files that hold them, whatever the backend. A load strategy provides
this through :meth:`~dist_ckpt.backends.base.LoadShardedStrategy.describe_stored_shards`,
returning :class:`StoredShardInfo` records built from its metadata alone (no tensor data is
read). This module builds them for the built-in layouts: an index of safetensors files (the
``safetensors`` backend and HuggingFace folders) and the zarr layout (both zarr engines).

Example::

    strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, "safetensors", 1)
    shards = strategy.describe_stored_shards(Path("ckpt/iter_1000"))
    shards["decoder.w"][0].file     # "safetensors/rank00000_0.safetensors"
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

if TYPE_CHECKING:  # imported by the functions that need them
    from dist_ckpt.backends.safetensors.load import TensorIndex
    from dist_ckpt.storage.object_path import Node

__all__ = ["StoredShardInfo", "describe_tensor_index", "describe_zarr"]

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class StoredShardInfo:
    """One stored piece of a tensor.

    Attributes:
        global_offset: offset of the piece's box in the global tensor.
        shape: shape of the box (every global axis).
        flat_range: ``(start, stop)`` of the box's row-major flattening the piece holds (a
            distributed-optimizer shard), or None for the whole box.
        file: the file (or, for a zarr fragment, the directory) holding it, relative to the
            checkpoint directory, ``/``-separated.
        nbytes: bytes stored for it.
    """

    global_offset: Shape
    shape: Shape
    flat_range: Optional[Tuple[int, int]]
    file: str
    nbytes: int

    def to_json(self) -> Dict[str, Any]:
        """A JSON-serializable dict (``dist-ckpt inspect --json --shards``)."""
        return {
            "global_offset": list(self.global_offset),
            "shape": list(self.shape),
            "flat_range": None if self.flat_range is None else list(self.flat_range),
            "file": self.file,
            "nbytes": self.nbytes,
        }


def describe_tensor_index(index: "TensorIndex", prefix: str = "") -> Dict[str, List[StoredShardInfo]]:
    """The stored pieces of every tensor of a safetensors :class:`~.safetensors_load.TensorIndex`;
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


def describe_zarr(checkpoint_dir: Node) -> Dict[str, List[StoredShardInfo]]:
    """The stored pieces of every tensor of a zarr-format checkpoint, from its ``zarr.json``
    files: a chunked tensor's chunks (each a saved shard), or a flattened tensor's fragments.

    Example::

        describe_zarr(Path("ckpt"))["w"][0].file    # "zarr/w/c/0/0"
    """
    from dist_ckpt.backends.zarr.layout import LAYOUT_CHUNKED, ZARR_DIR, chunk_key, list_tensor_names, open_tensor_info

    root = checkpoint_dir / ZARR_DIR  # a local Path or an object store's ObjectPath
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
                        offset, shape, None, f"{ZARR_DIR}/{name}/{chunk_key(coords)}", math.prod(chunk) * itemsize
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
