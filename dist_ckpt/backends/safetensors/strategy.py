"""The ``safetensors`` sharded backend (version 1): a few large safetensors files per rank.

Each rank writes its main-replica shards into a constant number of files -- one per writer
thread -- each a valid safetensors file that ``safetensors.safe_open`` reads. Rank 0 then writes
``safetensors/index.json``, which says which file and byte range holds which shard of which key,
with a crc32c per block of every shard (see `safetensors_index`); ``dist_ckpt.save``
commits ``metadata.json`` after it. Loads verify the blocks they read.

Saves are synchronous (`SafetensorsSaveShardedStrategy.save()`: straight from the tensors'
memory) or asynchronous
([`async_save()`][dist_ckpt.backends.safetensors.strategy.SafetensorsSaveShardedStrategy.async_save]: snapshot into
shared memory, write in a background process, gather the index at finalization; see `async_utils`).

On an object store (``s3://``; ``checkpoint_dir`` is then a [`Storage`][dist_ckpt.storage.base.Storage])
the layout is the same: each writer thread uploads its file as one object (multipart above the
storage's part size, parts in parallel) straight from the tensors' memory, rank 0 writes the
index object, and loads fetch only the byte ranges they need with concurrent ranged GETs into the
destination tensors, verifying the blocks they read. An object cannot be written by two
processes, so an asynchronous save with a host-memory budget snapshots whole files (those
that fit) and uploads the others before returning.

Why it is fast:

* a save writes each main-replica byte once, from the tensor's own memory (no serialized copy),
  in large sequential writes spread over ``thread_count`` files written in parallel, with one
  fsync per file;
* a load reads only the byte ranges that overlap the requested shards, with positional reads
  straight into the destination tensors (see `safetensors_io`);
* the metadata exchanged is one compact binary index part per rank, gathered once to rank 0,
  which merges them with numpy into index version 3: a small ``index.json`` and a binary table
  of shards, so that a load reads only the rows of the tensors it requests.

Example:

```python
import dist_ckpt as dc
from dist_ckpt.backends.safetensors.strategy import SafetensorsSaveOptions, SafetensorsSaveShardedStrategy
dc.save(sd, "ckpt/iter_10", sharded_strategy=("safetensors", 1))
dc.save(sd, "ckpt/iter_20", sharded_strategy=SafetensorsSaveShardedStrategy(SafetensorsSaveOptions(thread_count=4)))
```
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch

from dist_ckpt.asynchronous.queue import AsyncOutcome, AsyncRequest
from dist_ckpt.asynchronous.snapshot import PROCESS_SNAPSHOTS, file_order_layout, snapshot_layout
from dist_ckpt.backends.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    TensorLayout,
    TensorStreamWriter,
    main_replica_shards,
)
from dist_ckpt.backends.safetensors.early_writes import EarlyRegion, EarlyWriter
from dist_ckpt.backends.safetensors.format import DATA_ALIGN, StagingBuffer
from dist_ckpt.backends.safetensors.index import (
    INDEX_FILENAME,
    INDEX_VERSION,
    SAFETENSORS_DIR,
    file_name,
    read_index,
    shard_name,
)
from dist_ckpt.backends.safetensors.index_parts import IndexPart
from dist_ckpt.backends.safetensors.index_write import remove_from_v3, write_index
from dist_ckpt.backends.safetensors.io import ReadOptions
from dist_ckpt.backends.safetensors.load import load_from_index
from dist_ckpt.backends.safetensors.stream import SafetensorsStreamWriter
from dist_ckpt.backends.safetensors.tensor_index import describe_tensor_index, tensors_metadata
from dist_ckpt.backends.safetensors.verify import verify_safetensors
from dist_ckpt.backends.safetensors.write import (
    FILE_METADATA,
    PartResult,
    PlannedFiles,
    SnapshotPart,
    WritePart,
    create_with_header,
    partial_name,
    plan_file,
    publish,
    write_objects,
    write_parts,
    write_snapshot_objects,
    write_snapshot_parts,
)
from dist_ckpt.backends.stored_shards import StoredShardInfo
from dist_ckpt.collectives.distributed import gather_bytes, get_rank, run_collectively
from dist_ckpt.errors import CheckpointingException, InvalidShardedTensorError
from dist_ckpt.integrity.checksums import DEFAULT_BLOCK_BYTES, IntegrityReport
from dist_ckpt.integrity.safe_json import loads, want_object
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor, StateDict
from dist_ckpt.record.records import refresh_record
from dist_ckpt.storage import Storage
from dist_ckpt.storage.direct_io import accepts_direct_writes
from dist_ckpt.storage.host_memory import (
    DEFAULT_STAGING_BYTES,
    MIN_PIECE_BYTES,
    get_host_memory_budget,
    note_async_split,
)
from dist_ckpt.storage.location import LocationLike, resolve_location

__all__ = [
    "SafetensorsLoadOptions",
    "deferred_starts",
    "SafetensorsLoadShardedStrategy",
    "SafetensorsSaveOptions",
    "SafetensorsSaveShardedStrategy",
]

logger = logging.getLogger(__name__)

#: options of :class:`SafetensorsLoadShardedStrategy` (threads and buffer sizes of the reads)
SafetensorsLoadOptions = ReadOptions


@dataclass(frozen=True)
class SafetensorsSaveOptions:
    """How [`SafetensorsSaveShardedStrategy`][dist_ckpt.backends.safetensors.strategy.SafetensorsSaveShardedStrategy]
    writes.

    Attributes:
        thread_count: writer threads per rank; each writes one file, so this is also the number
            of files per rank (fewer if the rank has fewer shards).
        staging_buffer_bytes: size of each writer's pinned host buffer for GPU tensors.
        early_writeback: have the kernel write dirty pages to the disk while later ones are
            still being written, and drop them from the page cache once clean (see
            `SequentialWriter`); off, the save only fsyncs at the end.
        checksum_block_bytes: record a crc32c per block of this many bytes of every shard
            (recorded in the index); None records none.
        host_memory_budget_bytes: most extra host memory a save holds at once (the snapshot of
            an asynchronous save and the staging buffers of GPU tensors together; see
            `dist_ckpt.storage.host_memory`). When a rank's shards are larger, an asynchronous
            save streams: the shards that do not fit are written before
            [`async_save()`][dist_ckpt.backends.safetensors.strategy.SafetensorsSaveShardedStrategy.async_save]
            returns, straight from the tensors' memory (so the call blocks longer), and only the rest is written in the
            background. On an object store the choice is by whole files (an object is written
            by one process). None: the budget of the call or the process
            (`get_host_memory_budget()`), else no bound (everything is snapshotted).
        snapshot_budget_bytes: the former name of ``host_memory_budget_bytes`` (an alias: set
            one of the two, or both to the same value).
    """

    thread_count: int = 2
    staging_buffer_bytes: int = DEFAULT_STAGING_BYTES
    early_writeback: bool = True
    checksum_block_bytes: Optional[int] = DEFAULT_BLOCK_BYTES
    snapshot_budget_bytes: Optional[int] = None
    host_memory_budget_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        budgets = ("snapshot_budget_bytes", "host_memory_budget_bytes")
        for name in ("thread_count", "staging_buffer_bytes", "checksum_block_bytes", *budgets):
            value = getattr(self, name)
            if value is None and name in ("checksum_block_bytes", *budgets):
                continue
            smallest = 0 if name in budgets else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < smallest:
                raise CheckpointingException(
                    f"SafetensorsSaveOptions.{name} must be an int >= {smallest}, got {value!r}"
                )
        old, new = self.snapshot_budget_bytes, self.host_memory_budget_bytes
        if old is not None and new is not None and old != new:
            raise CheckpointingException(
                f"SafetensorsSaveOptions: snapshot_budget_bytes={old} and host_memory_budget_bytes={new} name one "
                f"budget (the first is the old name of the second); set one of them"
            )
        budget = new if new is not None else old
        object.__setattr__(self, "snapshot_budget_bytes", budget)  # both names read the same value
        object.__setattr__(self, "host_memory_budget_bytes", budget)

    def budget(self) -> Optional[int]:
        """The budget in force for a save with these options: their own, else the call's or the
        process's (`get_host_memory_budget()`), else None."""
        return self.host_memory_budget_bytes if self.host_memory_budget_bytes is not None else get_host_memory_budget()


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


