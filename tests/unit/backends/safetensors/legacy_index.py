"""Rewrite a checkpoint's safetensors index as version 1 or 2 (JSON per shard), for tests.

Saves write index version 3; versions 1 and 2 are still read (the golden checkpoints hold one of
each). Tests of the version-1/2 parser corrupt such documents, so they rewrite a fresh
checkpoint's index in the older layout first -- exactly what dist_ckpt wrote before version 3.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

from dist_ckpt.backends.safetensors.index import INDEX_FILENAME, SAFETENSORS_DIR, read_index
from dist_ckpt.integrity.checksums import encode_block_crcs
from dist_ckpt.model.dtypes import dtype_to_name


def legacy_document(checkpoint: Path) -> Dict[str, Any]:
    """The index of ``checkpoint`` as a version-2 document (version 1 when it has no checksums)."""
    index = read_index(checkpoint)
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


def write_legacy_index(checkpoint: Path) -> Dict[str, Any]:
    """Replace the index of ``checkpoint`` by its version-1/2 form (the shard table is removed); return it."""
    doc = legacy_document(checkpoint)
    root = checkpoint / SAFETENSORS_DIR
    (root / INDEX_FILENAME).write_text(json.dumps(doc))
    for table in root.glob("index.*.bin"):
        table.unlink()
    return doc
