"""`StorageReader`: ``torch.distributed.checkpoint.load`` reading through dist_ckpt, checked.

DCP plans the load (``DefaultLoadPlanner``: which saved chunk fills which part of which tensor,
so resharding is DCP's); this reader reads. ``.metadata`` is read with dist_ckpt's restricted
unpickler (nothing from the file runs); a checkpoint that dist_ckpt checksummed (its
``.metadata`` says so: [`StorageWriter`][dist_ckpt.dcp.StorageWriter] and the ``torch_dist``
backend write one) must have its manifest, whose crc32c of ``.metadata`` and of every item read is
compared before DCP sees a byte: a damaged byte, a deleted manifest or a truncated file raises
dist_ckpt's typed error naming the key, the rank and the file, never a wrong tensor. DCP
checkpoints written by other tools (no mark) load unverified, as DCP's own reader loads them.

Items are read through the `Storage` (concurrent ranged reads: local ``preadv`` or S3 range
requests) in batches of about `BATCH_BYTES`, each item's bytes once however many read requests
use them.

Example:

```python
import torch.distributed.checkpoint as dcp
import dist_ckpt.dcp

dcp.load(state_dict, storage_reader=dist_ckpt.dcp.StorageReader("ckpt/step_100"))
```
"""

from __future__ import annotations

import io
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader as DCPStorageReader
from torch.futures import Future

from dist_ckpt.backends.torch_dist.checksums import (
    CHECKSUMS_FILENAME,
    FileSpans,
    check_bytes,
    item_spans,
    parse_manifest,
    require_manifest,
)
from dist_ckpt.backends.torch_dist.metadata import DCP_METADATA_FILENAME, unpickle_metadata
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.dcp.location import CheckpointLocation
from dist_ckpt.errors import CorruptCheckpointError, IncompatibleStrategyError, LoadMismatchError, NotACheckpointError
from dist_ckpt.storage import ObjectNotFoundError, RangeRead
from dist_ckpt.storage.base import StorageOptions
from dist_ckpt.storage.location import LocationLike

__all__ = ["BATCH_BYTES", "StorageReader"]

logger = logging.getLogger(__name__)

#: about how many bytes of items one batch of concurrent reads holds in memory
BATCH_BYTES = 256 << 20


class _CheckedFile:
    """A data file's spans, with their offsets for bisection."""

    def __init__(self, spans: FileSpans) -> None:
        self.spans = spans.spans
        self.starts = [s[0] for s in spans.spans]


