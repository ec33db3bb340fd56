"""A save's zarr tree on a local disk, written without an array library.

Both engines save this way where the storage has ``local_paths`` (on a little-endian host;
elsewhere their libraries write). The arrays this backend writes are uncompressed (the ``bytes``
codec alone), so a chunk file is exactly its shard's values as a contiguous tensor holds them,
and an array's ``zarr.json`` is a small document (`array_metadata()`): zarr-python and TensorStore
cost far more per array than the I/O (profiled at 585 tensors on 2 ranks, issue 17: a few
milliseconds of Python per array on zarr-python's one event-loop thread).

What is left is the file system's work per file and directory, kept to the least a zarr v3 tree
allows:

* one directory per array (chunk keys ``c.<i>.<j>``, `CHUNK_SEPARATOR`: no directory per grid
  level), made with one ``mkdir``; a directory that another rank or thread made already (the
  shards of one tensor) is found by ``mkdir`` failing, not checked for first;
* one ``open(O_CREAT | O_EXCL)`` per file (a chunk is written once: an existing file fails the
  save), written from the tensor's own memory; its digest comes from the bytes written;
* the tensors' directories are spread over the file system's block groups where it takes the
  hint (`spread_subdirectories()`): they are unrelated, and made by several ranks at once;
* one step for everything: the array libraries need every array to exist before any rank
  writes chunks into it (a collective step of its own), plain files do not;
* early writeback: a chunk file of at least `EARLY_WRITEBACK_BYTES` is handed to the disk as
  soon as it is written, so that the disk works while later files are written and the one
  ``syncfs`` at the end (`fsync_written()`) finds little left, and dropped from the page cache
  once later files were written (`WritebackWindow`): the save reuses the pages it just freed;
  once the save is done with them (durable, digested), the strategies drop what is left of the
  files from the page cache (`drop_written()`).

The save is planned first, as plain data (`plan_node_files()`: which directories and files this
rank writes), then written several nodes at a time (`write_node_files()`).
"""

from __future__ import annotations

import contextvars
import errno
import math
import os
import stat
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from dist_ckpt.backends.zarr.layout import (
    ATTR,
    CHUNK_SEPARATOR,
    chunk_key,
    fragment_chunk_elements,
    fragment_name,
    tensor_dir_name,
)
from dist_ckpt.backends.zarr.nodes import (
    IO_THREADS,
    array_chunk_shape,
    array_metadata,
    chunked_attributes,
    creates_array,
    creates_flattened_group,
    flattened_attributes,
    fragment_attributes,
    fsync_written,
    group_document,
    in_threads,
    stored_values,
    zarr_json_bytes,
)
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.integrity.checksums import FileDigest, bytes_digest, crc32c
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.storage.errors import ObjectExistsError, StorageError
from dist_ckpt.storage.files import SequentialWriter, WritebackWindow, spread_subdirectories
from dist_ckpt.storage.host_memory import DEFAULT_STAGING_BYTES, host_pieces, needs_staging, piece_bytes
from dist_ckpt.storage.object_path import ObjectPath

__all__ = [
    "EARLY_WRITEBACK_BYTES",
    "NodeFiles",
    "direct_writes",
    "make_root",
    "plan_node_files",
    "save_locally",
    "write_node_files",
    "write_planned",
]

#: a chunk file at least this large is handed to the disk as soon as it is written (see
#: `SequentialWriter.start_writeback()`); the smaller ones (biases, norms, every ``zarr.json``)
#: are a few pages each, left to the ``syncfs`` at the end
EARLY_WRITEBACK_BYTES = 1 << 20

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def direct_writes(root: ObjectPath) -> bool:
    """Whether a save into ``root`` writes its files here: a local storage on a little-endian
    host (elsewhere the engine's library writes them)."""
    return bool(root.storage.local_paths) and sys.byteorder == "little"


@dataclass(frozen=True)
class NodeFiles:
    """What one rank writes for one node of the tree: a tensor's array, a flattened tensor's
    group or one of its fragment arrays, or the root group. Names are relative to the root.

    Attributes:
        directories: made first, outermost first; another rank may have made them already.
        documents: ``(name, bytes)`` of each ``zarr.json`` this rank creates.
        shard: the shard whose values the chunk files hold (None: no chunk file).
        chunks: ``(name, first, end)`` of each chunk file: elements ``[first, end)`` of the
            shard's values, flattened.
        chunk_elements: elements of a whole chunk; a shorter piece (the last chunk of a fragment)
            is padded with zeros, as zarr stores the chunks at an array's edge whole.
    """

    directories: Tuple[str, ...]
    documents: Tuple[Tuple[str, bytes], ...] = ()
    shard: Optional[ShardedTensor] = None
    chunks: Tuple[Tuple[str, int, int], ...] = ()
    chunk_elements: int = 0


