"""Checkpoint directories over time on an object store (``s3://bucket/run``): the object-store
half of :mod:`dist_ckpt.training.checkpoints`.

The public functions of :mod:`dist_ckpt.training.checkpoints` call these when ``model_dir`` (or a
checkpoint path) is an object-store URL or storage; the rules are the same as on disk (names,
order, completeness by commit marker), only the mechanics differ:

* **Listing.** A run's checkpoints are the "directories" directly under its prefix
  (:meth:`~dist_ckpt.storage.base.Storage.list_dirs`, S3's common prefixes): one request, not a
  listing of every object of every checkpoint.
* **Completeness.** A committed ``metadata.json`` (read through the storage), else HF weights
  checked as on disk: a safetensors object's size must match its header (two ranged reads), a
  torch zip must end with its central directory (one ranged read of the tail).
* **Deletion.** Object stores have no rename, so a checkpoint cannot be moved aside in one step.
  Its commit markers (``metadata.json`` and the HF index / weights names) are deleted *first*:
  from then on it is partial, so a crash in the middle of a deletion leaves a directory that
  :func:`find_latest_checkpoint` skips and the next rotation removes (a partial directory below
  the newest complete one). Then every object under it is deleted.
* **No symlinks.** Object stores have none: ``create_pretrained_symlinks`` refuses object-store
  run directories, and no checkpoint is kept "because a link points into it".
"""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence, Set, Tuple

from dist_ckpt.engine.commit import METADATA_FILENAME, CheckpointingConfig, maybe_load_config
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.storage.base import RangeRead, Storage
from dist_ckpt.storage.errors import ObjectNotFoundError, StorageError
from dist_ckpt.training.hf_weights import MAX_SAFETENSORS_HEADER, data_end, shard_names

logger = logging.getLogger(__name__)

#: HuggingFace weight files ``(file name, is_index, safetensors)``, in the order they decide a
#: directory's format (shared with :mod:`dist_ckpt.training.checkpoints`)
HF_FILES: Tuple[Tuple[str, bool, bool], ...] = (
    ("model.safetensors.index.json", True, True),
    ("model.safetensors", False, True),
    ("pytorch_model.bin.index.json", True, False),
    ("pytorch_model.bin", False, False),
)
_ZIP_EOCD = b"PK\x05\x06"  # end of central directory record
_ZIP_TAIL = 22 + 65535  # the record plus the longest comment


def checkpoint_names(storage: Storage, step_of: Callable[[str], Optional[int]]) -> List[Tuple[int, str]]:
    """``(step, name)`` of the directories under ``storage`` whose names carry a step, oldest first."""
    entries = []
    for name in storage.list_dirs():
        step = step_of(name)
        if step is not None:
            entries.append((step, name))
    return sorted(entries)


def _read_range(storage: Storage, key: str, offset: int, length: int) -> bytes:
    out = bytearray(length)
    storage.read_ranges([RangeRead.into(key, offset, out)])
    return bytes(out)


def safetensors_whole(storage: Storage, key: str) -> bool:
    """Whether object ``key``'s size is exactly what its safetensors header describes."""
    try:
        size = storage.size(key)
        if size < 8:
            return False
        (header_len,) = struct.unpack("<Q", _read_range(storage, key, 0, 8))
        if header_len > min(size - 8, MAX_SAFETENSORS_HEADER):
            return False
        header = json.loads(_read_range(storage, key, 8, header_len))
    except (ObjectNotFoundError, ValueError):
        return False
    end = data_end(header)
    return end is not None and size == 8 + header_len + end


def torch_file_whole(storage: Storage, key: str) -> bool:
    """Whether a torch.save object is whole: a zip whose central directory is at its end, or a
    non-empty legacy pickle."""
    try:
        size = storage.size(key)
        if size == 0:
            return False
        if _read_range(storage, key, 0, min(4, size)) != b"PK\x03\x04":
            return True  # legacy (pre-zip) format: cannot be checked without unpickling
        tail_len = min(size, _ZIP_TAIL)
        return _ZIP_EOCD in _read_range(storage, key, size - tail_len, tail_len)
    except ObjectNotFoundError:
        return False


def index_shards(storage: Storage, key: str) -> Optional[List[str]]:
    """The shard files an HF index object lists (sorted), or None if the index is unreadable."""
    try:
        return shard_names(json.loads(storage.read(key)))
    except (ObjectNotFoundError, ValueError):
        return None


def _weights_whole(storage: Storage, key: str) -> bool:
    return safetensors_whole(storage, key) if key.endswith(".safetensors") else torch_file_whole(storage, key)


@dataclass(frozen=True)
class Found:
    """What :func:`inspect_checkpoint` found under a checkpoint prefix (the caller makes a CheckpointMeta of it)."""

    file_name: str
    is_index: bool
    safetensors: bool
    hf: bool
    complete: bool
    config: Optional[CheckpointingConfig] = None


def inspect_checkpoint(storage: Storage, common_name: str) -> Optional[Found]:
    """Format and completeness of the checkpoint under ``storage`` (None: no checkpoint there).

    Raises:
        StorageError: the store refused a request (credentials, missing bucket, retries
            exhausted): never taken for "no checkpoint".
    """
    try:
        config = maybe_load_config(storage)
    except StorageError:
        raise
    except CheckpointingException as e:
        logger.debug("%s is not committed: %s", storage.url, e)
        return Found(METADATA_FILENAME, False, False, False, False)
    if config is not None:
        return Found(METADATA_FILENAME, False, False, False, True, config)
    if storage.exists(common_name):
        return None  # a dist_ckpt save that has not committed: no checkpoint yet
    for file_name, is_index, safetensors in HF_FILES:
        if not storage.exists(file_name):
            continue
        if is_index:
            shards = index_shards(storage, file_name)
            complete = shards is not None and all(_weights_whole(storage, s) for s in shards)
        else:
            complete = _weights_whole(storage, file_name)
        return Found(file_name, is_index, safetensors, True, complete)
    return None


def delete_checkpoint(storage: Storage, name: str) -> None:
    """Delete the checkpoint ``name`` under ``storage``: commit markers first (module docstring)."""
    checkpoint = storage.child(name)
    for marker in (METADATA_FILENAME, *(file_name for file_name, _, _ in HF_FILES)):
        checkpoint.delete(marker)
    removed = checkpoint.delete_prefix("")
    logger.debug("deleted %d objects under %s", removed, checkpoint.url)


def protected_names(storage: Storage, names: Iterable[str], wanted: Sequence[object]) -> Set[str]:
    """Names among ``names`` that ``wanted`` designates: a bare name, or the URL of a checkpoint
    under ``storage`` (trailing slashes ignored)."""
    known = set(names)
    by_url = {storage.url_of(n).rstrip("/"): n for n in known}
    found = set()
    for item in wanted:
        text = item.url if isinstance(item, Storage) else str(item)
        name = text if text in known else by_url.get(text.rstrip("/"))
        if name is None:
            logger.warning("preserved checkpoint %s is not a checkpoint directory of %s", text, storage.url)
        else:
            found.add(name)
    return found


def prefix_exists(storage: Storage) -> bool:
    """Whether any object lives under ``storage``'s prefix (an object store's "directory exists")."""
    return bool(storage.list_dirs()) or bool(storage.list())
