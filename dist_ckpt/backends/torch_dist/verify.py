"""``dist-ckpt verify`` of the DCP part of a checkpoint (torch_dist, or a plain DCP directory).

One process, never raises for damage. Checks, in order:

1. ``.metadata`` is readable by the restricted unpickler (and matches its recorded crc32c);
2. every file the metadata names exists and is long enough for the items it holds there;
3. with a checksum manifest (checkpoints dist_ckpt wrote): every file's size, and the crc32c of
   every span of it (each item); files the metadata names but the manifest lacks are problems;
4. without one (Megatron-Core, torchtitan, ``dcp.save``): a note says no checksums were recorded
   (a problem when ``.metadata`` says dist_ckpt recorded them: the manifest was deleted), and each
   item is checked as what DCP writes, a ``torch.save`` zip archive whose members carry
   their own CRC-32, and each tensor chunk's item as a tensor of the dtype and shape
   ``.metadata`` declares (loads refuse one stored in another dtype).

Example:

```python
report = verify_torch_dist("ckpt/iter_10")
[str(p) for p in report.problems]
```
"""

from __future__ import annotations

import io
import zipfile
from bisect import bisect_right
from typing import Dict, List, Optional, Tuple

import torch

from dist_ckpt.backends.torch_dist.checksums import CHECKSUMS_FILENAME, FileSpans, parse_manifest, require_manifest
from dist_ckpt.backends.torch_dist.layout import StoredChunk, StoredItem, StoredTensor, TorchDistLayout, parse_layout
from dist_ckpt.backends.torch_dist.metadata import DCP_METADATA_FILENAME, unpickle_metadata
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.integrity.checksums import IntegrityReport, crc32c, crc_to_hex
from dist_ckpt.record.records import read_recorded
from dist_ckpt.storage import ObjectReader, Storage
from dist_ckpt.storage.errors import ObjectNotFoundError, StorageError, TruncatedObjectError
from dist_ckpt.storage.location import LocationLike, resolve_location

__all__ = ["item_ends", "short_files", "verify_torch_dist"]

#: most bytes read at once while checking a span
_READ_BYTES = 64 << 20


def _keys_by_item(layout: TorchDistLayout) -> Dict[StoredItem, str]:
    found = {c.item: key for key, t in layout.tensors.items() for c in t.chunks}
    found.update({item: key for key, item in layout.byte_items.items()})
    return found


def _read(reader: ObjectReader, offset: int, length: int) -> bytes:
    """``length`` bytes from ``offset`` (fewer where the file ends)."""
    buf = bytearray(length)
    try:
        reader.read_into([memoryview(buf)], offset)
    except TruncatedObjectError:
        size = reader.size()
        return bytes(buf[: max(0, size - offset)])
    return bytes(buf)


def _key_at(starts: List[int], keys: List[str], offset: int) -> Optional[str]:
    """The key of the item holding byte ``offset`` (items sorted by offset; None before the first)."""
    i = bisect_right(starts, offset) - 1
    return keys[i] if i >= 0 else None


def _check_spans(storage: Storage, name: str, spans: FileSpans, keys: Dict[int, str], report: IntegrityReport) -> None:
    """Every span of ``name``; ``keys``: the key of each item, by its offset (a span lies in one
    item: a tensor's data record has a span of its own)."""
    starts = sorted(keys)
    names = [keys[s] for s in starts]
    with storage.open_reader(name) as reader:
        for start, length, crc in spans.spans:
            found, done = 0, 0
            while done < length:
                chunk = _read(reader, start + done, min(_READ_BYTES, length - done))
                if not chunk:
                    break
                found = crc32c(chunk, found)
                done += len(chunk)
            report.bytes_checked += done
            if done != length:
                report.add(name, f"ends at byte {start + done}, inside an item recorded at {start}:{start + length}")
                return
            if found != crc:
                report.add(
                    name,
                    f"bytes {start}:{start + length} have crc32c {crc_to_hex(found)}, {crc_to_hex(crc)} was recorded "
                    f"at save time (corrupt)",
                    _key_at(starts, names, start),
                )


def _check_zip(data: bytes) -> Optional[str]:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"not a readable torch.save archive: {e}"
    return None if bad is None else f"member {bad!r} fails its CRC-32 check (corrupt)"


def _check_tensor(data: bytes, stored: StoredTensor, chunk: StoredChunk) -> Optional[str]:
    """How the tensor in a chunk's item differs from what ``.metadata`` declares for it (its
    dtype, which loads refuse to cast silently, and its shape), or None."""
    try:
        values = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- torch.load fails in many ways on damaged bytes
        return f"not a loadable tensor: {type(e).__name__}: {e}"
    if not isinstance(values, torch.Tensor):
        return f"holds a {type(values).__name__}, not a tensor"
    if values.dtype != stored.dtype:
        return f"is stored as {values.dtype}, the DCP metadata declares {stored.dtype}"
    if tuple(values.shape) != chunk.sizes:
        return f"holds a tensor of shape {list(values.shape)}, its chunk is {list(chunk.sizes)}"
    return None


