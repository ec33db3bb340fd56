"""Rewrite a checkpoint's safetensors index as version 1 or 2 (JSON per shard), for tests.

Saves write index version 3; versions 1 and 2 are still read (the golden checkpoints hold one of
each). Tests of the version-1/2 parser corrupt such documents, so they rewrite a fresh
checkpoint's index in the older layout first -- exactly what dist_ckpt wrote before version 3,
with the integrity record of ``metadata.json`` to match (:func:`write_legacy_index`). The
attack the integrity records exist for -- the index rewritten as version 1, without checksums,
the record left as the save wrote it -- is :func:`downgrade_index_to_v1`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

from dist_ckpt.backends.safetensors.index import INDEX_FILENAME, SAFETENSORS_DIR, read_index
from dist_ckpt.integrity.checksums import encode_block_crcs
from dist_ckpt.model.dtypes import dtype_to_name
from dist_ckpt.record.records import refresh_record
from dist_ckpt.storage import LocalStorage


def legacy_document(checkpoint: Path, checksums: Optional[bool] = None) -> Dict[str, Any]:
    """The index of ``checkpoint`` as a version-2 document (version 1 when it has no checksums,
    or when ``checksums`` is False)."""
    index = read_index(checkpoint)
    if checksums is None:
        checksums = index.block_bytes is not None
    files: Dict[str, Any] = {}
    for name, size in index.file_sizes.items():
        files[name] = {"size": size, "rank": int(name[4:9])}
        if checksums:
            files[name]["header_crc32c"] = f"{index.header_crcs[name]:08x}"
    tensors: Dict[str, Any] = {}
    for key in sorted(index.tensors):
        t = index.tensors[key]
        shards = []
        for s in t.shards:
            shard: Dict[str, Any] = {
                "file": s.file,
                "name": s.name,
                "global_offset": list(s.global_offset),
                "chunk_shape": list(s.chunk_shape),
                "flat_range": None if s.flat_range is None else list(s.flat_range),
                "byte_range": list(s.byte_range),
            }
            if checksums:
                shard["crc32c"] = encode_block_crcs(s.crcs or ())
            shards.append(shard)
        tensors[key] = {"dtype": dtype_to_name(t.dtype), "global_shape": list(t.global_shape), "shards": shards}
        if t.flattened:
            tensors[key]["flattened"] = True
    doc: Dict[str, Any] = {"format": "dist_ckpt.safetensors", "version": 2 if checksums else 1}
    if checksums:
        doc["checksum"] = {"algorithm": "crc32c", "block_bytes": index.block_bytes}
    doc.update(files=files, tensors=tensors)
    return doc


def write_index_document(checkpoint: Path, doc: Dict[str, Any]) -> None:
    """Write ``doc`` as the index of ``checkpoint`` and update its integrity record in
    ``metadata.json`` to match (as the save that wrote such an index recorded it; for a test of
    the parser, a consistent forgery), so that the parser, not the record check, sees it."""
    (checkpoint / SAFETENSORS_DIR / INDEX_FILENAME).write_text(json.dumps(doc))
    if (checkpoint / "metadata.json").is_file():
        refresh_record(LocalStorage(checkpoint), f"{SAFETENSORS_DIR}/{INDEX_FILENAME}")


def write_legacy_index(checkpoint: Path) -> Dict[str, Any]:
    """Replace the index of ``checkpoint`` by its version-1/2 form (the shard table is removed,
    the integrity record updated); return it."""
    doc = legacy_document(checkpoint)
    write_index_document(checkpoint, doc)
    for table in (checkpoint / SAFETENSORS_DIR).glob("index.*.bin"):
        table.unlink()
    return doc


def downgrade_index_to_v1(checkpoint: Path) -> None:
    """Rewrite the index of ``checkpoint`` as version 1 (no checksums), leaving ``metadata.json``
    as the save wrote it: a downgrade that would switch verification off."""
    doc = legacy_document(checkpoint, checksums=False)
    (checkpoint / SAFETENSORS_DIR / INDEX_FILENAME).write_text(json.dumps(doc))
