"""The ``safetensors`` sharded backend (version 1): a few large safetensors files per rank.

Each rank writes its main-replica shards into a constant number of files -- one per writer
thread -- each a valid safetensors file that ``safetensors.safe_open`` reads. Rank 0 then writes
``safetensors/index.json``, which says which file and byte range holds which shard of which key
(see :mod:`.safetensors_index`); ``dist_ckpt.save`` commits ``metadata.json`` after it.

Why it is fast:

* a save writes each main-replica byte once, from the tensor's own memory (no serialized copy),
  in large sequential writes spread over ``thread_count`` files written in parallel, with one
  fsync per file;
* a load reads only the byte ranges that overlap the requested shards, with positional reads
  straight into the destination tensors (see :mod:`.safetensors_io`);
* the metadata exchanged is one small JSON document per rank, gathered once to rank 0.

Example::

    import dist_ckpt as dc
    from dist_ckpt.strategies.safetensors import SafetensorsSaveOptions, SafetensorsSaveShardedStrategy
    dc.save(sd, "ckpt/iter_10", sharded_strategy=("safetensors", 1))
    dc.save(sd, "ckpt/iter_20", sharded_strategy=SafetensorsSaveShardedStrategy(SafetensorsSaveOptions(thread_count=4)))
"""

from __future__ import annotations

import json
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch

from ..dict_utils import nested_values
from ..distributed import gather_json, get_rank, run_collectively
from ..dtypes import dtype_to_name
from ..errors import CheckpointingException, InvalidShardedTensorError
from ..mapping import ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from ..storage import fsync_dir, write_bytes_atomic
from .base import LoadShardedStrategy, SaveShardedStrategy
from .safetensors_format import StagingBuffer, write_safetensors_file
from .safetensors_index import (
    INDEX_FILENAME,
    SAFETENSORS_DIR,
    encode_shard,
    file_name,
    merge_rank_indexes,
    rank_index,
    read_index,
    shard_name,
    tensor_entry,
)
from .safetensors_io import ReadOptions
from .safetensors_load import load_from_index, tensors_metadata

__all__ = [
    "SafetensorsLoadOptions",
    "SafetensorsLoadShardedStrategy",
    "SafetensorsSaveOptions",
    "SafetensorsSaveShardedStrategy",
]

logger = logging.getLogger(__name__)

#: options of :class:`SafetensorsLoadShardedStrategy` (threads and buffer sizes of the reads)
SafetensorsLoadOptions = ReadOptions