def _chunked_node(sh: ShardedTensor) -> Optional[NodeFiles]:
    name = tensor_dir_name(sh.key)
    documents: Tuple[Tuple[str, bytes], ...] = ()
    if creates_array(sh):
        meta = array_metadata(sh.global_shape, array_chunk_shape(sh), sh.dtype, chunked_attributes(sh))
        documents = ((f"{name}/zarr.json", zarr_json_bytes(meta)),)
    numel = math.prod(sh.local_shape)
    if numel == 0:
        return NodeFiles((name,), documents) if documents else None
    chunk = f"{name}/{chunk_key(sh.local_chunk_offset_in_global(), CHUNK_SEPARATOR)}"
    return NodeFiles((name,), documents, sh, ((chunk, 0, numel),), numel)


def _flattened_nodes(sh: ShardedTensor) -> List[NodeFiles]:
    assert sh.flattened_range is not None
    name = tensor_dir_name(sh.key)
    nodes = []
    if creates_flattened_group(sh):
        nodes.append(NodeFiles((name,), ((f"{name}/zarr.json", group_document({ATTR: flattened_attributes(sh)})),)))
    length = sh.flattened_range.stop - sh.flattened_range.start
    if length > 0:
        frag = f"{name}/{fragment_name(sh)}"
        per_chunk = fragment_chunk_elements(length)
        meta = array_metadata((length,), (per_chunk,), sh.dtype, fragment_attributes(sh))
        chunks = tuple(
            (f"{frag}/{chunk_key((i,), CHUNK_SEPARATOR)}", first, min(first + per_chunk, length))
            for i, first in enumerate(range(0, length, per_chunk))
        )
        nodes.append(NodeFiles((name, frag), ((f"{frag}/zarr.json", zarr_json_bytes(meta)),), sh, chunks, per_chunk))
    return nodes


def plan_node_files(shards: Sequence[ShardedTensor], root_group: bool) -> List[NodeFiles]:
    """The directories and files a rank writes for its main-replica ``shards`` (pure), with the
    root group's ``zarr.json`` if ``root_group`` (a stream's start; a save's root group comes
    last: `save_locally()`). Which rank creates each array or
    group is decided by `creates_array()` and `creates_flattened_group()`.

    Example:

    ```python
    plan_node_files([ShardedTensor.from_rank_offsets("w", torch.ones(2, 3))], root_group=True)
    # [NodeFiles((), (("zarr.json", ...),)), NodeFiles(("w",), (("w/zarr.json", ...),), <w>, (("w/c.0.0", 0, 6),), 6)]
    ```
    """
    nodes = [NodeFiles((), (("zarr.json", group_document({})),))] if root_group else []
    for sh in shards:
        if sh.flattened_range is None:
            node = _chunked_node(sh)
            nodes.extend([node] if node is not None else [])
        else:
            nodes.extend(_flattened_nodes(sh))
    return nodes


def _make_dir(path: str) -> None:
    """Make the directory ``path`` (its parent exists); one made already (by another rank or
    thread) is fine, anything else under its name (a file, a link) fails the save."""
    try:
        os.mkdir(path)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):  # lstat: a link is never written through
            raise FileExistsError(errno.EEXIST, "exists and is not a directory", path) from None


def _write_new(path: str, data: memoryview, window: Optional[WritebackWindow]) -> FileDigest:
    """Create ``path`` (it must not exist: a file is written once) with ``data``; a file of at
    least `EARLY_WRITEBACK_BYTES` goes to the disk right away, and to ``window`` (if any) to be
    dropped from the page cache later. Returns the digest of ``data``."""
    fd = os.open(path, _CREATE, 0o666)
    early = data.nbytes >= EARLY_WRITEBACK_BYTES
    try:
        writer = SequentialWriter(fd, early_writeback=early, url=path)
        writer.write(data)
        writer.start_writeback()
    except BaseException:
        os.close(fd)
        raise
    if early and window is not None:
        window.hand_over(fd, data.nbytes)
    else:
        os.close(fd)
    return bytes_digest(data)


def _write_staged(path: str, tensor: torch.Tensor, piece: int, window: Optional[WritebackWindow]) -> FileDigest:
    """Create ``path`` with ``tensor``'s row-major bytes, staged through host memory in pieces of
    at most ``piece`` bytes (a GPU or strided tensor: never copied whole, `host_pieces()`)."""
    fd = os.open(path, _CREATE, 0o666)
    nbytes = tensor.numel() * tensor.element_size()
    early = nbytes >= EARLY_WRITEBACK_BYTES
    crc = 0
    try:
        writer = SequentialWriter(fd, early_writeback=early, url=path)
        for data in host_pieces(tensor, piece, force=True):
            writer.write(data)
            crc = crc32c(data, crc)
        writer.start_writeback()
    except BaseException:
        os.close(fd)
        raise
    if early and window is not None:
        window.hand_over(fd, nbytes)
    else:
        os.close(fd)
    return FileDigest(nbytes, crc)


