"""The ``torch_dist`` save strategy: Megatron-Core's format, written by torch.distributed.checkpoint.

A save writes what Megatron-Core's ``dist_checkpointing.save`` writes with its ``torch_dist``
backend, so that megatron-core (and DCP's own reader) load it: DCP's ``.metadata`` and each rank's
``__<rank>_<n>.distcp`` files (``thread_count`` per rank), one ``torch.save`` archive per tensor
chunk, ShardedObjects as bytes entries inside DCP (see `layout`). ``dist_ckpt.save`` adds
``common.pt`` (the ``torch`` common backend) and commits ``metadata.json`` with exactly Megatron's
four keys (dist_ckpt's own record of the save goes to ``dist_ckpt.json``: Megatron-Core refuses
unknown keys in ``metadata.json``). The crc32c of every item written is recorded in
``torch_dist.checksums.json`` (see `checksums`). The ``.distcp`` files are written into a
staging directory and renamed into place at the commit (see `staging`), so a failed save leaves
no data file under a final name.

DCP does the writing: each rank builds DCP ``WriteItem`` s for its main replicas and hands them
to DCP's ``FileSystemWriter.write_data`` (which names, splits and serializes the files); the
ranks' plans and write results are then gathered to rank 0, where DCP's ``DefaultSavePlanner``
builds the global ``Metadata`` (validating that chunks neither overlap nor leave gaps) and
``FileSystemWriter.finish`` writes ``.metadata``. This is the split Megatron-Core makes for its
asynchronous saves (decentralized planning); here the synchronous and the asynchronous save share
it, so both produce the same files:

1. (local) plan this rank's items; synchronous: write them now, straight from the tensors;
   asynchronous: copy the tensors into a shared-memory snapshot and return an
   [`AsyncRequest`][dist_ckpt.asynchronous.queue.AsyncRequest] whose background process writes them
   (into the staging directory ``.partial-distcp``);
2. (collective, at the end of ``save`` or at finalization) gather what each rank wrote; rank 0
   renames every rank's files into place, then writes ``.metadata`` and the checksum manifest,
   atomically and durably.

Local directories only (DCP's file system writer).

Example:

```python
dc.save(sd, "ckpt/iter_10", sharded_strategy=("torch_dist", 1))
request = dc.save(sd, "ckpt/iter_20", sharded_strategy=("torch_dist", 1), async_sharded_save=True)
```
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dist_ckpt.asynchronous.queue import AsyncOutcome, AsyncRequest
from dist_ckpt.asynchronous.snapshot import PROCESS_SNAPSHOTS, Snapshot
from dist_ckpt.backends.base import AsyncSaveShardedStrategy, TensorLayout, TensorStreamWriter, main_replica_shards
from dist_ckpt.backends.torch_dist.checksums import (
    CHECKSUMS_FILENAME,
    ChecksummingFileSystem,
    FileSpans,
    manifest_json,
    mark_checksummed,
)
from dist_ckpt.backends.torch_dist.layout import REFORMULATED_SHAPE, chunk_data, write_chunk
from dist_ckpt.backends.torch_dist.load import local_storage
from dist_ckpt.backends.torch_dist.metadata import DCP_METADATA_FILENAME
from dist_ckpt.backends.torch_dist.staging import STAGING_DIR, publish_staged, staged_names, staging_dir
from dist_ckpt.backends.torch_dist.tensor_bytes import exact_storage, on_storage
from dist_ckpt.collectives.distributed import gather_json, get_rank, run_collectively
from dist_ckpt.errors import CheckpointingException, InvalidShardedTensorError, ShardingIntegrityError
from dist_ckpt.integrity.checksums import crc32c
from dist_ckpt.model.dict_utils import nested_values
from dist_ckpt.model.dtypes import dtype_from_name, dtype_to_name
from dist_ckpt.model.sharded import ShardedObject, ShardedStateDict, is_main_replica
from dist_ckpt.storage import Storage, fsync_dir
from dist_ckpt.storage.errors import storage_error_in
from dist_ckpt.storage.host_memory import get_host_memory_budget, note_async_split

__all__ = [
    "ChunkEntry",
    "RankPlan",
    "TorchDistSaveOptions",
    "TorchDistSaveShardedStrategy",
    "commit_metadata",
    "plan_rank",
    "write_global_metadata",
    "write_rank",
    "write_snapshot",
    "written_already",
]

logger = logging.getLogger(__name__)


#: the format name and version in ``metadata.json`` (Megatron-Core's)
TORCH_DIST_BACKEND: Tuple[str, int] = ("torch_dist", 1)


@dataclass(frozen=True)
class TorchDistSaveOptions:
    """How [`TorchDistSaveShardedStrategy`][dist_ckpt.backends.torch_dist.save.TorchDistSaveShardedStrategy] writes.

    Attributes:
        thread_count: writer threads per rank, each writing one file (``__<rank>_<n>.distcp``),
            as DCP's ``FileSystemWriter(thread_count=...)``; Megatron-Core uses 2.
        checksums: record the crc32c of every item in ``torch_dist.checksums.json``.
        sync_files: fsync every file (a save is durable when it returns); off only for tests
            and benchmarks of the page cache.
    """

    thread_count: int = 2
    checksums: bool = True
    sync_files: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.thread_count, int) or isinstance(self.thread_count, bool) or self.thread_count < 1:
            raise CheckpointingException(
                f"TorchDistSaveOptions.thread_count must be an int >= 1, got {self.thread_count!r}"
            )


@dataclass(frozen=True)
class ChunkEntry:
    """One chunk a rank saves: its DCP key, box in the stored tensor, the stored tensor's size and
    dtype, and for a flattened ShardedTensor the original global shape (JSON-friendly)."""

    key: str
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    size: Tuple[int, ...]
    dtype: str
    original_shape: Optional[Tuple[int, ...]] = None

    def to_json(self) -> Dict[str, Any]:
        return {
            "key": self.key,
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "size": list(self.size),
            "dtype": self.dtype,
            "original_shape": None if self.original_shape is None else list(self.original_shape),
        }

    @classmethod
    def from_json(cls, doc: Dict[str, Any]) -> "ChunkEntry":
        original = doc.get("original_shape")
        return cls(
            doc["key"],
            tuple(doc["offsets"]),
            tuple(doc["sizes"]),
            tuple(doc["size"]),
            doc["dtype"],
            None if original is None else tuple(original),
        )

    def write_item(self) -> WriteItem:
        """The DCP ``WriteItem`` of this chunk."""
        chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))
        data = TensorWriteData(chunk, TensorProperties(dtype=dtype_from_name(self.dtype)), torch.Size(self.size))
        return WriteItem(index=MetadataIndex(self.key, self.offsets), type=WriteItemType.SHARD, tensor_data=data)


@dataclass(frozen=True)
class RankPlan:
    """What one rank writes: its chunks (their data passed separately, in this order) and its
    ShardedObjects, already serialized as Megatron-Core stores them."""

    rank: int
    chunks: Tuple[ChunkEntry, ...]
    objects: Tuple[Tuple[str, bytes], ...]


def _torch_bytes(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def plan_rank(sharded_state_dict: ShardedStateDict) -> Tuple[RankPlan, List[torch.Tensor]]:
    """This rank's `RankPlan` and the data of its chunks (views shaped like the chunks).

    ShardedObjects with the same unique key on this rank are saved together as one list, as
    Megatron-Core does; only main replicas are saved.
    """
    rank = get_rank()
    chunks: List[ChunkEntry] = []
    tensors: List[torch.Tensor] = []
    for sh in main_replica_shards(sharded_state_dict):
        if sh.data is None:
            raise InvalidShardedTensorError(f"[rank {rank}] main replica of {sh.key!r} has no data to save")
        offsets, sizes, size = write_chunk(sh)
        original = tuple(sh.global_shape) if sh.flattened_range is not None else None
        chunks.append(ChunkEntry(sh.key, offsets, sizes, size, dtype_to_name(sh.dtype), original))
        tensors.append(chunk_data(sh))
    grouped: Dict[str, List[Any]] = {}
    for obj in nested_values(sharded_state_dict):
        if isinstance(obj, ShardedObject) and is_main_replica(obj.replica_id):
            grouped.setdefault(obj.unique_key, []).append(obj.data)
    objects = tuple((key, _torch_bytes(values)) for key, values in grouped.items())
    return RankPlan(rank, tuple(chunks), objects), tensors


class _ItemData(DefaultSavePlanner):
    """Hands DCP's writer the data of each item (only ``resolve_data`` is used)."""

    def __init__(self, data: Dict[MetadataIndex, Union[torch.Tensor, bytes]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._data = data

    def resolve_data(self, write_item: WriteItem) -> Union[torch.Tensor, io.BytesIO]:
        value = self._data[write_item.index]
        return io.BytesIO(value) if isinstance(value, bytes) else exact_storage(value.detach())


def write_rank(
    directory: str, plan: RankPlan, tensors: Sequence[torch.Tensor], options: TorchDistSaveOptions
) -> Dict[str, Any]:
    """Write one rank's files with DCP's ``FileSystemWriter`` into the staging directory of the
    checkpoint ``directory`` (see `staging`) and return what was written (JSON): the chunks and
    objects, each item's file range, the files' names and their checksum spans.

    Local: no collective (it also runs in the asynchronous save's background process).

    Example:

    ```python
    plan, tensors = plan_rank(sharded_state_dict)
    written = write_rank("ckpt/iter_10", plan, tensors, TorchDistSaveOptions())
    ```
    """
    items: List[WriteItem] = []
    data: Dict[MetadataIndex, Union[torch.Tensor, bytes]] = {}
    for entry, tensor in zip(plan.chunks, tensors):
        item = entry.write_item()
        items.append(item)
        data[item.index] = tensor
    for key, payload in plan.objects:
        items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        data[MetadataIndex(key)] = payload
    staging = staging_dir(directory)
    writer = FileSystemWriter(staging, thread_count=options.thread_count, sync_files=options.sync_files)
    file_system = ChecksummingFileSystem()
    if options.checksums:
        writer.fs = file_system
    local = writer.prepare_local_plan(SavePlan(items))
    # DCP's coordinator names rank r's files "__r_<n>.distcp" (prepare_global_plan); ask it to
    local = writer.prepare_global_plan([SavePlan([]) for _ in range(plan.rank)] + [local])[plan.rank]
    try:
        results: List[WriteResult] = writer.write_data(local, _ItemData(data)).wait() if items else []
    except Exception as e:  # noqa: BLE001 -- DCP's torch.save makes a failed write a RuntimeError
        wanted = sum(t.numel() * t.element_size() for t in tensors) + sum(len(p) for _, p in plan.objects)
        failed = storage_error_in(e, f"the .distcp files of rank {plan.rank} in {staging}", wanted)
        if failed is None or failed is e:
            raise
        raise failed from e
    return {
        "rank": plan.rank,
        "chunks": [entry.to_json() for entry in plan.chunks],
        "objects": [key for key, _ in plan.objects],
        "results": [_result_json(r) for r in results],
        "names": staged_names(staging, plan.rank),
        "files": {name: spans.to_json() for name, spans in file_system.digests.items()} if options.checksums else None,
    }


def written_already(written: Dict[str, Any]) -> Dict[str, Any]:
    """The background step of an async save that wrote its files before returning (its state
    did not fit the host-memory budget): what `write_rank()` returned."""
    return written


def write_snapshot(directory: str, plan: RankPlan, snapshot: Snapshot, options: TorchDistSaveOptions) -> Dict[str, Any]:
    """`write_rank()` from a shared-memory snapshot: the background half of an asynchronous
    save (runs in the async worker process, calls no collective)."""
    tensors = []
    for i, entry in enumerate(plan.chunks):
        raw = snapshot.view(i)
        storage = raw.untyped_storage()[raw.storage_offset() : raw.storage_offset() + raw.numel()]
        tensors.append(on_storage(storage, dtype_from_name(entry.dtype), entry.sizes))
    return write_rank(directory, plan, tensors, options)


def _result_json(result: WriteResult) -> Dict[str, Any]:
    info = result.storage_data
    offset = result.index.offset
    return {
        "key": result.index.fqn,
        "offsets": None if offset is None else list(offset),
        "file": info.relative_path,
        "offset": info.offset,
        "length": info.length,
    }


def _result(doc: Dict[str, Any]) -> WriteResult:
    index = MetadataIndex(doc["key"], doc["offsets"])
    return WriteResult(
        index=index, size_in_bytes=doc["length"], storage_data=_StorageInfo(doc["file"], doc["offset"], doc["length"])
    )


def _file_spans(doc: Dict[str, Any]) -> FileSpans:
    return FileSpans(doc["size"], tuple((o, n, int(c, 16)) for o, n, c in doc["spans"]))


def write_global_metadata(storage: Storage, gathered: List[Dict[str, Any]], options: TorchDistSaveOptions) -> None:
    """Rank 0: DCP's global plan from every rank's items; every rank's staged files renamed into
    place; ``.metadata`` (DCP's file writer, in the storage's local directory), then the manifest
    (through the storage)."""
    plans, results = [], []
    reformulated: Dict[str, Dict[str, Any]] = {}
    for part in sorted(gathered, key=lambda p: p["rank"]):
        chunks = [ChunkEntry.from_json(c) for c in part["chunks"]]
        items = [c.write_item() for c in chunks]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in part["objects"]]
        plans.append(SavePlan(items))
        results.append([_result(r) for r in part["results"]])
        for c in chunks:
            if c.original_shape is not None:
                reformulated[c.key] = {REFORMULATED_SHAPE: tuple(c.original_shape)}
    try:
        _, metadata = DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False).create_global_plan(
            plans
        )
    except (ValueError, AssertionError) as e:  # DCP's own validation of the chunks of every tensor
        raise ShardingIntegrityError(f"torch.distributed.checkpoint refused the saved chunks: {e}") from e
    if reformulated:
        # megatron-core <= 0.14 records flattened tensors' shapes so (0.15 pickles a subclass instead)
        metadata.mcore_data = reformulated  # type: ignore[attr-defined]
    if options.checksums:
        mark_checksummed(metadata)  # a deleted manifest then fails closed (see checksums)
    publish_staged(storage.local_dir, [name for part in gathered for name in part["names"]])
    writer = FileSystemWriter(storage.local_dir, sync_files=options.sync_files)
    writer.finish(metadata, results)
    if options.checksums:
        files = {name: _file_spans(doc) for part in gathered for name, doc in (part["files"] or {}).items()}
        raw = storage.read(DCP_METADATA_FILENAME)
        files[DCP_METADATA_FILENAME] = FileSpans(len(raw), ((0, len(raw), crc32c(raw)),) if raw else ())
        storage.write(CHECKSUMS_FILENAME, manifest_json(files))
    fsync_dir(storage.local_dir)  # DCP renamed .metadata into place without flushing the directory
    logger.debug(
        "torch_dist metadata: %d tensors, %d objects, %d bytes of items",
        sum(1 for v in metadata.state_dict_metadata.values() if hasattr(v, "chunks")),
        sum(len(p["objects"]) for p in gathered),
        sum(r["length"] for p in gathered for r in p["results"]),
    )


