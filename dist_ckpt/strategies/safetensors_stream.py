"""Streaming saves of the ``safetensors`` backend: whole tensors, one at a time, one process.

What ``dist-ckpt convert --to safetensors`` writes with: the same checkpoint a one-rank
:meth:`~.safetensors.SafetensorsSaveShardedStrategy.save` of whole tensors produces -- one file,
``safetensors/rank00000_0.safetensors``, each tensor one shard covering all of it, and
``safetensors/index.json`` with the crc32c of every block (index version 2, or version 1 when the
strategy's options record no checksums) -- but written tensor by tensor:

1. at :meth:`~dist_ckpt.strategies.base.SaveShardedStrategy.begin_stream`, the file's header is
   planned from the layout (dtypes and shapes: no data needed);
2. each :meth:`SafetensorsStreamWriter.add` writes one tensor at its planned offset, computing
   its block checksums as the bytes pass, and keeps only the checksums;
3. :meth:`SafetensorsStreamWriter.finish` fsyncs the file and writes the index, atomically.

On an object store an object is uploaded whole, so each tensor becomes an object of its own
(``safetensors/rank00000_<i>.safetensors``, uploaded from the tensor's memory as it is added):
the index describes several files, as after a save by several writer threads, and memory still
holds one tensor at a time.

Example::

    strategy = SafetensorsSaveShardedStrategy()
    writer = strategy.begin_stream(Path("out"), [("w", torch.float32, (4, 4))])   # or an S3Storage
    writer.add("w", torch.zeros(4, 4))
    writer.finish()          # then commit metadata.json
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

from ..errors import CheckpointingException
from ..mapping import ShardedTensor
from ..storage import Storage, fsync_dir
from ..storage.location import CheckpointLocation, location_str
from .base import TensorLayout, TensorStreamWriter, check_stream_entry
from .safetensors_index import SAFETENSORS_DIR, file_name, shard_name
from .safetensors_write import PartResult, WritePart, plan_file, write_object, write_part

if TYPE_CHECKING:
    from .safetensors import SafetensorsSaveOptions

__all__ = ["SafetensorsStreamWriter"]

logger = logging.getLogger(__name__)


class SafetensorsStreamWriter(TensorStreamWriter):
    """Writes whole tensors into one safetensors file of a new checkpoint, then its index.

    Args:
        checkpoint_dir: the checkpoint directory (its ``safetensors/`` must not exist yet), or an
            object-store storage (one object per tensor, see the module docstring).
        layout: every tensor to be added, in order.
        options: the save strategy's options (checksum block size, early writeback).
    """

    def __init__(self, checkpoint_dir: CheckpointLocation, layout: Sequence[TensorLayout], options: "SafetensorsSaveOptions") -> None:
        from .safetensors import _FILE_METADATA  # the backend's own file metadata

        self.checkpoint_dir = checkpoint_dir
        self.layout = list(layout)
        self.options = options
        # metadata-only shards (meta device): the index is built from them, without any data
        self.shards = [ShardedTensor.from_rank_offsets(k, torch.empty(tuple(s), dtype=d, device="meta")) for k, d, s in self.layout]
        self.written = [sh for sh in self.shards if math.prod(sh.global_shape) > 0]  # empty ones have no bytes
        entries = [(shard_name(sh), sh.dtype, tuple(sh.global_shape)) for sh in self.written]
        self.storage: Optional[Storage] = None
        if isinstance(checkpoint_dir, Path):
            self.root = checkpoint_dir / SAFETENSORS_DIR
            self.files = [(plan_file(file_name(0, 0), entries, _FILE_METADATA), self.written)] if self.written else []
            self.root.mkdir(parents=True, exist_ok=False)
        else:
            self.storage = checkpoint_dir.child(SAFETENSORS_DIR)
            self.files = [(plan_file(file_name(0, i), [e], _FILE_METADATA), [sh]) for i, (e, sh) in enumerate(zip(entries, self.written))]
        self.results: List[PartResult] = []
        self._added = 0
        self._finished = False

    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Write the whole tensor ``key`` at its planned place (see the module docstring)."""
        check_stream_entry(self.layout, self._added, key, tensor)
        if self._finished:
            raise CheckpointingException(f"tensor {key!r} added to a finished stream of {location_str(self.checkpoint_dir)}")
        self._added += 1
        if tensor.numel() == 0:
            return
        index = len(self.results)
        block = self.options.checksum_block_bytes
        if self.storage is not None:  # one object per tensor
            part = WritePart(self.files[index][0], 0, (tensor.detach().cpu(),))
            self.results.append(write_object(self.storage, part, block_bytes=block))
            return
        plan = self.files[0][0]
        part = WritePart(plan, index, (tensor.detach(),), fsync=index == len(self.written) - 1)
        self.results.append(write_part(self.root, part, block_bytes=block, early_writeback=self.options.early_writeback))

    def finish(self) -> None:
        """fsync the directory and write ``safetensors/index.json`` (rank 0's, the only one)."""
        from .safetensors import _IndexPart, _write_index  # the index the backend's own save writes

        if self._added != len(self.layout):
            missing = [k for k, _, _ in self.layout[self._added :]]
            raise CheckpointingException(
                f"the stream into {location_str(self.checkpoint_dir)} finished after {self._added} of its {len(self.layout)} "
                f"tensors; not added: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            )
        self._finished = True
        if self.storage is None:
            fsync_dir(self.root)
        block = self.options.checksum_block_bytes
        local = _IndexPart(self.shards, self.files).with_checksums(self.results, block is not None)
        _write_index([local], self.checkpoint_dir, block)
        logger.debug("streamed %d tensors, %d bytes into %s", len(self.layout),
                     sum(plan.size for plan, _ in self.files), location_str(self.checkpoint_dir))
