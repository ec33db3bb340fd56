"""Chunk files and array metadata of local checkpoints, written and read without an array library.

The arrays this backend writes use the ``bytes`` codec alone (little-endian, no compression), so
a chunk file is exactly its shard's values as a contiguous tensor holds them in memory on a
little-endian host. Going through an array library for such a file costs far more than the
I/O: profiled at 585 tensors on 2 ranks (issue 17), zarr-python ran every ``create_array``,
``open_array`` and ``array[...]`` on its one event-loop thread, a few milliseconds of Python each,
so a rank's threads queued behind it and a save or load took 5-10x the safetensors backend's
time; TensorStore's per-array opens and its second pass over every chunk for the checksums cost
it as much. Both engines therefore do the plain case here, on storages with ``local_paths``:

* saves: each array's ``zarr.json`` (`array_metadata()`, the
  document zarr-python writes for these arrays) and each shard's chunk file are written with one
  ``open(O_CREAT | O_EXCL)`` and ``write`` from the tensor's memory (no copy), several files at a
  time; a file that exists already fails the save (a chunk is written once); the digest of each
  file comes from the bytes written;
* loads: a request for exactly one whole chunk of such an array (``ReadOp.chunk``; the dtype
  the request asks for, a contiguous CPU destination) is read with ``readinto`` straight into the
  destination and checked against the checksum manifest from those bytes (one read, no staging).

The result is the same zarr v3 checkpoint, readable by zarr-python, TensorStore and any zarr v3
reader; object stores, partial chunks, fragments of flattened tensors, dtype conversions and
arrays of other codecs still go through the engine's library.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from dist_ckpt.backends.zarr.layout import chunk_key
from dist_ckpt.engine.distributed import get_rank
from dist_ckpt.errors import CorruptCheckpointError
from dist_ckpt.integrity.checksums import FileDigest, bytes_digest, check_file
from dist_ckpt.model.dtypes import tensor_to_numpy
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.storage.object_path import ObjectPath

__all__ = [
    "can_read_directly",
    "direct_writes",
    "read_chunk_into",
    "write_array_json",
    "write_chunk_file",
    "written_files",
]

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_OPEN = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def direct_writes(root: ObjectPath) -> bool:
    """Whether a save into ``root`` writes plain chunks and metadata here: a local storage on a
    little-endian host (elsewhere the engine's library writes them)."""
    return bool(root.storage.local_paths) and sys.byteorder == "little"


def _write_new(path: str, data: memoryview) -> None:
    """Create ``path`` (it must not exist: a chunk is written once) and write all of ``data``."""
    fd = os.open(path, _CREATE, 0o666)
    try:
        view = data
        while view.nbytes:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def write_array_json(array_dir: ObjectPath, metadata: Dict[str, Any]) -> Tuple[ObjectPath, FileDigest]:
    """Create the array node ``array_dir`` with the zarr v3 ``metadata`` as its ``zarr.json``;
    returns the file and its digest. An existing node fails (``FileExistsError``), as zarr's
    ``create_array(overwrite=False)`` does."""
    directory = array_dir.local_path()
    os.makedirs(directory, exist_ok=True)
    raw = json.dumps(metadata, indent=2).encode("utf-8")
    _write_new(os.path.join(directory, "zarr.json"), memoryview(raw))
    return array_dir / "zarr.json", bytes_digest(raw)


def write_chunk_file(array_dir: ObjectPath, sh: ShardedTensor, data: np.ndarray) -> Tuple[ObjectPath, FileDigest]:
    """Write shard ``sh`` (``data``: its values, contiguous, as stored) as its chunk file of the
    array at ``array_dir``; returns the file and its digest (from the bytes written)."""
    name = chunk_key(sh.local_chunk_offset_in_global())
    node = array_dir / name
    directory = array_dir.local_path()
    target = os.path.join(directory, *name.split("/"))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    _write_new(target, raw)
    return node, bytes_digest(raw)


def can_read_directly(
    array_dir: ObjectPath, dest: torch.Tensor, chunk: Optional[Sequence[int]], stored: torch.dtype
) -> bool:
    """Whether a whole-chunk read (``chunk`` not None) of the array at ``array_dir`` goes
    straight into ``dest``: a local file on a little-endian host (`plain_chunk_bytes()` checked
    the byte order), a contiguous CPU destination of the stored dtype."""
    return (
        chunk is not None
        and bool(array_dir.storage.local_paths)
        and dest.device.type == "cpu"
        and dest.dtype == stored
        and dest.is_contiguous()
    )


def read_chunk_into(
    array_dir: ObjectPath, chunk: Sequence[int], dest: torch.Tensor, key: str, expected: Optional[FileDigest]
) -> None:
    """Read chunk ``chunk`` of the array at ``array_dir`` into ``dest`` (which
    `can_read_directly()` accepted), checking its size and, with ``expected`` (its manifest
    entry), its checksum from the bytes read.

    Raises:
        CorruptCheckpointError: the file is missing, of another size, or shorter than it said.
        ChecksumMismatchError: other bytes than the manifest's.
    """
    node = array_dir / chunk_key(chunk)
    want = dest.numel() * dest.element_size()
    try:
        fd = os.open(node.local_path(), _OPEN)  # through the storage: a link out of the checkpoint is refused
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"[rank {get_rank()}] chunk file {str(node)!r} of tensor {key!r} is missing; the checkpoint is incomplete"
        ) from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        size = os.fstat(fd).st_size
        if size != want:
            raise CorruptCheckpointError(
                f"[rank {get_rank()}] chunk file {str(node)!r} of tensor {key!r} has {size} bytes, expected {want}: "
                "it is truncated or damaged"
            )
        raw = tensor_to_numpy(dest).reshape(-1).view(np.uint8).data
        done = 0
        while done < want:
            n = f.readinto(raw[done:])
            if not n:
                raise CorruptCheckpointError(
                    f"[rank {get_rank()}] chunk file {str(node)!r} of tensor {key!r} ended after {done} of its "
                    f"{want} bytes while it was read: it is being truncated"
                )
            done += n
    if expected is not None:
        check_file(node, expected, f"[rank {get_rank()}] tensor {key!r}", data=raw)


def written_files(
    results: List[Tuple[ObjectPath, FileDigest]], digests: Dict[ObjectPath, FileDigest]
) -> List[ObjectPath]:
    """The files of ``results`` (``(file, digest)`` pairs), their digests recorded in ``digests``."""
    for node, digest in results:
        digests[node] = digest
    return [node for node, _ in results]