def _check_items(storage: Storage, layout: TorchDistLayout, report: IntegrityReport) -> None:
    """Each item as ``torch.save`` writes it (its zip CRC-32s), and each tensor chunk's item as
    the tensor ``.metadata`` declares (dtype and shape)."""
    keys = _keys_by_item(layout)
    chunks = {c.item: (t, c) for t in layout.tensors.values() for c in t.chunks}
    by_file: Dict[str, List[StoredItem]] = {}
    for item in keys:
        by_file.setdefault(item.file, []).append(item)
    for name, items in sorted(by_file.items()):
        with storage.open_reader(name) as reader:
            for item in sorted(items, key=lambda i: i.offset):
                data = _read(reader, item.offset, item.length)
                report.bytes_checked += len(data)
                problem = _check_zip(data)
                if problem is None and item in chunks:
                    problem = _check_tensor(data, *chunks[item])
                if problem is not None:
                    report.add(name, f"item at byte {item.offset}: {problem}", keys[item])


def _size(storage: Storage, name: str) -> Optional[int]:
    try:
        return storage.size(name)
    except ObjectNotFoundError:
        return None


def item_ends(layout: TorchDistLayout) -> Dict[str, Tuple[int, str]]:
    """The end of the last item of each file the layout's items lie in, and that item's key."""
    ends: Dict[str, Tuple[int, str]] = {}
    for item, key in _keys_by_item(layout).items():
        end = item.offset + item.length
        if end >= ends.get(item.file, (0, ""))[0]:
            ends[item.file] = (end, key)
    return ends


def short_files(storage: Storage, layout: TorchDistLayout) -> List[Tuple[str, str, str]]:
    """``(file, problem, key)`` for each file of the layout that is missing or ends before its
    last item (of ``key``): one size per file, so loads check it on opening (a forged
    ``.metadata`` that declares a huge tensor in huge items is refused before anything is
    allocated) and verify reports it."""
    problems = []
    for name, (end, key) in sorted(item_ends(layout).items()):
        size = _size(storage, name)
        if size is None:
            problems.append((name, "missing (the DCP metadata lists items in it)", key))
        elif size < end:
            problems.append((name, f"has {size} bytes, its items end at byte {end} (truncated)", key))
    return problems


def verify_torch_dist(checkpoint_dir: LocationLike, allow_pickle: bool = False) -> IntegrityReport:
    """The integrity report of the DCP files of the checkpoint at ``checkpoint_dir`` (see the
    module docstring), read through its storage.

    Raises:
        StorageError: the storage refused a request (not a property of the checkpoint).
    """
    storage = resolve_location(checkpoint_dir)
    report = IntegrityReport()
    manifest: Optional[Dict[str, FileSpans]] = None
    try:
        manifest_raw = read_recorded(storage, CHECKSUMS_FILENAME)  # a recorded manifest must be there
        if manifest_raw is not None:  # else written by another tool, or without checksums: noted below
            manifest = parse_manifest(manifest_raw, CHECKSUMS_FILENAME)
            report.files_checked += 1
    except StorageError:
        raise
    except CheckpointingException as e:
        report.add(CHECKSUMS_FILENAME, str(e))
    try:
        raw = storage.read(DCP_METADATA_FILENAME)
        layout = parse_layout(unpickle_metadata(raw, DCP_METADATA_FILENAME, allow_pickle), storage.url)
    except ObjectNotFoundError:
        report.add(DCP_METADATA_FILENAME, "missing: the DCP save did not finish")
        return report
    except StorageError:
        raise
    except CheckpointingException as e:
        report.add(DCP_METADATA_FILENAME, str(e))
        return report
    keys = _keys_by_item(layout)
    ends = item_ends(layout)
    for name, problem, key in short_files(storage, layout):
        report.add(name, problem, key)
    if report.problems:
        return report
    if manifest is None:
        try:
            require_manifest(layout.metadata, False, storage)
            report.notes.append(
                "no checksums recorded (written by another tool, or saved without checksums): each DCP item was "
                "checked as a torch.save archive (its zip CRC-32s)"
            )
        except CheckpointingException as e:  # saved with checksums: their manifest was deleted
            report.add(CHECKSUMS_FILENAME, str(e))
        report.files_checked += 1 + len(ends)
        _check_items(storage, layout, report)
        return report
    for name in sorted(set(ends) - set(manifest)):
        report.add(name, f"not listed in {CHECKSUMS_FILENAME} (written after the save?)")
    for name, spans in sorted(manifest.items()):
        report.files_checked += 1
        size = _size(storage, name)
        if size is None:
            report.add(name, "missing")
            continue
        if size != spans.size:
            report.add(name, f"has {size} bytes, {spans.size} were recorded at save time (truncated or replaced)")
            continue
        by_offset = {item.offset: key for item, key in keys.items() if item.file == name}
        _check_spans(storage, name, spans, by_offset, report)
    return report
