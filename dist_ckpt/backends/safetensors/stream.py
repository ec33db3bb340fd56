"""Streaming saves of the ``safetensors`` backend: whole tensors, one at a time, one process.

What ``dist-ckpt convert --to safetensors`` writes with: the same checkpoint a one-rank
`save()` of whole tensors produces -- one file,
``safetensors/rank00000_0.safetensors``, each tensor one shard covering all of it, and
``safetensors/index.json`` (index version 3, with the crc32c of every block unless the strategy's
options record no checksums) -- but written tensor by tensor:

1. at [`begin_stream()`][dist_ckpt.backends.base.SaveShardedStrategy.begin_stream], the file's header is
   planned from the layout (dtypes and shapes: no data needed);
2. each `SafetensorsStreamWriter.add()` writes one tensor at its planned offset, computing
   its block checksums as the bytes pass, and keeps only the checksums;
3. `SafetensorsStreamWriter.finish()` fsyncs the file and writes the index, atomically.

On an object store the tensors are grouped, in order, into objects of about
`STREAM_OBJECT_BYTES` (``safetensors/rank00000_<i>.safetensors``; a larger tensor gets an
object of its own): each object is one streaming (multipart) upload that the tensors are
appended to as they are added, so memory still holds one tensor at a time and a model of many
small tensors does not become as many small objects. The index describes several files, as after
a save by several writer threads. An upload that is not finished is aborted (`abort()`), and
an unfinished object is never visible.

Local files are written by path (the storage's ``local_paths`` capability: one file, written
in place at planned offsets with early writeback); elsewhere objects are uploaded.

Example:

```python
strategy = SafetensorsSaveShardedStrategy()
writer = strategy.begin_stream(LocalStorage("out"), [("w", torch.float32, (4, 4))])   # or an S3Storage
writer.add("w", torch.zeros(4, 4))
writer.finish()          # then commit metadata.json
```
"""

from __future__ import annotations

import logging
import math
from typing import Any, List, Optional, Sequence, Tuple

import torch

from dist_ckpt.backends.base import TensorLayout, TensorStreamWriter, check_stream_entry
from dist_ckpt.backends.safetensors.index import SAFETENSORS_DIR, file_name, shard_name
from dist_ckpt.backends.safetensors.index_parts import IndexPart
from dist_ckpt.backends.safetensors.index_write import write_index
from dist_ckpt.backends.safetensors.write import (
    FILE_METADATA,
    PartResult,
    WritePart,
    plan_file,
    publish,
    stream_tensor,
    write_part,
)
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.integrity.checksums import crc32c, crc_to_hex
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.storage import ObjectWriter, Storage

__all__ = ["STREAM_OBJECT_BYTES", "SafetensorsStreamWriter"]

#: target size of the objects a stream writes to an object store
STREAM_OBJECT_BYTES = 256 << 20

logger = logging.getLogger(__name__)