class StorageReader(CheckpointLocation, DCPStorageReader):
    """A ``torch.distributed.checkpoint`` storage reader over dist_ckpt's storage, checking crc32c.

    Pass it to ``dcp.load`` as ``storage_reader``. It reads any DCP checkpoint saved with DCP's
    default ``torch.save`` serialization (``FileSystemWriter``'s, [`StorageWriter`][dist_ckpt.dcp.StorageWriter]'s,
    dist_ckpt's and Megatron-Core's ``torch_dist``), locally or from ``s3://``.

    Args:
        path: the checkpoint's directory, ``s3://bucket/prefix``, or an opened `Storage`
            (``checkpoint_id`` given to ``dcp.load`` replaces it).
        storage_options: ``LocalStorageOptions`` / ``S3StorageOptions`` for `open_storage`.
        allow_pickle: unpickle a ``.metadata`` naming classes outside DCP's metadata (runs code
            from the checkpoint: only for checkpoints you trust).

    Example:

    ```python
    dcp.load(state_dict, storage_reader=dist_ckpt.dcp.StorageReader("s3://bucket/run/step_100"))
    ```
    """

    def __init__(
        self, path: LocationLike, *, storage_options: Optional[StorageOptions] = None, allow_pickle: bool = False
    ) -> None:
        super().__init__(path, storage_options)
        self.allow_pickle = allow_pickle
        self._files: Optional[Dict[str, _CheckedFile]] = None
        self._storage_data: Dict[MetadataIndex, Any] = {}
        self._rank = 0

    def reset(self, checkpoint_id: Optional[LocationLike] = None) -> None:
        super().reset(checkpoint_id)
        self._files = None
        self._storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """``.metadata``, unpickled safely and, for a checksummed checkpoint, checked against its
        manifest (which is read here too)."""
        storage = self.storage
        rank = kwargs.get("rank")
        self._rank = rank if isinstance(rank, int) else get_rank()
        where = storage.url_of(DCP_METADATA_FILENAME)
        try:
            raw = storage.read(DCP_METADATA_FILENAME)
        except ObjectNotFoundError as e:
            raise NotACheckpointError(
                f"[rank {self._rank}] {where} does not exist: {storage.url} holds no committed DCP checkpoint "
                f"(a save that did not finish leaves none)"
            ) from e
        metadata = unpickle_metadata(raw, where, self.allow_pickle)
        has_manifest = storage.exists(CHECKSUMS_FILENAME)
        require_manifest(metadata, has_manifest, storage)
        self._files = None
        if getattr(metadata, "dist_ckpt_checksums", None) is not None:
            files = parse_manifest(storage.read(CHECKSUMS_FILENAME), storage.url_of(CHECKSUMS_FILENAME))
            own = files.get(DCP_METADATA_FILENAME)
            if own is None:
                raise CorruptCheckpointError(
                    f"[rank {self._rank}] {storage.url_of(CHECKSUMS_FILENAME)} lists no checksum of {where}: "
                    f"the manifest is corrupt"
                )
            check_bytes(raw, 0, own.spans, where, f"[rank {self._rank}] the DCP metadata")
            self._files = {name: _CheckedFile(spans) for name, spans in files.items()}
        else:
            logger.info("%s was not checksummed by dist_ckpt: its items load unverified", storage.url)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise CorruptCheckpointError(f"{self.storage.url_of(DCP_METADATA_FILENAME)} records no item locations")
        self._storage_data = metadata.storage_data
        rank = kwargs.get("rank")
        if isinstance(rank, int):
            self._rank = rank

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def _location_of(self, item: ReadItem) -> _StorageInfo:
        info = self._storage_data.get(item.storage_index)
        where = self.storage.url_of(DCP_METADATA_FILENAME)
        if not isinstance(info, _StorageInfo):
            raise CorruptCheckpointError(
                f"[rank {self._rank}] {item.storage_index.fqn!r}: {where} records no file location for the chunk at "
                f"{item.storage_index.offset} (found {info!r})"
            )
        if info.transform_descriptors:
            raise IncompatibleStrategyError(
                f"[rank {self._rank}] {item.storage_index.fqn!r} was saved with DCP storage transforms "
                f"{list(info.transform_descriptors)} (e.g. compression), which dist_ckpt.dcp.StorageReader does not "
                f"decode: load with torch.distributed.checkpoint.FileSystemReader"
            )
        return info

    def _check(self, info: _StorageInfo, data: bytearray, key: str) -> None:
        if self._files is None:
            return
        url = self.storage.url_of(info.relative_path)
        what = f"[rank {self._rank}] {key!r}"
        checked = self._files.get(info.relative_path)
        spans = None if checked is None else item_spans(checked.starts, checked.spans, info.offset, info.length)
        if spans is None:
            raise CorruptCheckpointError(
                f"{what}: the manifest {self.storage.url_of(CHECKSUMS_FILENAME)} has no checksum of bytes "
                f"{info.offset}:{info.offset + info.length} of {url}: the manifest or the metadata is corrupt"
            )
        check_bytes(memoryview(data), info.offset, spans, url, what)

    def _batches(self, plan: LoadPlan) -> List[List[Tuple[_StorageInfo, List[ReadItem]]]]:
        """The plan's items by saved item (in file order), cut into batches of about `BATCH_BYTES`."""
        by_item: Dict[Tuple[str, int, int], Tuple[_StorageInfo, List[ReadItem]]] = {}
        for item in plan.items:
            info = self._location_of(item)
            by_item.setdefault((info.relative_path, info.offset, info.length), (info, []))[1].append(item)
        batches: List[List[Tuple[_StorageInfo, List[ReadItem]]]] = [[]]
        held = 0
        for key in sorted(by_item):
            if batches[-1] and held + key[2] > BATCH_BYTES:
                batches.append([])
                held = 0
            batches[-1].append(by_item[key])
            held += key[2]
        return [b for b in batches if b]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "Future[None]":
        """Read, check and hand to ``planner`` every item of this rank's plan."""
        storage = self.storage
        for batch in self._batches(plan):
            buffers = [bytearray(info.length) for info, _ in batch]
            storage.read_ranges(
                [
                    RangeRead.into(info.relative_path, info.offset, memoryview(buf))
                    for (info, _), buf in zip(batch, buffers)
                ]
            )
            for (info, requests), data in zip(batch, buffers):
                self._check(info, data, requests[0].storage_index.fqn)
                for request in requests:
                    self._deliver(request, info, data, planner)
        done: "Future[None]" = Future()
        done.set_result(None)
        return done

    def _deliver(self, request: ReadItem, info: _StorageInfo, data: bytearray, planner: LoadPlanner) -> None:
        if request.type == LoadItemType.BYTE_IO:
            planner.load_bytes(request, io.BytesIO(data))
            return
        key = request.storage_index.fqn
        try:
            saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 -- a damaged archive fails in many ways
            raise CorruptCheckpointError(
                f"[rank {self._rank}] {key!r}: bytes {info.offset}:{info.offset + info.length} of "
                f"{self.storage.url_of(info.relative_path)} are not a tensor archive ({type(e).__name__}: {e})"
            ) from e
        if not isinstance(saved, torch.Tensor):
            raise CorruptCheckpointError(f"[rank {self._rank}] {key!r}: the saved item is a {type(saved).__name__}")
        piece = saved
        for dim, (start, length) in enumerate(zip(request.storage_offsets, request.lengths)):
            piece = piece.narrow(dim, start, length)  # the part of the saved chunk this request wants
        target = planner.resolve_tensor(request).detach()
        if target.size() != piece.size():
            raise LoadMismatchError(
                f"[rank {self._rank}] {key!r}: the planner wants a {tuple(target.size())} piece, the checkpoint "
                f"gives {tuple(piece.size())} at {request.storage_offsets} of {self.storage.url_of(info.relative_path)}"
            )
        target.copy_(piece)
        planner.commit_tensor(request, target)
