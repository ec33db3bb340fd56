"""What the zarr engines write, as plain data: node metadata, attributes, groups, durability.

The zarr-python engine builds the same nodes with zarr-python's own API; an engine without group
support (TensorStore) uses `array_metadata()` and `write_group()`. Which rank creates
which node (`creates_array()`, `creates_flattened_group()`) and what every node's
``dist_ckpt`` attributes hold are decided here, once, so both engines write the same checkpoint.
`fsync_written()` makes what an engine wrote by local path durable. A save writes its tree
into `writing_root()` and gives it its final name with `publish_written()` once every
rank is done, so a failed save leaves no data under the names a checkpoint uses.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple, TypeVar

import numpy as np
import torch

from dist_ckpt.backends.zarr.layout import (
    ATTR,
    CHUNK_SEPARATOR,
    LAYOUT_CHUNKED,
    LAYOUT_FLATTENED,
    PARTIAL_ZARR_DIR,
    ZARR_DIR,
)
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.model.dtypes import dtype_info, tensor_to_numpy
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.storage import fsync_dir
from dist_ckpt.storage.files import drop_from_page_cache, fsync_tree, sync_filesystem
from dist_ckpt.storage.object_path import ObjectPath

__all__ = [
    "ByteBudget",
    "array_chunk_shape",
    "array_metadata",
    "as_stored",
    "chunked_attributes",
    "cpu_contiguous",
    "creates_array",
    "creates_flattened_group",
    "drop_written",
    "fill_value_json",
    "flattened_attributes",
    "fragment_attributes",
    "fsync_written",
    "group_document",
    "in_threads",
    "is_origin",
    "publish_written",
    "stored_numpy_dtype",
    "stored_values",
    "write_group",
    "writing_root",
    "zarr_json_bytes",
]

Shape = Tuple[int, ...]

#: files or tensors a rank reads or writes at a time where each one waits on its own I/O (a
#: zarr-python call on its event loop, a checksum check reading a file): one at a time, a cold
#: load waits on one chunk file after another
IO_THREADS = 8

#: bytes of tensors a rank reads at once through zarr-python, whose reads make temporary copies:
#: several tensors at a time must not raise a load's peak memory above what the largest tensor
#: alone needs (one larger than this is read alone)
READ_BUDGET_BYTES = 64 * 2**20

_T = TypeVar("_T")
_R = TypeVar("_R")


def is_origin(sh: ShardedTensor) -> bool:
    """Whether ``sh`` is the tensor's first chunk: its holder creates the tensor's node."""
    return not any(sh.global_offset)


def creates_array(sh: ShardedTensor) -> bool:
    """Whether the holder of ``sh`` (a main replica, not flattened) creates its tensor's array.

    One chunk of each tensor, picked by a hash of the key, so that the arrays' creation is spread
    over the ranks (with tensor parallelism every tensor's first chunk is on rank 0, which then
    created every array while the other ranks waited). Every holder computes the same pick: the
    shards of a key have one local shape (the sharding check enforces it), hence one grid.
    """
    chunk = array_chunk_shape(sh)
    grid = [-(-g // c) for g, c in zip(sh.global_shape, chunk)]
    count = math.prod(grid)
    if count == 0:  # an empty tensor: its only shard
        return is_origin(sh)
    index = 0
    for off, c, n in zip(sh.global_offset, chunk, grid):
        index = index * n + off // c
    return index == zlib.crc32(sh.key.encode("utf-8")) % count


def array_chunk_shape(sh: ShardedTensor) -> Shape:
    """Zarr chunk shape of a tensor saved as a grid of shards: the shard shape (at least 1)."""
    return tuple(max(1, c) for c in sh.full_local_shape)


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

    Example:

    ```python
    stored_numpy_dtype(torch.bfloat16)   # dtype('uint16')
    stored_numpy_dtype(torch.float32)    # dtype('float32')
    ```
    """
    info = dtype_info(dtype)
    if info.bits_dtype is None:
        return info.numpy_dtype
    return np.dtype(f"uint{8 * info.numpy_dtype.itemsize}")