def deferred_starts(sizes: Sequence[Sequence[int]], budget: Optional[int]) -> List[int]:
    """For each file (the byte sizes of its tensors, in file order), the index of the first
    tensor an asynchronous save snapshots; the tensors before it are written right away.

    The snapshot holds a suffix of each file, as many bytes as ``budget`` allows (all of every
    file without a budget): files take turns adding their last not-yet-chosen tensor while it
    fits.

    Example:

    ```python
    deferred_starts([[8, 4], [6, 2]], budget=7)   # [1, 1]: the 4 and the 2 are snapshotted
    deferred_starts([[8, 4], [6, 2]], budget=None) # [0, 0]
    ```
    """
    if budget is None:
        return [0] * len(sizes)
    starts = [len(s) for s in sizes]
    used = 0
    grew = True
    while grew:
        grew = False
        for f, file_sizes in enumerate(sizes):
            k = starts[f]
            if k > 0 and used + file_sizes[k - 1] <= budget:
                starts[f] = k - 1
                used += file_sizes[k - 1]
                grew = True
    return starts


def whole_file_starts(sizes: Sequence[Sequence[int]], budget: Optional[int]) -> List[int]:
    """[`deferred_starts()`][dist_ckpt.backends.safetensors.strategy.deferred_starts] for object stores, where a file is
    uploaded by one process: each file is snapshotted whole (0) or written before the call returns (its length). Smaller
    files are taken first while they fit the budget.

    Example:

    ```python
    whole_file_starts([[8, 4], [6, 2]], budget=9)    # [2, 0]: the second file (8 bytes) fits
    ```
    """
    if budget is None:
        return [0] * len(sizes)
    starts = [len(s) for s in sizes]
    used = 0
    for f in sorted(range(len(sizes)), key=lambda f: sum(sizes[f])):
        if used + sum(sizes[f]) <= budget:
            starts[f] = 0
            used += sum(sizes[f])
    return starts


class SafetensorsSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Writes each rank's main-replica shards into ``thread_count`` safetensors files.

    Synchronous `save()`, collective steps, each ending with an error exchange so that a
    failure on one rank raises on all:

    1. every rank writes and fsyncs its files (in parallel threads), computing the checksums
       as the bytes pass (on an object store: uploads each file as one object);
    2. the ranks' index parts are gathered to rank 0 (compact bytes, see `index_parts`);
    3. rank 0 writes the shard table and ``safetensors/index.json`` atomically and durably.

    Asynchronous [`async_save()`][.async_save] (not collective) snapshots the shards and returns an
    `AsyncRequest` whose background function writes the files (step 1) in
    another process and whose finalization runs steps 2 and 3.

    Args:
        options: threads, buffer sizes, checksums, snapshot budget.
        backend: format name recorded in ``metadata.json``.
        version: format version.

    Example:

    ```python
    strategy = SafetensorsSaveShardedStrategy(SafetensorsSaveOptions(thread_count=4))
    dc.save(sharded_state_dict, "ckpt/iter_10", sharded_strategy=strategy)
    request = dc.save(sd, "ckpt/iter_20", sharded_strategy=strategy, async_sharded_save=True)
    ```

    Reuse one strategy object for every save where you can: it keeps its pinned staging buffers,
    which are slow to allocate. The shared-memory snapshot buffer is kept for the process (see
    `dist_ckpt.asynchronous.snapshot.PROCESS_SNAPSHOTS`), so a new strategy object does not fault in
    a fresh one.
    """

    owned_paths: ClassVar[Tuple[str, ...]] = (SAFETENSORS_DIR,)
    object_storage: ClassVar[bool] = True
    can_stream: ClassVar[bool] = True
    integrity_records: ClassVar[Tuple[str, ...]] = (f"{SAFETENSORS_DIR}/{INDEX_FILENAME}",)

    def __init__(
        self, options: Optional[SafetensorsSaveOptions] = None, backend: str = "safetensors", version: int = 1
    ) -> None:
        super().__init__(backend, version)
        self.options = options or SafetensorsSaveOptions()
        # one pinned buffer per writer thread, allocated at the first GPU tensor and kept for
        # later saves with this strategy (pinning memory is slow)
        self._kept_staging = [
            StagingBuffer(self.options.staging_buffer_bytes) for _ in range(self.options.thread_count)
        ]
        self._snapshots = PROCESS_SNAPSHOTS  # shared: a new strategy object reuses the last buffer

    def _staging(self, budget: Optional[int] = None) -> List[StagingBuffer]:
        """One staging buffer per writer thread, for the GPU (and strided) tensors of a save:
        the kept ones, or, where the budget leaves each thread less, smaller ones for this save."""
        budget = self.options.budget() if budget is None else budget
        threads = self.options.thread_count
        size = self.options.staging_buffer_bytes
        if budget is not None:
            size = max(MIN_PIECE_BYTES, min(size, budget // threads))
        if size == self.options.staging_buffer_bytes:
            return self._kept_staging
        return [StagingBuffer(size) for _ in range(threads)]

    # ----------------------------------------------------------------------- synchronous

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> None:
        shards = main_replica_shards(sharded_state_dict)
        # 1. write this rank's files, straight from the tensors' memory
        local = run_collectively("writing safetensors files", lambda: self._write_files(checkpoint_dir, shards))
        # 2. and 3. gather the index parts, rank 0 commits the index
        self._commit_index(local, checkpoint_dir)

    def _write_files(self, checkpoint_dir: Storage, shards: List[ShardedTensor]) -> bytes:
        files = self._plan(shards, smallest_last=False)
        parts = [WritePart(plan, 0, tuple(_stored_view(sh) for sh in group)) for plan, group in files]
        storage = resolve_location(checkpoint_dir)
        if not storage.local_paths:  # objects, each uploaded whole from the tensors' memory
            uploaded = write_objects(
                storage.child(SAFETENSORS_DIR),
                parts,
                block_bytes=self.options.checksum_block_bytes,
                staging=self._staging(),
            )
            return self._rank_index(shards, files, uploaded)
        storage.make_dir(SAFETENSORS_DIR)
        root = storage.local_path(SAFETENSORS_DIR)
        results = write_parts(
            root,
            parts,
            block_bytes=self.options.checksum_block_bytes,
            early_writeback=self.options.early_writeback,
            staging=self._staging(),
        )
        publish(root, [plan.name for plan, _ in files])  # written under temporary names until now
        return self._rank_index(shards, files, results)

    def _plan(self, shards: List[ShardedTensor], smallest_last: bool) -> PlannedFiles:
        """Which shards go into which file, in which order, at which byte ranges."""
        rank = get_rank()
        to_write = []
        for sh in shards:
            if sh.data is None:
                raise InvalidShardedTensorError(f"[rank {rank}] main replica of {sh.key!r} has no data to save")
            if sh.data.numel():
                to_write.append(sh)
        groups = assign_writers(to_write, self.options.thread_count) if to_write else []
        if smallest_last:  # more of each file fits a snapshot budget (which takes file ends)
            groups = [sorted(g, key=lambda sh: -_nbytes(sh)) for g in groups]
        else:  # every shard before the first of an odd size starts at a cache-line-aligned offset
            groups = [sorted(g, key=lambda sh: _nbytes(sh) % DATA_ALIGN != 0) for g in groups]
        layout = [[(shard_name(sh), sh.dtype, tuple(_stored_view(sh).shape)) for sh in group] for group in groups]
        return [
            (plan_file(file_name(rank, i), items, FILE_METADATA), group)
            for i, (items, group) in enumerate(zip(layout, groups))
        ]

    def _rank_index(self, shards: List[ShardedTensor], files: PlannedFiles, results: Sequence[PartResult]) -> bytes:
        """This rank's part of the index, from the plan and the written parts' checksums."""
        part = IndexPart(get_rank(), shards, files)
        return part.encode(results, self.options.checksum_block_bytes is not None)

    def _commit_index(self, local: bytes, checkpoint_dir: Storage) -> None:
        gathered = gather_bytes(local)
        block = self.options.checksum_block_bytes
        storage = resolve_location(checkpoint_dir)
        run_collectively("writing the safetensors index", lambda: write_index(gathered, storage, block))

    def begin_stream(self, checkpoint_dir: Storage, layout: Sequence[TensorLayout]) -> TensorStreamWriter:
        """Write whole tensors one at a time (one process; see `stream`)."""
        options = self.options
        return SafetensorsStreamWriter(
            resolve_location(checkpoint_dir), layout, options.checksum_block_bytes, options.early_writeback
        )

    # ----------------------------------------------------------------------- asynchronous

    def reserve_snapshot(self, sharded_state_dict: ShardedStateDict, object_store: bool = False) -> int:
        """Allocate (and touch) the shared-memory snapshot buffer for asynchronous saves of
        ``sharded_state_dict`` now, e.g. at start-up, so that page faults of fresh memory do not
        add to the first checkpoint's blocking time. Local (not collective). Returns its size.

        With a host-memory budget, pass ``object_store=True`` for saves to an object store
        (which snapshot whole files).

        Example:

        ```python
        strategy = SafetensorsSaveShardedStrategy()
        strategy.reserve_snapshot(model_sharded_state_dict)
        ```
        """
        shards = [sh for sh in main_replica_shards(sharded_state_dict) if sh.data is not None]
        budget = self.options.budget()
        files = self._plan(shards, smallest_last=budget is not None)
        choose = whole_file_starts if object_store else deferred_starts
        starts = choose([[_nbytes(sh) for sh in group] for _, group in files], budget)
        nbytes = _snapshot_layout(files, starts, file_order=not object_store)[1]
        self._snapshots.reserve(nbytes)
        return nbytes

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> AsyncRequest:
        """Snapshot this rank's shards and return the request that writes them (not collective).

        Steps:

        1. Plan every file: which shards, in which order, at which byte ranges.
        2. Choose what the snapshot holds: every shard, or with a host-memory budget the
           ends of the files that fit ([`deferred_starts()`][dist_ckpt.backends.safetensors.strategy.deferred_starts];
           on an object store, the whole files that fit:
           [`whole_file_starts()`][dist_ckpt.backends.safetensors.strategy.whole_file_starts]).
        3. Write what the snapshot does not hold, now, straight from the tensors.
        4. Copy the rest into shared memory (`SnapshotPool`).
        5. Return the request: in the background, `write_snapshot_parts()`
           writes and fsyncs the files (`write_snapshot_objects()`
           uploads them, with the worker's own client); at finalization (collective) the index
           parts are gathered and rank 0 writes ``index.json``.

        The caller may change every tensor once this returns.

        Long on purpose: the five steps share the file plan, the snapshot's split of each file
        and the results of the writes made now, which the request's closures need; in one
        method they read in the order they happen instead of being passed between methods.
        """
        storage = resolve_location(checkpoint_dir)
        remote = remote_root = None
        if storage.local_paths:  # files written in parts, by this process and the background one
            storage.make_dir(SAFETENSORS_DIR)
            root = storage.local_path(SAFETENSORS_DIR)
        else:  # objects: each uploaded whole, by one process
            remote = storage
            remote_root = remote.child(SAFETENSORS_DIR)
        shards = main_replica_shards(sharded_state_dict)
        budget = self.options.budget()  # the staging of step 3 ends before the snapshot of step 4 starts
        block = self.options.checksum_block_bytes
        # 1. plan
        files = self._plan(shards, smallest_last=budget is not None and remote is None)
        views = [[_stored_view(sh) for sh in group] for _, group in files]
        # 2. what the snapshot holds
        choose = deferred_starts if remote is None else whole_file_starts
        starts = choose([[_nbytes(sh) for sh in group] for _, group in files], budget)
        # 3. the rest, written now
        if remote_root is None:
            heads = [
                WritePart(plan, 0, tuple(v[:k]), fsync=False) for (plan, _), v, k in zip(files, views, starts) if k > 0
            ]
            head_results = write_parts(
                root,
                heads,
                block_bytes=block,
                early_writeback=self.options.early_writeback,
                staging=self._staging(budget),
            )
        else:
            heads = [WritePart(plan, 0, tuple(v)) for (plan, _), v, k in zip(files, views, starts) if k > 0]
            head_results = write_objects(remote_root, heads, block_bytes=block, staging=self._staging(budget))
        # 4. snapshot
        outcome = AsyncOutcome()
        deferred = [t for v, k in zip(views, starts) for t in v[k:]]
        layout = _snapshot_layout(files, starts, file_order=remote_root is None)
        early = None
        if remote_root is None:  # where the disk takes O_DIRECT writes, it takes each part as it is copied
            early = _start_early_writes(root, files, starts, layout[0])
        try:
            snapshot = self._snapshots.take(
                deferred,
                in_use=lambda: not outcome.done or (early is not None and early.busy),
                layout=layout,
                on_copied=early.copied if early is not None else None,
            )
        except BaseException as e:
            if early is not None:
                early.abort(f"the snapshot failed: {type(e).__name__}: {e}")
            raise
        if early is not None:
            early.finish()
        parts, slot = [], 0
        for (plan, group), k in zip(files, starts):
            if k < len(group) or remote_root is None:
                parts.append(SnapshotPart(plan, k, tuple(range(slot, slot + len(group) - k))))
            slot += len(group) - k
        written_now = sum(_nbytes(sh) for (_, group), k in zip(files, starts) for sh in group[:k])
        note_async_split(snapshot.nbytes, written_now)
        logger.debug("async save: %d bytes snapshotted, %d written before returning", snapshot.nbytes, written_now)

        # 5. the request; its finalization needs the index entries, not the shards' data
        part = IndexPart(get_rank(), shards, files)
        checksums = block is not None

        def index_part() -> bytes:
            if remote_root is None:  # every part is written: the files get their final names
                publish(root, [plan.name for plan, _ in files])
            return part.encode(list(head_results) + list(outcome.result or []), checksums)

        def finalize() -> None:
            local = run_collectively("indexing the files written in the background", index_part)
            self._commit_index(local, storage)

        if remote_root is not None:
            return AsyncRequest(
                write_snapshot_objects, (remote_root, parts, snapshot, block), [finalize], outcome=outcome
            )
        args = (str(root), parts, snapshot, block, self.options.early_writeback, early.status if early else None)
        return AsyncRequest(write_snapshot_parts, args, [finalize], outcome=outcome)


def _start_early_writes(
    root: Path, files: PlannedFiles, starts: Sequence[int], slots: Sequence[Tuple[int, int]]
) -> Optional[EarlyWriter]:
    """Where files in ``root`` take ``O_DIRECT`` writes: create the files whose snapshotted part
    starts them (header written), and start the thread that writes each file's snapshot region
    as it is copied (`early_writes`). None elsewhere: the background process writes it all."""
    if not accepts_direct_writes(root):
        return None
    regions: List[EarlyRegion] = []
    slot_regions: List[Tuple[int, int]] = []
    first = 0
    for (plan, group), k in zip(files, starts):
        count = len(group) - k
        if count == 0:  # written whole before the snapshot
            continue
        if k == 0:
            create_with_header(root, plan)
        mine = slots[first : first + count]
        path = root / partial_name(plan.name)
        regions.append(EarlyRegion(path, plan.ranges[k][0], mine[0][0], mine[-1][0] + mine[-1][1]))
        slot_regions += [(len(regions) - 1, offset + n) for offset, n in mine]
        first += count
    return EarlyWriter(regions, slot_regions)


def _snapshot_layout(files: PlannedFiles, starts: Sequence[int], file_order: bool) -> Tuple[List[Tuple[int, int]], int]:
    """Where an async save's snapshot holds the shards from ``starts`` on of each file: for local
    files in file order (each file's snapshotted bytes one region, ready to go to the disk with
    ``O_DIRECT``: `file_order_layout()`), for objects packed (`snapshot_layout()`)."""
    if file_order:
        regions = [
            (plan.ranges[k][0] if k < len(group) else plan.size, [_nbytes(sh) for sh in group[k:]])
            for (plan, group), k in zip(files, starts)
        ]
        return file_order_layout(regions)
    return snapshot_layout([_nbytes(sh) for (_, group), k in zip(files, starts) for sh in group[k:]])


def _stored_view(sh: ShardedTensor) -> torch.Tensor:
    """The shard as stored: a whole shard with the shape of its box (prepended axes included),
    so the file alone says which part of the global tensor it holds; reshape is a view here."""
    assert sh.data is not None
    return sh.data if sh.flattened_range is not None else sh.data.reshape(sh.full_local_shape)


class SafetensorsLoadShardedStrategy(LoadShardedStrategy):
    """Loads ``safetensors``-backend checkpoints into any sharding.

    Reads only the byte ranges that overlap the requested shards; fills ``ShardedTensor.data``
    in place when it is allocated with the right shape (any device), else returns new CPU
    tensors. Needs no process group (no collective is called).

    Args:
        options: read threads and buffer sizes.

    Example:

    ```python
    strategy = SafetensorsLoadShardedStrategy(SafetensorsLoadOptions(thread_count=4))
    dc.load(sd, "ckpt/iter_10", sharded_strategy=strategy)
    ```
    """

    supported_backends: ClassVar[Tuple[str, ...]] = ("safetensors",)
    supported_versions: ClassVar[Tuple[int, ...]] = (1,)
    object_storage: ClassVar[bool] = True

    def __init__(self, options: Optional[ReadOptions] = None) -> None:
        self.options = options or ReadOptions()

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> StateDict:
        return load_from_index(sharded_state_dict, read_index(checkpoint_dir), self.options)

    def with_dtype_cast(self, allow: bool) -> "SafetensorsLoadShardedStrategy":
        """This loader with ``ReadOptions.allow_dtype_cast`` set to ``allow``."""
        if self.options.allow_dtype_cast == allow:
            return self
        return SafetensorsLoadShardedStrategy(replace(self.options, allow_dtype_cast=allow))

    def load_tensors_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        return tensors_metadata(read_index(checkpoint_dir))

    def verify_integrity(self, checkpoint_dir: Storage) -> IntegrityReport:
        """Every file the index lists, its header, and every checksum block of every shard."""
        return verify_safetensors(checkpoint_dir)

    def describe_stored_shards(self, checkpoint_dir: Storage) -> Optional[Dict[str, List[StoredShardInfo]]]:
        """Every shard the index lists: box or flattened range, file, byte count."""
        return describe_tensor_index(read_index(checkpoint_dir), f"{SAFETENSORS_DIR}/")

    def remove_sharded_tensors(self, checkpoint_dir: Storage, key_prefix: str) -> None:
        """Delete every tensor whose key starts with ``key_prefix`` (one process calls it).

        The index is rewritten atomically without those keys (each key goes whole or not at
        all: a rename on a local disk, a PUT on an object store), then files that hold no
        remaining shard are deleted. A version-3 index gets a new shard table (a new name, written
        before ``index.json``), and the old table is deleted last. The bytes of removed shards in
        files that still hold other shards stay until the checkpoint is rewritten.
        """
        read_index(checkpoint_dir)  # validates the whole index (and its integrity record) before changing it
        location = resolve_location(checkpoint_dir)
        root = location.child(SAFETENSORS_DIR)
        doc = want_object(loads(root.read(INDEX_FILENAME), root.url_of(INDEX_FILENAME)), root.url_of(INDEX_FILENAME))
        if doc.get("version") == INDEX_VERSION:  # a binary shard table: rewritten without the keys
            removed, orphans = remove_from_v3(location, key_prefix)
        else:
            removed, orphans = _without_keys(doc, key_prefix)
            root.write(INDEX_FILENAME, json.dumps(doc, separators=(",", ":")).encode("utf-8"))
            for name in orphans:
                root.delete(name)
        refresh_record(location, f"{SAFETENSORS_DIR}/{INDEX_FILENAME}")
        logger.info(
            "removed %d tensors with prefix %r from %s; deleted %d files",
            len(removed),
            key_prefix,
            root.url,
            len(orphans),
        )


def _without_keys(doc: Dict[str, Any], key_prefix: str) -> Tuple[List[str], List[str]]:
    """Drop the tensors whose key starts with ``key_prefix`` (and the files left without a
    shard) from an index document; return (removed keys, orphaned files)."""
    removed = [key for key in doc["tensors"] if key.startswith(key_prefix)]
    for key in removed:
        del doc["tensors"][key]
    used = {shard["file"] for entry in doc["tensors"].values() for shard in entry["shards"]}
    orphans = [name for name in doc["files"] if name not in used]
    for name in orphans:
        del doc["files"][name]
    return removed, orphans


def stored_bytes(checkpoint_dir: LocationLike) -> int:
    """Bytes of tensor data in a safetensors-backend checkpoint (from its index)."""
    index = read_index(checkpoint_dir)
    return sum(math.prod(s.stored_shape) * t.dtype.itemsize for t in index.tensors.values() for s in t.shards)
