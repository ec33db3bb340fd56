"""Whole chunk files of local checkpoints read without an array library.

The arrays this backend writes use the ``bytes`` codec alone (little-endian, no compression), so
a chunk file is exactly its shard's values as a contiguous tensor holds them in memory on a
little-endian host. Going through an array library for such a file costs far more than the
I/O: profiled at 585 tensors on 2 ranks (issue 17), zarr-python ran every ``open_array`` and
``array[...]`` on its one event-loop thread, a few milliseconds of Python each, so a rank's
threads queued behind it and a load took 5-10x the safetensors backend's time; TensorStore's
per-array opens and its second pass over every chunk for the checksums cost it as much. Both
engines therefore read the plain case here, on storages with ``local_paths``: a request for
exactly one whole chunk of such an array (``ReadOp.chunk``: the chunk file's key, as the array's
``zarr.json`` encodes it; the dtype the request asks for, a contiguous CPU destination) is read
with ``readinto`` straight into the destination and checked against the checksum manifest from
those bytes (one read, no staging). Object stores, partial chunks, fragments of flattened tensors,
dtype conversions and arrays of other codecs still go through the engine's library.

Saves write such files the same way, without an array library: `dist_ckpt.backends.zarr.local_save`.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from dist_ckpt.engine.distributed import get_rank
from dist_ckpt.errors import CorruptCheckpointError
from dist_ckpt.integrity.checksums import FileDigest, check_file
from dist_ckpt.model.dtypes import tensor_to_numpy
from dist_ckpt.storage.object_path import ObjectPath

__all__ = ["can_read_directly", "read_chunk_into"]

_OPEN = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def can_read_directly(array_dir: ObjectPath, dest: torch.Tensor, chunk: Optional[str], stored: torch.dtype) -> bool:
    """Whether a whole-chunk read (``chunk``, its key, not None) of the array at ``array_dir`` goes
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
    array_dir: ObjectPath, chunk: str, dest: torch.Tensor, key: str, expected: Optional[FileDigest]
) -> None:
    """Read the chunk ``chunk`` (its key, as the array's ``zarr.json`` encodes it) of the array at
    ``array_dir`` into ``dest`` (which
    `can_read_directly()` accepted), checking its size and, with ``expected`` (its manifest
    entry), its checksum from the bytes read.

    Raises:
        CorruptCheckpointError: the file is missing, of another size, or shorter than it said.
        ChecksumMismatchError: other bytes than the manifest's.
    """
    node = array_dir / chunk
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
