"""One rank's DCP items written as files through a `Storage`, each item's crc32c recorded.

The files are the ones DCP's ``FileSystemWriter`` writes -- ``__<rank>_<n>.distcp``, each item
one after the other (a tensor chunk as a ``torch.save`` archive, a bytes item as its bytes), its
place in ``.metadata`` a ``_StorageInfo(file, offset, length)`` -- so DCP's own reader loads them.
They are written through dist_ckpt's storage instead of DCP's file system: a local file appears
whole under its name at the end (temporary file, fsync, rename) or not at all, an S3 object when
its upload completes. The bytes pass through a
[`RecordingStream`][dist_ckpt.backends.torch_dist.checksums.RecordingStream] on their way, which
cuts a crc32c span at each item's ends (and around each tensor's data record): the same spans, and
the same manifest (``torch_dist.checksums.json``), as dist_ckpt's ``torch_dist`` backend writes.

Each item's spans travel with its location from ``write_data`` (every rank) to ``finish`` (the
coordinator) inside DCP's own gather of the write results, as a `CheckedLocation`; ``finish``
strips them back to DCP's plain ``_StorageInfo`` before ``.metadata`` is pickled (see `gathered_files`).

Example:

```python
results = write_file(storage, "__0_0.distcp", items, planner, rank=0)
locations, files = gathered_files([results])        # on the coordinator, every rank's results
manifest_bytes = manifest(files, metadata_bytes)
```
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from typing import IO, Any, Dict, List, Sequence, Tuple, cast

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dist_ckpt.backends.torch_dist.checksums import FileSpans, RecordingStream, Span, manifest_json, spans_within
from dist_ckpt.backends.torch_dist.metadata import DCP_METADATA_FILENAME
from dist_ckpt.backends.torch_dist.tensor_bytes import exact_storage
from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError
from dist_ckpt.integrity.checksums import crc32c
from dist_ckpt.storage import ObjectWriter, Storage
from dist_ckpt.storage.errors import storage_error_in

__all__ = ["DATA_SUFFIX", "CheckedLocation", "gathered_files", "item_bytes", "manifest", "split_items", "write_file"]

#: the suffix of DCP's data files (``FileSystemWriter``'s)
DATA_SUFFIX = ".distcp"


@dataclass(frozen=True)
class CheckedLocation:
    """Where one item was written (DCP's ``_StorageInfo``) and the crc32c spans tiling it: the
    ``storage_data`` of a `WriteResult` between ``write_data`` and ``finish``."""

    info: _StorageInfo
    spans: Tuple[Span, ...]


class _Sink(io.RawIOBase):
    """A `RecordingStream`'s file: writes go to a storage's streaming writer."""

    def __init__(self, writer: ObjectWriter) -> None:
        super().__init__()
        self._writer = writer

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self._writer.write(data)

    def flush(self) -> None:
        """Nothing to pass on: the storage's writer sends or copies each write."""


def item_bytes(item: WriteItem) -> int:
    """About how many bytes ``item`` writes (a tensor chunk's data; bytes items count as small)."""
    if item.tensor_data is None:
        return 0
    numel = 1
    for n in item.tensor_data.chunk.sizes:
        numel *= n
    return numel * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()


def split_items(items: Sequence[WriteItem], files: int) -> List[List[WriteItem]]:
    """``items`` spread over at most ``files`` files of about equal size (largest first onto the
    emptiest file; bytes items round-robin), none empty, the order within a file deterministic.

    Example:

    ```python
    split_items(plan.items, 2)     # [[big, small], [medium, blob]]
    ```
    """
    count = max(1, min(files, len(items)))
    buckets: List[List[WriteItem]] = [[] for _ in range(count)]
    sizes = [0] * count
    blobs = [i for i in items if i.type == WriteItemType.BYTE_IO]
    for n, blob in enumerate(blobs):
        buckets[n % count].append(blob)
    for tensor in sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=item_bytes, reverse=True):
        target = sizes.index(min(sizes))
        buckets[target].append(tensor)
        sizes[target] += item_bytes(tensor)
    return [b for b in buckets if b]


