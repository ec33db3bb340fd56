"""Every array's ``zarr.json`` of a local save, copied into the root group: one read at load.

A cold load of a zarr checkpoint read each tensor's ``zarr.json`` before any data: one small
random read per tensor, which the disk serves one after another however many threads ask
(profiled at 585 tensors on 2 ranks, issue 17: 0.2 s of a 1.3 s cold load, the same with 1, 2,
8 or 32 threads). A local save therefore also writes the text of every ``zarr.json`` it made
into the root group's attributes, and a load reads that one file instead:

```text
zarr/zarr.json   {"attributes": {"dist_ckpt": {"zarr_json": {"<tensor dir>/zarr.json": "<its text>", ...}}}, ...}
```

The index is a copy, never the source of truth. A load takes an entry only where the checkpoint's
checksum manifest records exactly those bytes for that file (`read_index()`); otherwise it reads
the file, as before: a checkpoint saved without an index, a load without checksums, a tensor
removed since (`remove_sharded_tensors` drops its files from the manifest). A load that reads an
array through its engine's library (a fragment of a flattened tensor, another codec) still reads
its file.
Damage to an array's own ``zarr.json`` is otherwise found by ``dist-ckpt verify`` (and by readers
other than dist_ckpt), not by a load that uses the copy the manifest vouches for. Other zarr
readers see one more group attribute. Rank 0 writes the root group once every rank's files are
written, before the manifest (`write_root()`); an index larger than `MAX_INDEX_BYTES` is left
out (the root group then has no attributes), and saves through an object store or a tensor
stream (`begin_stream`) write none.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence

from dist_ckpt.backends.zarr.layout import ATTR
from dist_ckpt.backends.zarr.metadata import JsonCheck, read_zarr_json
from dist_ckpt.backends.zarr.nodes import group_document
from dist_ckpt.integrity.checksums import FileDigest, bytes_digest
from dist_ckpt.storage.object_path import ObjectPath

__all__ = [
    "INDEX_FIELD",
    "MAX_INDEX_BYTES",
    "index_part",
    "merged_documents",
    "read_index",
    "root_document",
    "write_root",
]

#: the root group's attribute (under `ATTR`) that holds the index
INDEX_FIELD = "zarr_json"

#: the largest root group written with an index (about 8,000 tensors); beyond, the root group has
#: no index and loads read each ``zarr.json`` (the root stays below the cap on small JSON documents)
MAX_INDEX_BYTES = 8 << 20


def root_document(documents: Mapping[str, str]) -> bytes:
    """The root group's ``zarr.json`` indexing ``documents`` (``{name under zarr/: text}``), or a
    plain group's where there are none or the document would exceed `MAX_INDEX_BYTES`."""
    if not documents:
        return group_document({})
    indexed = group_document({ATTR: {INDEX_FIELD: dict(sorted(documents.items()))}})
    return indexed if len(indexed) <= MAX_INDEX_BYTES else group_document({})


def index_part(documents: Mapping[str, str], world_size: int) -> Optional[Mapping[str, str]]:
    """What one of ``world_size`` ranks sends rank 0 for the index: its ``documents``, or None
    where they exceed its share of `MAX_INDEX_BYTES`. So what rank 0 gathers stays within about
    the cap whatever the number of ranks (the gather pads every rank's part to the largest), and
    an index that would be left out is not gathered first. The ranks' documents are about equal
    (the rank that creates each array is picked by a hash of its key)."""
    size = sum(len(k) + len(v) for k, v in documents.items())
    return documents if size <= MAX_INDEX_BYTES // max(world_size, 1) else None


def merged_documents(parts: Sequence[Optional[Mapping[str, str]]]) -> Dict[str, str]:
    """Every rank's `index_part()` in one mapping; empty (no index) if any rank sent None."""
    if any(part is None for part in parts):
        return {}
    return {name: text for part in parts if part is not None for name, text in part.items()}


def write_root(root: ObjectPath, documents: Mapping[str, str]) -> FileDigest:
    """Create ``root``'s ``zarr.json`` (`root_document()`), durably and only if absent (a file is
    written once); returns its digest for the manifest."""
    data = root_document(documents)
    node = root / "zarr.json"
    node.storage.put_if_absent(node.key, data)
    return bytes_digest(data)


def read_index(
    root: ObjectPath, manifest: Optional[Mapping[str, FileDigest]], check: JsonCheck
) -> Dict[ObjectPath, bytes]:
    """The ``zarr.json`` bytes the root group at ``root`` (``zarr/``) indexes, by path, keeping
    only those ``manifest`` records exactly (size and crc32c); empty without a manifest or an
    index, and on storages without directories (only local saves write an index; on an object
    store an interrupted removal deletes a tensor's ``zarr.json`` before the manifest learns
    of it, so the file, not the index, says whether the tensor is there). The root's own
    ``zarr.json`` is read through ``check`` (damage to it raises)."""
    if manifest is None or not root.storage.local_paths:
        return {}
    doc = read_zarr_json(root, check)
    entries = _index_of(doc) if doc is not None else None
    if not entries:
        return {}
    index = {}
    for name, text in entries.items():
        expected = manifest.get(name) if isinstance(name, str) else None
        if expected is None or not isinstance(text, str):
            continue
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: not text this writes
            continue
        if bytes_digest(raw) == expected:
            index[root / name] = raw
    return index


def _index_of(doc: Dict[str, Any]) -> Optional[Dict[Any, Any]]:
    attributes = doc.get("attributes")
    ours = attributes.get(ATTR) if isinstance(attributes, dict) else None
    entries = ours.get(INDEX_FIELD) if isinstance(ours, dict) else None
    return entries if isinstance(entries, dict) else None