class SafetensorsStreamWriter(TensorStreamWriter):
    """Writes whole tensors into one safetensors file of a new checkpoint, then its index.

    Args:
        checkpoint_dir: the checkpoint's storage: a local directory (its ``safetensors/`` must not
            exist yet), or an object store (tensors grouped into objects, see the module docstring).
        layout: every tensor to be added, in order.
        checksum_block_bytes: record a crc32c per block of this many bytes (None: none), as
            ``SafetensorsSaveOptions.checksum_block_bytes``.
        early_writeback: start writing local files to the disk while writing (see
            `SequentialWriter`).
    """

    def __init__(
        self,
        checkpoint_dir: Storage,
        layout: Sequence[TensorLayout],
        checksum_block_bytes: Optional[int],
        early_writeback: bool = True,
    ) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.layout = list(layout)
        self.block_bytes = checksum_block_bytes
        self.early_writeback = early_writeback
        # metadata-only shards (meta device): the index is built from them, without any data
        self.shards = [
            ShardedTensor.from_rank_offsets(k, torch.empty(tuple(s), dtype=d, device="meta")) for k, d, s in self.layout
        ]
        self.written = [sh for sh in self.shards if math.prod(sh.global_shape) > 0]  # empty ones have no bytes
        entries = [(shard_name(sh), sh.dtype, tuple(sh.global_shape)) for sh in self.written]
        self.storage: Optional[Storage] = None
        if checkpoint_dir.local_paths:  # one file, written in place
            if checkpoint_dir.dir_exists(SAFETENSORS_DIR):
                raise FileExistsError(f"{checkpoint_dir.url_of(SAFETENSORS_DIR)} exists already")
            checkpoint_dir.make_dir(SAFETENSORS_DIR)
            self.root = checkpoint_dir.local_path(SAFETENSORS_DIR)
            self.files = [(plan_file(file_name(0, 0), entries, FILE_METADATA), self.written)] if self.written else []
        else:  # objects of about STREAM_OBJECT_BYTES, each one streaming upload
            self.storage = checkpoint_dir.child(SAFETENSORS_DIR)
            groups = _group_by_size(list(zip(entries, self.written)), STREAM_OBJECT_BYTES)
            self.files = [
                (plan_file(file_name(0, i), [e for e, _ in group], FILE_METADATA), [sh for _, sh in group])
                for i, group in enumerate(groups)
            ]
        # where each written tensor goes: (file, position in it)
        self._places = [(f, j) for f, (_, shards) in enumerate(self.files) for j in range(len(shards))]
        self._upload: Optional[ObjectWriter] = None
        self.results: List[PartResult] = []
        self._added = 0
        self._finished = False

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Write the whole tensor ``key`` at its planned place (see the module docstring)."""
        check_stream_entry(self.layout, self._added, key, tensor)
        if self._finished:
            raise CheckpointingException(f"tensor {key!r} added to a finished stream of {self.checkpoint_dir.url}")
        self._added += 1
        if tensor.numel() == 0:
            return
        index = len(self.results)
        block = self.block_bytes
        if self.storage is not None:
            self._append_to_object(index, tensor.detach(), block)
            return
        plan = self.files[0][0]
        part = WritePart(plan, index, (tensor.detach(),), fsync=index == len(self.written) - 1)
        self.results.append(write_part(self.root, part, block_bytes=block, early_writeback=self.early_writeback))

    def _append_to_object(self, index: int, tensor: torch.Tensor, block: Optional[int]) -> None:
        """Stream tensor ``index`` into its object: open the upload at the object's first tensor
        (header first), complete it after its last."""
        assert self.storage is not None
        f, j = self._places[index]
        plan, shards = self.files[f]
        if j == 0:
            self._upload = self.storage.open_writer(plan.name)
            self._upload.write(plan.prefix)
        assert self._upload is not None
        try:
            crcs = stream_tensor(self._upload, tensor, block, staging=None)
            if j == len(shards) - 1:
                upload, self._upload = self._upload, None
                upload.commit()
        except BaseException:
            self.abort()
            raise
        header_crc = crc_to_hex(crc32c(plan.prefix)) if block and j == 0 else None
        self.results.append(PartResult(plan.name, j, (crcs,), header_crc))

    def abort(self) -> None:
        """Abort the object upload in progress, if any (the caller removes finished objects)."""
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.abort()

    def finish(self) -> None:
        """fsync the directory and write ``safetensors/index.json`` (rank 0's, the only one)."""
        if self._added != len(self.layout):
            missing = [k for k, _, _ in self.layout[self._added :]]
            raise CheckpointingException(
                f"the stream into {self.checkpoint_dir.url} finished after {self._added} of its "
                f"{len(self.layout)} "
                f"tensors; not added: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )
        self._finished = True
        assert self._upload is None, "every object's upload completes with its last tensor"
        if self.storage is None:
            publish(self.root, [plan.name for plan, _ in self.files])  # written under temporary names
        block = self.block_bytes
        local = IndexPart(0, self.shards, self.files).encode(self.results, block is not None)
        write_index([local], self.checkpoint_dir, block)
        logger.debug(
            "streamed %d tensors, %d bytes into %s",
            len(self.layout),
            sum(plan.size for plan, _ in self.files),
            self.checkpoint_dir.url,
        )


def _group_by_size(items: List[Tuple[Any, ShardedTensor]], target: int) -> List[List[Tuple[Any, ShardedTensor]]]:
    """Consecutive runs of ``items`` of at most ``target`` bytes each (a larger one alone)."""
    groups: List[List[Tuple[Any, ShardedTensor]]] = []
    size = 0
    for item in items:
        nbytes = math.prod(item[1].global_shape) * item[1].dtype.itemsize
        if not groups or size + nbytes > target:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    return groups