def _write_item(stream: RecordingStream, item: WriteItem, planner: SavePlanner) -> None:
    data = planner.resolve_data(item)
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise CheckpointingException(
                f"the planner resolved bytes item {item.index.fqn!r} to a {type(data).__name__}, not io.BytesIO"
            )
        stream.write(data.getbuffer())
        return
    if not isinstance(data, torch.Tensor):
        raise CheckpointingException(
            f"the planner resolved tensor item {item.index.fqn!r} to a {type(data).__name__}, not a tensor"
        )
    torch.save(exact_storage(data.detach().cpu()), cast(IO[bytes], stream))


def write_file(
    storage: Storage, name: str, items: Sequence[WriteItem], planner: SavePlanner, rank: int
) -> List[WriteResult]:
    """Write ``items`` (data from ``planner.resolve_data``) as object ``name`` of ``storage`` and
    return their `WriteResult` s, each carrying a `CheckedLocation`. Nothing is left under
    ``name`` when a write fails.

    Raises:
        StorageError: the storage refused a write (names the rank, the file and the bytes).
        CheckpointingException: anything else failed, naming the rank, the item's key and the file.
    """
    placed: List[Tuple[WriteItem, int, int]] = []
    reported: Dict[str, FileSpans] = {}
    lock = threading.Lock()

    def report(file: str, spans: FileSpans) -> None:
        with lock:
            reported[file] = spans

    current = "(opening the file)"
    try:
        with storage.open_writer(name) as writer:
            stream = RecordingStream(cast(IO[bytes], _Sink(writer)), name, report)
            for item in items:
                current = repr(item.index.fqn)
                start = stream.tell()
                _write_item(stream, item, planner)
                placed.append((item, start, stream.tell() - start))
            current = "(closing the file)"
            stream.close()
    except Exception as e:  # noqa: BLE001 -- torch.save makes a failed write a RuntimeError
        wanted = sum(item_bytes(i) for i in items)
        failed = storage_error_in(e, storage.url_of(name), wanted)
        if failed is not None and failed is not e:
            raise failed from e
        if isinstance(e, CheckpointingException):
            raise
        raise CheckpointingException(
            f"[rank {rank}] writing item {current} to {storage.url_of(name)} failed: {type(e).__name__}: {e}"
        ) from e
    spans = reported[name].spans
    results = []
    for item, offset, length in placed:
        own = spans_within(spans, offset, length)
        if own is None:  # the stream cuts a span at every tell(): only a bug gets here
            raise CheckpointingException(f"[rank {rank}] the crc32c spans of {name} do not tile item {item.index}")
        location = CheckedLocation(_StorageInfo(name, offset, length), tuple(own))
        results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=location))
    return results


def gathered_files(
    results: Sequence[Sequence[WriteResult]],
) -> Tuple[Dict[MetadataIndex, _StorageInfo], Dict[str, FileSpans]]:
    """DCP's ``storage_data`` (each item's plain ``_StorageInfo``) and every data file's spans,
    from the write results DCP gathered from every rank.

    Raises:
        CorruptCheckpointError: a result carries no `CheckedLocation` (not written by `write_file`),
            or a file's items leave a gap.
    """
    locations: Dict[MetadataIndex, _StorageInfo] = {}
    per_file: Dict[str, List[Span]] = {}
    for rank, rank_results in enumerate(results):
        for result in rank_results:
            checked = result.storage_data
            if not isinstance(checked, CheckedLocation):
                raise CorruptCheckpointError(
                    f"[rank {rank}] item {result.index.fqn!r} was not written by dist_ckpt.dcp.StorageWriter "
                    f"(its location is a {type(checked).__name__}): every rank must save with the same writer"
                )
            locations[result.index] = checked.info
            per_file.setdefault(checked.info.relative_path, []).extend(checked.spans)
    files: Dict[str, FileSpans] = {}
    for name, spans in per_file.items():
        ordered = tuple(sorted(spans))
        position = 0
        for start, length, _ in ordered:
            if start != position:
                raise CorruptCheckpointError(f"the items written to {name} leave bytes {position}:{start} unaccounted")
            position += length
        files[name] = FileSpans(position, ordered)
    return locations, files


def manifest(files: Dict[str, FileSpans], metadata_bytes: bytes) -> bytes:
    """The checksum manifest of the data ``files`` and of ``.metadata`` (``metadata_bytes``)."""
    whole = ((0, len(metadata_bytes), crc32c(metadata_bytes)),) if metadata_bytes else ()
    return manifest_json({**files, DCP_METADATA_FILENAME: FileSpans(len(metadata_bytes), whole)})