def commit_metadata(storage: Storage, written: Dict[str, Any], options: TorchDistSaveOptions) -> None:
    """Gather what every rank wrote; rank 0 writes ``.metadata`` and the checksum manifest
    (collective: a failure on rank 0 raises on every rank)."""
    gathered = gather_json(written)

    def write_on_rank0() -> None:
        if get_rank() == 0:
            assert gathered is not None
            write_global_metadata(storage, gathered, options)

    run_collectively("writing the DCP metadata", write_on_rank0)


class TorchDistSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Saves in Megatron-Core's ``torch_dist`` format through torch.distributed.checkpoint.

    Synchronous `save()` (collective): every rank writes its files (step 1 of the module
    docstring), then rank 0 writes ``.metadata`` and the manifest (step 2). [`async_save()`][.async_save]
    (local) snapshots the tensors and returns the request whose background process writes the
    files and whose finalization runs step 2. ShardedObjects are saved inside DCP.

    The arguments follow Megatron-Core's ``TorchDistSaveShardedStrategy(backend, version,
    thread_count=...)``, so code written for it runs unchanged.

    Args:
        backend: format name recorded in ``metadata.json``.
        version: format version.
        thread_count: writer threads (files) per rank; overrides ``options.thread_count``.
        options: threads, checksums, fsync.

    Example:

    ```python
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=4)
    dc.save(sd, "ckpt/iter_10", sharded_strategy=strategy)
    TorchDistSaveShardedStrategy(options=TorchDistSaveOptions(checksums=False))
    ```
    """

    owned_paths: ClassVar[Tuple[str, ...]] = (
        DCP_METADATA_FILENAME,
        f"{DCP_METADATA_FILENAME}.tmp",
        "__*.distcp",
        STAGING_DIR,
        CHECKSUMS_FILENAME,
    )
    can_stream: ClassVar[bool] = True
    integrity_records: ClassVar[Tuple[str, ...]] = (CHECKSUMS_FILENAME,)

    def __init__(
        self,
        backend: str = TORCH_DIST_BACKEND[0],
        version: int = TORCH_DIST_BACKEND[1],
        thread_count: Optional[int] = None,
        *,
        options: Optional[TorchDistSaveOptions] = None,
    ) -> None:
        super().__init__(backend, version)
        options = options or TorchDistSaveOptions()
        self.options = options if thread_count is None else replace(options, thread_count=thread_count)
        self._snapshots = PROCESS_SNAPSHOTS  # shared: a new strategy object reuses the last buffer

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> None:
        storage = local_storage(checkpoint_dir)

        def write() -> Dict[str, Any]:
            plan, tensors = plan_rank(sharded_state_dict)
            return write_rank(str(storage.local_dir), plan, tensors, self.options)

        written = run_collectively("writing torch_dist files", write)
        commit_metadata(storage, written, self.options)

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> AsyncRequest:
        """Snapshot this rank's chunks and objects; return the request that writes them in the
        background and, at finalization (collective), writes ``.metadata`` (not collective)."""
        storage = local_storage(checkpoint_dir)
        storage.make_dir()
        plan, tensors = plan_rank(sharded_state_dict)
        outcome = AsyncOutcome()

        def finalize() -> None:
            commit_metadata(storage, outcome.result, self.options)

        budget = get_host_memory_budget()
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if budget is not None and nbytes > budget:
            # DCP writes a rank's files in one call: a state over the budget is written now, whole
            # (the request's background step only hands the result on)
            written = write_rank(str(storage.local_dir), plan, tensors, self.options)
            note_async_split(0, nbytes)
            return AsyncRequest(written_already, (written,), [finalize], outcome=outcome)
        snapshot = self._snapshots.take(tensors, in_use=lambda: not outcome.done)
        note_async_split(snapshot.nbytes, 0)
        logger.debug("torch_dist async save: %d bytes snapshotted", snapshot.nbytes)
        args = (str(storage.local_dir), plan, snapshot, self.options)
        return AsyncRequest(write_snapshot, args, [finalize], outcome=outcome)

    def begin_stream(self, checkpoint_dir: Storage, layout: Sequence[TensorLayout]) -> TensorStreamWriter:
        """Write whole tensors (and ShardedObjects) one at a time (one process; see `stream`)."""
        from dist_ckpt.backends.torch_dist.stream import TorchDistStreamWriter

        return TorchDistStreamWriter(local_storage(checkpoint_dir), layout, self.options)
