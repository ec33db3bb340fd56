"""Whether the HuggingFace weight files of a checkpoint directory on disk are whole.

Cheap structural checks, no tensor is read: a safetensors file's size must be what its header
describes, a torch.save zip must still have its central directory (a truncated one has lost
it), an HF index must list shard files inside the directory. :mod:`dist_ckpt.training.checkpoints` uses
them to tell a complete HF checkpoint from one whose save was interrupted;
:mod:`dist_ckpt.training.object_store_runs` does the same on object stores with ranged reads.

Example::

    weights_file_whole(Path("runs/gpt/checkpoint-1000/model.safetensors"))   # True
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import List, Optional

__all__ = [
    "MAX_SAFETENSORS_HEADER",
    "data_end",
    "index_shards",
    "plain_name",
    "safetensors_file_whole",
    "shard_names",
    "torch_file_whole",
    "weights_file_whole",
]

#: the largest safetensors header a weight file may declare (the safetensors library's limit)
MAX_SAFETENSORS_HEADER = 100_000_000


def plain_name(name: object) -> bool:
    """Whether ``name`` is a file name inside the directory (no separators, not . or ..)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def data_end(header: object) -> Optional[int]:
    """The end of the data a parsed safetensors header describes (bytes after the header), or
    None if the header is malformed. A whole file is ``8 + header length + data_end`` bytes."""
    if not isinstance(header, dict):
        return None
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            return None
        end = max(end, offsets[1])
    return end


def shard_names(record: object) -> Optional[List[str]]:
    """The shard files a parsed HF index lists (sorted), or None if it lists none or any
    outside the directory (such a shard is not part of this checkpoint)."""
    weight_map = record.get("weight_map") if isinstance(record, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        return None
    shards = set(weight_map.values())
    if not all(plain_name(s) for s in shards):
        return None
    return sorted(shards)


def safetensors_file_whole(file: Path) -> bool:
    """Whether the file's size is exactly what its safetensors header describes."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                return False
            header_len = int.from_bytes(prefix, "little")
            if header_len > min(size - 8, MAX_SAFETENSORS_HEADER):
                return False
            header = json.loads(f.read(header_len))
    except (OSError, ValueError):
        return False
    end = data_end(header)
    return end is not None and size == 8 + header_len + end


def torch_file_whole(file: Path) -> bool:
    """Whether a torch.save file is whole: a zip with its central directory, or a legacy pickle."""
    try:
        with open(file, "rb") as f:
            magic = f.read(4)
    except OSError:
        return False
    if magic == b"PK\x03\x04":
        return zipfile.is_zipfile(file)  # a truncated zip has lost its central directory
    return len(magic) > 0  # legacy (pre-zip) format: cannot be checked without unpickling


def index_shards(index_file: Path) -> Optional[List[str]]:
    """The shard files an HF index lists (sorted), or None if the index is unreadable."""
    try:
        return shard_names(json.loads(index_file.read_bytes()))
    except (OSError, ValueError):
        return None


def weights_file_whole(file: Path) -> bool:
    """Whether ``file`` exists and is a whole safetensors or torch.save file (by its name)."""
    if not file.is_file():
        return False
    return safetensors_file_whole(file) if file.name.endswith(".safetensors") else torch_file_whole(file)