def write_node_files(
    top: str, node: NodeFiles, window: Optional[WritebackWindow] = None
) -> List[Tuple[str, FileDigest]]:
    """Write ``node`` under the local directory ``top`` (the tree's root, which exists); returns
    ``(name, digest)`` of each file written. Its large files go to ``window`` once written. A
    GPU or strided shard stored as one chunk is staged in pieces of the host-memory budget's
    share of one of the `IO_THREADS` (run it in the caller's context to see a call's budget).

    Raises:
        ObjectExistsError: a file or directory of the node exists already (a file is written once).
        StorageError: the file system refused (no space, permissions, ...); the message names the
            rank, the tensor and the path, the ``OSError`` is its cause.
    """
    try:
        return _write_node_files(top, node, window, piece_bytes(DEFAULT_STAGING_BYTES, shares=IO_THREADS))
    except OSError as e:
        what = f"of {node.shard.key!r}" if node.shard is not None else "of the tree"
        if isinstance(e, StorageError) and not isinstance(e, ObjectExistsError):  # a write: it names the file
            raise e.reworded(f"[rank {get_rank()}] writing the zarr files {what} failed: {e}") from e
        if isinstance(e, CheckpointingException):
            raise
        path = e.filename or os.path.join(top, node.directories[-1] if node.directories else "")
        message = f"[rank {get_rank()}] writing the zarr files {what} failed at {path}: {e.strerror or e}"
        error = ObjectExistsError if isinstance(e, FileExistsError) else StorageError
        raise error(message, url=str(path), operation="write") from e


def _write_node_files(
    top: str, node: NodeFiles, window: Optional[WritebackWindow], staged_piece: int
) -> List[Tuple[str, FileDigest]]:
    for directory in node.directories:
        _make_dir(os.path.join(top, directory))
    written = [(name, _write_new(os.path.join(top, name), memoryview(raw), window)) for name, raw in node.documents]
    data = node.shard.data if node.shard is not None else None
    whole = len(node.chunks) == 1 and node.chunks[0][1:] == (0, node.chunk_elements)
    if data is not None and whole and needs_staging(data) and data.numel() == node.chunk_elements:
        name = node.chunks[0][0]
        written.append((name, _write_staged(os.path.join(top, name), data, staged_piece, window)))
    elif node.shard is not None:
        # converted here, in the writing thread: one tensor's copy at a time
        raw = stored_values(node.shard).reshape(-1).view(np.uint8)
        itemsize = node.shard.dtype.itemsize
        for name, first, end in node.chunks:
            piece = raw[first * itemsize : end * itemsize]
            if end - first < node.chunk_elements:
                piece = np.concatenate([piece, np.zeros((node.chunk_elements - (end - first)) * itemsize, np.uint8)])
            written.append((name, _write_new(os.path.join(top, name), piece.data, window)))
    return written


def write_planned(
    root: ObjectPath, nodes: Sequence[NodeFiles], digests: Dict[ObjectPath, FileDigest]
) -> List[ObjectPath]:
    """Write ``nodes`` under ``root`` (a local directory that exists), several at a time
    (`in_threads()`), dropping each large file from the page cache once later ones were written
    (`WritebackWindow`); returns the files written, their digests recorded in ``digests``."""
    top = str(root.local_path())
    files = []
    caller = contextvars.copy_context()  # a call's host-memory budget, which threads do not inherit
    try:
        with WritebackWindow() as window:
            per_node = in_threads(lambda node: caller.copy().run(write_node_files, top, node, window), nodes)
    except OSError as e:
        if isinstance(e, CheckpointingException):  # a node's write failed: it names the file
            raise
        message = f"[rank {get_rank()}] closing the zarr files written under {top} failed: {e.strerror or e}"
        raise StorageError(message, url=top, operation="write") from e
    for written in per_node:
        for name, digest in written:
            path = root / name
            digests[path] = digest
            files.append(path)
    return files


def make_root(root: ObjectPath) -> None:
    """Make the tree's root directory (durably; every rank may), whose directories -- one per
    tensor, unrelated to each other -- the file system may spread (`spread_subdirectories()`)."""
    root.mkdir()
    spread_subdirectories(root.local_path())


def save_locally(
    root: ObjectPath, shards: Sequence[ShardedTensor], digests: Dict[ObjectPath, FileDigest], documents: Dict[str, str]
) -> List[ObjectPath]:
    """One rank's part of a save into ``root`` (``.partial-zarr`` on a local disk): every array,
    group and chunk file of its main-replica ``shards``, made durable; returns the files, their
    digests recorded in ``digests`` and the text of each ``zarr.json`` in ``documents`` (by
    name under ``root``). The root group is written last, by rank 0, with every rank's
    documents (`commit_checksums()` with them: `dist_ckpt.backends.zarr.metadata_index`)."""
    make_root(root)
    nodes = plan_node_files(shards, root_group=False)
    written = write_planned(root, nodes, digests)
    fsync_written(written, root)
    documents.update((name, raw.decode("utf-8")) for node in nodes for name, raw in node.documents)
    return written