def as_stored(array: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``array`` (holding ``dtype``'s values) viewed as `stored_numpy_dtype()`, no copy."""
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
    """zarr v3 metadata of an uncompressed little-endian array, as the zarr backend writes it
    (chunk keys ``c.<i>.<j>``: `CHUNK_SEPARATOR`)."""
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
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": CHUNK_SEPARATOR}},
        "fill_value": fill_value_json(dtype),
        "codecs": [bytes_codec],
        "attributes": {ATTR: attributes},
        "storage_transformers": [],
    }


def zarr_json_bytes(document: Dict[str, Any]) -> bytes:
    """A node's ``zarr.json`` document as the zarr backend writes the file: indented UTF-8 JSON."""
    return json.dumps(document, indent=2).encode("utf-8")


def group_document(attributes: Dict[str, Any]) -> bytes:
    """The ``zarr.json`` of a zarr v3 group with ``attributes``, as the zarr backend writes it."""
    return zarr_json_bytes({"attributes": attributes, "zarr_format": 3, "node_type": "group"})


def write_group(path: ObjectPath, attributes: Dict[str, Any]) -> ObjectPath:
    """Write a zarr v3 group node at ``path`` (atomically, durably); returns its ``zarr.json``."""
    target = path / "zarr.json"
    target.write_bytes(group_document(attributes))
    return target


def cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` as contiguous host memory (copied from a device), what both engines write from."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def stored_values(sh: ShardedTensor) -> np.ndarray:
    """The values of the main replica ``sh`` as its chunks store them: contiguous host memory (no
    copy from a contiguous CPU tensor) viewed as `stored_numpy_dtype()`, what both engines write.

    Raises:
        CheckpointingException: ``sh`` has no data (naming the rank and the key).
    """
    if sh.data is None:
        raise CheckpointingException(f"[rank {get_rank()}] main replica of {sh.key!r} has no data to save")
    return as_stored(tensor_to_numpy(cpu_contiguous(sh.data)), sh.dtype)


def fsync_written(paths: Sequence[ObjectPath], root: ObjectPath) -> None:
    """Make the files an engine wrote by local path durable, with every directory from their
    parents up to ``root``, so that a crash after a save returns cannot lose them: one
    ``syncfs`` of the file system holding ``root`` (`sync_filesystem()`: the files were just
    created under ``root``, by this save, so they are on it), not an fsync per chunk file; a
    file and a directory at a time where there is no ``syncfs`` (`fsync_tree()`).

    Only a storage with ``local_paths`` needs it: the engines write object stores through their
    own clients, and an object is durable when its PUT returns.
    """
    if not root.storage.local_paths:
        return
    top = root.local_path()
    if not sync_filesystem(top):
        fsync_tree(_under(top, paths, root), top)


def _under(top: Path, paths: Sequence[ObjectPath], root: ObjectPath) -> List[Path]:
    """The local paths of ``paths`` under ``top``, ``root``'s local directory, resolved once
    (the files were just created under it, by this save): no per-file link checks."""
    return [top.joinpath(*node.relative_to(root).split("/")) for node in paths]


def drop_written(paths: Sequence[ObjectPath], root: ObjectPath) -> None:
    """Drop the files a save wrote by local path from the page cache (`drop_from_page_cache()`),
    once it is done with them: durable, and digested for the manifest.

    Why: a checkpoint is rarely read back soon; cached, it pushes a training job's data out of
    the page cache, and the next save writes into memory not used for a while (on the test VM,
    whose host takes back free memory, a 2-rank zarr save of 1.5 GB right after another took
    1.9-2.2 s with the previous one cached, 0.9-1.1 s with it dropped). Object stores: nothing.
    """
    if not root.storage.local_paths:
        return
    drop_from_page_cache(_under(root.local_path(), paths, root))


def in_threads(fn: Callable[[_T], _R], items: Sequence[_T]) -> List[_R]:
    """``[fn(item) for item in items]``, `IO_THREADS` at a time; the first failure (in
    ``items``' order) is raised once the calls under way have ended, and no further call starts.

    Example:

    ```python
    digests = in_threads(file_digest, paths)
    ```
    """
    if len(items) <= 1:
        return [fn(item) for item in items]
    pool = ThreadPoolExecutor(min(IO_THREADS, len(items)), thread_name_prefix="dist_ckpt_zarr")
    try:
        futures = [pool.submit(fn, item) for item in items]
        return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class ByteBudget:
    """At most ``limit`` bytes held at once by concurrent callers of `hold()`; a caller that
    asks for more than the limit waits until it is alone, then holds it all.

    Example:

    ```python
    budget = ByteBudget(64 << 20)
    with budget.hold(tensor_bytes):
        read(tensor)
    ```
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._held = 0
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` of the budget for the ``with`` block (waiting for room first)."""
        with self._changed:
            while self._held and self._held + nbytes > self._limit:
                self._changed.wait()
            self._held += nbytes
        try:
            yield
        finally:
            with self._changed:
                self._held -= nbytes
                self._changed.notify_all()


def writing_root(checkpoint: ObjectPath) -> ObjectPath:
    """The directory a save writes the zarr tree into: ``.partial-zarr`` where the storage has
    local directories (renamed to ``zarr`` by `publish_written()`), ``zarr/`` itself on an
    object store (objects appear whole when their upload completes, and a prefix cannot be
    renamed).

    Example:

    ```python
    root = writing_root(checkpoint_node(storage, "zarr"))   # <ckpt>/.partial-zarr on a disk
    ```
    """
    return checkpoint / (PARTIAL_ZARR_DIR if checkpoint.storage.local_paths else ZARR_DIR)


def publish_written(checkpoint: ObjectPath) -> None:
    """Rank 0, once every rank's files and the manifest are durable: give the tree its final
    name (one atomic rename of a directory, where the storage has local directories) and make
    the rename durable.

    Example:

    ```python
    publish_written(checkpoint_node(storage, "zarr"))   # .partial-zarr -> zarr
    ```
    """
    if checkpoint.storage.local_paths:
        directory = checkpoint.local_path()
        os.replace(directory / PARTIAL_ZARR_DIR, directory / ZARR_DIR)
        fsync_dir(directory)