@dataclass(frozen=True)
class SafetensorsSaveOptions:
    """How :class:`SafetensorsSaveShardedStrategy` writes.

    Attributes:
        thread_count: writer threads per rank; each writes one file, so this is also the number
            of files per rank (fewer if the rank has fewer shards).
        staging_buffer_bytes: size of each writer's pinned host buffer for GPU tensors.
        early_writeback: have the kernel write dirty pages to the disk while later ones are
            still being written, and drop them from the page cache once clean (see
            :class:`~.safetensors_format.SequentialWriter`); off, the save only fsyncs at the end.
    """

    thread_count: int = 2
    staging_buffer_bytes: int = 64 * 2**20
    early_writeback: bool = True

    def __post_init__(self) -> None:
        for name in ("thread_count", "staging_buffer_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointingException(f"SafetensorsSaveOptions.{name} must be a positive int, got {value!r}")


def _nbytes(sh: ShardedTensor) -> int:
    assert sh.data is not None
    return sh.data.numel() * sh.data.element_size()


def assign_writers(shards: List[ShardedTensor], writers: int) -> List[List[ShardedTensor]]:
    """Split ``shards`` over at most ``writers`` files with balanced byte counts.

    Largest first, each to the lightest file; every file keeps the shards' original order, so
    the assignment is deterministic. Empty files are dropped.
    """
    bins: List[List[Tuple[int, ShardedTensor]]] = [[] for _ in range(max(1, min(writers, len(shards))))]
    loads = [0] * len(bins)
    for position, sh in sorted(enumerate(shards), key=lambda p: -_nbytes(p[1])):
        lightest = loads.index(min(loads))
        bins[lightest].append((position, sh))
        loads[lightest] += _nbytes(sh)
    return [[sh for _, sh in sorted(b, key=lambda p: p[0])] for b in bins if b]


class SafetensorsSaveShardedStrategy(SaveShardedStrategy):
    """Writes each rank's main-replica shards into ``thread_count`` safetensors files.

    Collective steps, each ending with an error exchange so a failure on one rank raises on all:

    1. every rank writes and fsyncs its files (in parallel threads);
    2. the ranks' index parts are gathered to rank 0 (one small JSON document each);
    3. rank 0 writes ``safetensors/index.json`` atomically and durably.

    Args:
        options: threads and buffer sizes.
        backend: format name recorded in ``metadata.json``.
        version: format version.

    Example::

        strategy = SafetensorsSaveShardedStrategy(SafetensorsSaveOptions(thread_count=4))
        dc.save(sharded_state_dict, "ckpt/iter_10", sharded_strategy=strategy)
    """

    owned_paths: ClassVar[Tuple[str, ...]] = (SAFETENSORS_DIR,)

    def __init__(
        self, options: Optional[SafetensorsSaveOptions] = None, backend: str = "safetensors", version: int = 1
    ) -> None:
        super().__init__(backend, version)
        self.options = options or SafetensorsSaveOptions()
        # one pinned buffer per writer thread, allocated at the first GPU tensor and kept for
        # later saves with this strategy (pinning memory is slow)
        self._staging = [StagingBuffer(self.options.staging_buffer_bytes) for _ in range(self.options.thread_count)]

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        checkpoint_dir = Path(checkpoint_dir)
        root = checkpoint_dir / SAFETENSORS_DIR
        shards = [
            s for s in nested_values(sharded_state_dict) if isinstance(s, ShardedTensor) and is_main_replica(s.replica_id)
        ]
        # 1. write this rank's files
        local = run_collectively("writing safetensors files", lambda: self._write_files(root, shards))
        # 2. gather the index parts to rank 0
        gathered = gather_json(local)
        # 3. rank 0 commits the index (before dist_ckpt.save writes metadata.json)
        run_collectively("writing the safetensors index", lambda: _write_index(gathered, checkpoint_dir))

    def _write_files(self, root: Path, shards: List[ShardedTensor]) -> Dict[str, Any]:
        rank = get_rank()
        root.mkdir(parents=True, exist_ok=True)
        tensors: Dict[str, Dict[str, Any]] = {}
        for sh in shards:  # keys with no bytes on any rank (0-size tensors) are still listed
            tensors.setdefault(sh.key, tensor_entry(dtype_to_name(sh.dtype), sh.global_shape, []))
        to_write = []
        for sh in shards:
            if sh.data is None:
                raise InvalidShardedTensorError(f"[rank {rank}] main replica of {sh.key!r} has no data to save")
            if sh.data.numel():
                to_write.append(sh)
        files: Dict[str, int] = {}
        groups = assign_writers(to_write, self.options.thread_count) if to_write else []
        jobs = [(root / file_name(rank, i), group, self._staging[i]) for i, group in enumerate(groups)]
        with ThreadPoolExecutor(max(1, len(jobs)), thread_name_prefix="dist_ckpt_write") as pool:
            results = list(pool.map(lambda job: self._write_one(*job), jobs))
        for (path, group, _), (size, ranges) in zip(jobs, results):
            files[path.name] = size
            for sh, byte_range in zip(group, ranges):
                tensors[sh.key]["shards"].append(encode_shard(sh, path.name, byte_range))
        fsync_dir(root)
        return rank_index(files, rank, tensors)

    def _write_one(
        self, path: Path, group: List[ShardedTensor], staging: StagingBuffer
    ) -> Tuple[int, List[Tuple[int, int]]]:
        # a whole shard is stored with the shape of its box (prepended axes included), so the
        # file alone says which part of the global tensor it holds; reshape is a view here
        items = [(shard_name(sh), _stored_view(sh)) for sh in group]
        metadata = {"format": "pt", "dist_ckpt": "safetensors backend v1; see index.json for the layout"}
        size, ranges = write_safetensors_file(
            path, items, metadata, staging=staging, early_writeback=self.options.early_writeback
        )
        logger.debug("wrote %s: %d shards, %d bytes", path, len(group), size)
        return size, ranges


def _stored_view(sh: ShardedTensor) -> torch.Tensor:
    assert sh.data is not None
    return sh.data if sh.flattened_range is not None else sh.data.reshape(sh.full_local_shape)


def _write_index(gathered: Optional[List[Any]], checkpoint_dir: Path) -> None:
    if get_rank() != 0:
        return
    assert gathered is not None
    doc = merge_rank_indexes(gathered)
    root = checkpoint_dir / SAFETENSORS_DIR
    root.mkdir(parents=True, exist_ok=True)  # a save without any tensor bytes still gets an index
    write_bytes_atomic(root / INDEX_FILENAME, json.dumps(doc, separators=(",", ":")).encode("utf-8"))
    fsync_dir(checkpoint_dir)
    logger.debug(
        "safetensors index: %d tensors, %d files, %d bytes of data",
        len(doc["tensors"]),
        len(doc["files"]),
        sum(f["size"] for f in doc["files"].values()),
    )


class SafetensorsLoadShardedStrategy(LoadShardedStrategy):
    """Loads ``safetensors``-backend checkpoints into any sharding.

    Reads only the byte ranges that overlap the requested shards; fills ``ShardedTensor.data``
    in place when it is allocated with the right shape (any device), else returns new CPU
    tensors. Needs no process group (no collective is called).

    Args:
        options: read threads and buffer sizes.

    Example::

        strategy = SafetensorsLoadShardedStrategy(SafetensorsLoadOptions(thread_count=4))
        dc.load(sd, "ckpt/iter_10", sharded_strategy=strategy)
    """

    supported_backends: ClassVar[Tuple[str, ...]] = ("safetensors",)
    supported_versions: ClassVar[Tuple[int, ...]] = (1,)

    def __init__(self, options: Optional[ReadOptions] = None) -> None:
        self.options = options or ReadOptions()

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        return load_from_index(sharded_state_dict, read_index(Path(checkpoint_dir)), self.options)

    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        return tensors_metadata(read_index(Path(checkpoint_dir)))

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        """Delete every tensor whose key starts with ``key_prefix`` (one process calls it).

        The index is rewritten atomically without those keys (each key goes whole or not at
        all), then files that hold no remaining shard are deleted. The bytes of removed shards
        in files that still hold other shards stay until the checkpoint is rewritten.
        """
        root = Path(checkpoint_dir) / SAFETENSORS_DIR
        read_index(Path(checkpoint_dir))  # validates the whole index before changing it
        doc = json.loads((root / INDEX_FILENAME).read_bytes())
        removed = [key for key in doc["tensors"] if key.startswith(key_prefix)]
        for key in removed:
            del doc["tensors"][key]
        used = {shard["file"] for entry in doc["tensors"].values() for shard in entry["shards"]}
        orphans = [name for name in doc["files"] if name not in used]
        for name in orphans:
            del doc["files"][name]
        write_bytes_atomic(root / INDEX_FILENAME, json.dumps(doc, separators=(",", ":")).encode("utf-8"))
        for name in orphans:
            (root / name).unlink(missing_ok=True)
        fsync_dir(root)
        logger.info("removed %d tensors with prefix %r from %s; deleted %d files", len(removed), key_prefix, root, len(orphans))


def stored_bytes(checkpoint_dir: Path) -> int:
    """Bytes of tensor data in a safetensors-backend checkpoint (from its index)."""
    index = read_index(Path(checkpoint_dir))
    return sum(math.prod(s.stored_shape) * t.dtype.itemsize for t in index.tensors.values() for s in t.shards)
