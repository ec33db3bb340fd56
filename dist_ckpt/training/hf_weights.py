"""Whether the HuggingFace weight files of a checkpoint are whole, on a disk or an object store.

Cheap structural checks through the checkpoint's storage, no tensor is read: a safetensors file's
size must be what its header describes (`dist_ckpt.backends.safetensors.is_whole()`: two
small reads), a torch.save zip must still end with its central directory (one read of the tail:
a truncated one has lost it), an HF index must list shard files inside the directory.
[`dist_ckpt.training.checkpoints`][dist_ckpt.training.checkpoints] uses them to tell a complete HF checkpoint from one
whose save was interrupted.

Example:

```python
weights_file_whole(open_storage("runs/gpt/checkpoint-1000"), "model.safetensors")   # True
```
"""

from __future__ import annotations

from typing import List, Optional

from dist_ckpt.backends.safetensors import is_whole
from dist_ckpt.backends.safetensors.io import read_bytes
from dist_ckpt.integrity.safe_json import MAX_SMALL_JSON_BYTES, loads
from dist_ckpt.storage import ObjectReader, Storage

__all__ = ["index_shards", "plain_name", "shard_names", "torch_file_whole", "weights_file_whole"]

_ZIP_LOCAL = b"PK\x03\x04"  # the first local file header
_ZIP_EOCD = b"PK\x05\x06"  # end of central directory record
_ZIP_EOCD_BYTES = 22  # the record without its comment
_ZIP_TAIL = _ZIP_EOCD_BYTES + 65535  # the record plus the longest comment


def plain_name(name: object) -> bool:
    """Whether ``name`` is a file name inside the directory (no separators, not . or ..)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


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


def torch_file_whole(reader: ObjectReader) -> bool:
    """Whether a torch.save file is whole: a zip whose end of central directory record is in
    its tail (as `zipfile.is_zipfile()` looks for it), or a non-empty legacy pickle."""
    size = reader.size()
    if size == 0:
        return False
    if read_bytes(reader, min(len(_ZIP_LOCAL), size), 0) != _ZIP_LOCAL:
        return True  # legacy (pre-zip) format: cannot be checked without unpickling
    tail_len = min(size, _ZIP_TAIL)
    tail = read_bytes(reader, tail_len, size - tail_len)
    found = tail.rfind(_ZIP_EOCD)
    return found >= 0 and tail_len - found >= _ZIP_EOCD_BYTES


def index_shards(storage: Storage, key: str) -> Optional[List[str]]:
    """The shard files the HF index ``key`` lists (sorted), or None if the index is unreadable."""
    try:
        return shard_names(loads(storage.read(key), storage.url_of(key), MAX_SMALL_JSON_BYTES))
    except (OSError, ValueError):  # a missing object is an OSError, CorruptCheckpointError a ValueError
        return None


def weights_file_whole(storage: Storage, key: str) -> bool:
    """Whether ``key`` exists and is a whole safetensors or torch.save file (by its name)."""
    try:
        with storage.open_reader(key) as reader:
            return is_whole(reader) if key.endswith(".safetensors") else torch_file_whole(reader)
    except (OSError, EOFError, ValueError):  # missing, a directory, unreadable
        return False
