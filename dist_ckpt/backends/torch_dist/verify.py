"""``dist-ckpt verify`` of the DCP part of a checkpoint (torch_dist, or a plain DCP directory).

One process, never raises for damage. Checks, in order:

1. ``.metadata`` is readable by the restricted unpickler (and matches its recorded crc32c);
2. every file the metadata names exists and is long enough for the items it holds there;
3. with a checksum manifest (checkpoints dist_ckpt wrote): every file's size, and the crc32c of
   every span of it (each item); files the metadata names but the manifest lacks are problems;
4. without one (Megatron-Core, torchtitan, ``dcp.save``): a note says no checksums were recorded,
   and each item is checked as what DCP writes, a ``torch.save`` zip archive whose members carry
   their own CRC-32.

Example::

    report = verify_torch_dist(Path("ckpt/iter_10"))
    [str(p) for p in report.problems]
"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path
from typing import Dict, List, Optional

from dist_ckpt.backends.torch_dist.checksums import CHECKSUMS_FILENAME, FileSpans, parse_manifest
from dist_ckpt.backends.torch_dist.layout import StoredItem, TorchDistLayout, parse_layout
from dist_ckpt.backends.torch_dist.metadata import DCP_METADATA_FILENAME, unpickle_metadata
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.integrity.checksums import IntegrityReport, crc32c, crc_to_hex

__all__ = ["verify_torch_dist"]

#: most bytes read at once while checking a span
_READ_BYTES = 64 << 20


def _keys_by_item(layout: TorchDistLayout) -> Dict[StoredItem, str]:
    found = {c.item: key for key, t in layout.tensors.items() for c in t.chunks}
    found.update({item: key for key, item in layout.byte_items.items()})
    return found


def _check_spans(path: Path, name: str, spans: FileSpans, keys: Dict[int, str], report: IntegrityReport) -> None:
    with open(path, "rb", buffering=0) as f:
        for start, length, crc in spans.spans:
            found, done = 0, 0
            f.seek(start)
            while done < length:
                chunk = f.read(min(_READ_BYTES, length - done))
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
                    keys.get(start),
                )


def _check_zip(data: bytes) -> Optional[str]:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"not a readable torch.save archive: {e}"
    return None if bad is None else f"member {bad!r} fails its CRC-32 check (corrupt)"


def _check_items(directory: Path, layout: TorchDistLayout, report: IntegrityReport) -> None:
    keys = _keys_by_item(layout)
    by_file: Dict[str, List[StoredItem]] = {}
    for item in keys:
        by_file.setdefault(item.file, []).append(item)
    for name, items in sorted(by_file.items()):
        with open(directory / name, "rb") as f:
            for item in sorted(items, key=lambda i: i.offset):
                f.seek(item.offset)
                data = f.read(item.length)
                report.bytes_checked += len(data)
                problem = _check_zip(data)
                if problem is not None:
                    report.add(name, f"item at byte {item.offset}: {problem}", keys[item])


def verify_torch_dist(directory: Path, allow_pickle: bool = False) -> IntegrityReport:
    """The integrity report of the DCP files of the checkpoint in ``directory`` (see the module
    docstring)."""
    report = IntegrityReport()
    manifest: Optional[Dict[str, FileSpans]] = None
    try:
        if (directory / CHECKSUMS_FILENAME).is_file():
            manifest = parse_manifest((directory / CHECKSUMS_FILENAME).read_bytes(), CHECKSUMS_FILENAME)
            report.files_checked += 1
    except CheckpointingException as e:
        report.add(CHECKSUMS_FILENAME, str(e))
    metadata_path = directory / DCP_METADATA_FILENAME
    try:
        raw = metadata_path.read_bytes()
        layout = parse_layout(unpickle_metadata(raw, DCP_METADATA_FILENAME, allow_pickle), str(directory))
    except FileNotFoundError:
        report.add(DCP_METADATA_FILENAME, "missing: the DCP save did not finish")
        return report
    except CheckpointingException as e:
        report.add(DCP_METADATA_FILENAME, str(e))
        return report
    keys = _keys_by_item(layout)
    ends: Dict[str, int] = {}
    for item in keys:
        ends[item.file] = max(ends.get(item.file, 0), item.offset + item.length)
    for name, end in sorted(ends.items()):
        try:
            size = os.path.getsize(directory / name)
        except FileNotFoundError:
            report.add(name, "missing (the DCP metadata lists items in it)")
            continue
        if size < end:
            report.add(name, f"has {size} bytes, its items end at byte {end} (truncated)")
    if report.problems:
        return report
    if manifest is None:
        report.notes.append(
            "no checksums recorded (written by another tool, or saved without checksums): each DCP item was "
            "checked as a torch.save archive (its zip CRC-32s)"
        )
        report.files_checked += 1 + len(ends)
        _check_items(directory, layout, report)
        return report
    for name in sorted(set(ends) - set(manifest)):
        report.add(name, f"not listed in {CHECKSUMS_FILENAME} (written after the save?)")
    for name, spans in sorted(manifest.items()):
        path = directory / name
        report.files_checked += 1
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            report.add(name, "missing")
            continue
        if size != spans.size:
            report.add(name, f"has {size} bytes, {spans.size} were recorded at save time (truncated or replaced)")
            continue
        by_offset = {item.offset: key for item, key in keys.items() if item.file == name}
        _check_spans(path, name, spans, by_offset, report)
    return report
