"""Whole chunk files of local checkpoints read without an array library.

The arrays this backend writes use the ``bytes`` codec alone (little-endian, no compression), so
a chunk file is exactly its shard's values as a contiguous tensor holds them in memory on a
little-endian host. Going through an array library for such a file costs far more than the
I/O: profiled at 585 tensors on 2 ranks (issue 17), zarr-python ran every ``open_array`` and
``array[...]`` on its one event-loop thread, a few milliseconds of Python each, so a rank's
threads queued behind it and a load took 5-10x the safetensors backend's time; TensorStore's
per-array opens and its second pass over every chunk for the checksums cost it as much. Both
engines therefore read the plain case here, on storages with ``local_paths``: every read of a
chunked array of such files is planned one chunk at a time (``ReadOp.chunk``: the chunk file's
key, as the array's ``zarr.json`` encodes it), and each chunk file is read with ``readinto`` and
checked against the checksum manifest from the bytes read. A whole chunk wanted in its stored
dtype by a contiguous CPU destination goes straight there (one read, no staging); any other (part
of a chunk, a shard loaded in another layout than saved into a strided view, another dtype, a
device) goes to a buffer of the chunk first, and its part is copied (and converted) into place --
an array library reads the whole file of a chunk of plain bytes as well. A resharded load of
TP-split tensors (every column block of a load at fewer ranks, half a chunk at more) went through
the engines at 2-3x the time of a load in the saved layout before. Object stores, fragments of
flattened tensors and arrays of other codecs still go through the engine's library.

Saves write such files the same way, without an array library: `dist_ckpt.backends.zarr.local_save`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Mapping, Optional

import numpy as np
import torch

from dist_ckpt.backends.zarr.nodes import ByteBudget
from dist_ckpt.backends.zarr.read_plan import ReadOp
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import CorruptCheckpointError
from dist_ckpt.integrity.checksums import FileDigest, check_file
from dist_ckpt.model.dtype_cast import copy_cast
from dist_ckpt.model.dtypes import tensor_to_numpy
from dist_ckpt.model.geometry import sub_view
from dist_ckpt.storage import ObjectNotFoundError, open_regular
from dist_ckpt.storage.meter import count_bytes
from dist_ckpt.storage.object_path import ObjectPath

__all__ = ["read_chunk_into", "read_chunk_part"]


def read_chunk_part(
    op: ReadOp,
    target: torch.Tensor,
    stored: torch.dtype,
    key: str,
    manifest: Optional[Mapping[str, FileDigest]],
    zarr_root: ObjectPath,
    budget: Optional[ByteBudget] = None,
) -> None:
    """Read the chunk file of ``op`` (its ``chunk`` set: a plain chunk of a local file) and put
    its ``inter`` part into ``target`` (the destination's view of ``op.inter``, of any dtype,
    strides and device): straight into ``target`` when ``op`` is the whole chunk and ``target`` a
    contiguous CPU tensor of the ``stored`` dtype, else through a buffer of the whole chunk, held
    in ``budget`` while it lives (concurrent readers' buffers stay within it). With ``manifest``
    (the checkpoint's, keyed by paths under ``zarr_root``), the file's checksum is checked from
    the bytes read.

    Raises:
        CorruptCheckpointError, ChecksumMismatchError: see `read_chunk_into()`.
    """
    assert op.chunk is not None and op.chunk_box is not None
    expected = manifest.get((op.array_path / op.chunk).relative_to(zarr_root)) if manifest is not None else None
    straight = target.device.type == "cpu" and target.dtype == stored and target.is_contiguous()
    if op.whole_chunk and straight:
        read_chunk_into(op.array_path, op.chunk, target, key, expected)
        return
    with budget.hold(op.chunk_box.numel * stored.itemsize) if budget is not None else contextlib.nullcontext():
        held = torch.empty(op.chunk_box.shape, dtype=stored)
        read_chunk_into(op.array_path, op.chunk, held, key, expected)
        copy_cast(target, sub_view(held, op.chunk_box, op.inter))
        del held


def read_chunk_into(
    array_dir: ObjectPath, chunk: str, dest: torch.Tensor, key: str, expected: Optional[FileDigest]
) -> None:
    """Read the chunk ``chunk`` (its key, as the array's ``zarr.json`` encodes it) of the array at
    ``array_dir`` into ``dest`` (a contiguous CPU tensor of the chunk's shape and stored dtype),
    checking its size and, with ``expected`` (its manifest entry), its checksum from the bytes read.

    Raises:
        CorruptCheckpointError: the file is missing, of another size, or shorter than it said.
        ChecksumMismatchError: other bytes than the manifest's.
    """
    node = array_dir / chunk
    want = dest.numel() * dest.element_size()
    try:  # through the storage: a link out of the checkpoint is refused, and a FIFO (it would block)
        fd = open_regular(node.local_path(), str(node))
    except ObjectNotFoundError:
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
            count_bytes(n)  # byte progress of the load (dist_ckpt.storage.meter)
    if expected is not None:
        check_file(node, expected, f"[rank {get_rank()}] tensor {key!r}", data=raw)
