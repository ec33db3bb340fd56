"""Removing tensors from a committed torch_dist checkpoint (``remove_sharded_tensors``; one process).

Megatron-Core removes only the ``.distcp`` files whose *names* start with the prefix (those of a
``separation_hint``) and warns otherwise; here every stored key that starts with the prefix goes,
wherever its items lie:

1. the checkpoint is opened as a load opens it (``.metadata`` through the restricted unpickler,
   checked against the checksum manifest), so a damaged checkpoint is refused before any change;
2. ``.metadata`` is rewritten without those keys (their tensors, bytes entries, storage entries and
   ``mcore_data``; Megatron-Core's ``all_local_plans``, which described the old save, are dropped),
   as a plain DCP ``Metadata`` with ``mcore_data`` as an attribute (what DCP, every megatron-core
   since 0.13 and dist_ckpt read), atomically;
3. the checksum manifest gets the new ``.metadata``'s crc and loses the files deleted in step 4,
   and ``metadata.json`` (or ``dist_ckpt.json``) the new record of the manifest;
4. files that hold no remaining item are deleted. Bytes of removed items in files that still hold
   others stay until the checkpoint is rewritten.

Each step replaces a whole file; a crash between steps 2 and 3 leaves a checkpoint whose manifest
no longer matches its ``.metadata``: it fails closed (``ChecksumMismatchError``) rather than
loading something else. Removing again finishes nothing then: restore from another checkpoint.

Example:

```python
remove_tensors(open_checkpoint("ckpt/iter_10"), "optimizer.")
```
"""

from __future__ import annotations

import logging
import pickle
from typing import TYPE_CHECKING, Dict, List

from torch.distributed.checkpoint.metadata import Metadata

from dist_ckpt.backends.torch_dist.checksums import CHECKSUMS_FILENAME, MARK_ATTRIBUTE, FileSpans, manifest_json
from dist_ckpt.backends.torch_dist.metadata import DCP_METADATA_FILENAME, mcore_data
from dist_ckpt.integrity.checksums import crc32c
from dist_ckpt.record.records import refresh_record

if TYPE_CHECKING:  # load.py imports this module
    from dist_ckpt.backends.torch_dist.load import OpenedCheckpoint

__all__ = ["remove_tensors"]

logger = logging.getLogger(__name__)


def _without(md: Metadata, key_prefix: str) -> Metadata:
    """``md`` without the keys that start with ``key_prefix``, as a plain DCP Metadata."""
    kept = {k: v for k, v in md.state_dict_metadata.items() if not k.startswith(key_prefix)}
    storage_data = md.storage_data
    if isinstance(storage_data, dict):
        storage_data = {i: v for i, v in storage_data.items() if not i.fqn.startswith(key_prefix)}
    planner_data = md.planner_data
    if isinstance(planner_data, dict):
        planner_data = {k: v for k, v in planner_data.items() if not str(k).startswith(key_prefix)}
    out = Metadata(
        state_dict_metadata=kept,
        planner_data=planner_data,
        storage_data=storage_data,
        storage_meta=md.storage_meta,
        version=md.version,
    )
    extra = {k: v for k, v in mcore_data(md).items() if not k.startswith(key_prefix)}
    if extra:
        out.mcore_data = extra  # type: ignore[attr-defined]  # megatron-core 0.13-0.14 and dist_ckpt's place
    mark = getattr(md, MARK_ATTRIBUTE, None)
    if mark is not None:
        setattr(out, MARK_ATTRIBUTE, mark)
    return out


def _files_in_use(md: Metadata) -> List[str]:
    data = md.storage_data if isinstance(md.storage_data, dict) else {}
    return sorted({getattr(info, "relative_path", "") for info in data.values()} - {""})


def remove_tensors(opened: "OpenedCheckpoint", key_prefix: str) -> List[str]:
    """Remove every stored key starting with ``key_prefix`` from the checkpoint ``opened`` (step 1
    of the module docstring: opened with its checksums verified); return the keys removed."""
    storage, md = opened.storage, opened.layout.metadata
    removed = sorted(k for k in md.state_dict_metadata if k.startswith(key_prefix))
    if not removed:
        logger.info("no stored key of %s starts with %r: nothing removed", storage.url, key_prefix)
        return []
    before, new = _files_in_use(md), _without(md, key_prefix)
    orphans = sorted(set(before) - set(_files_in_use(new)))
    raw = pickle.dumps(new, protocol=pickle.HIGHEST_PROTOCOL)
    storage.write(DCP_METADATA_FILENAME, raw)
    if opened.manifest is not None:
        files: Dict[str, FileSpans] = {n: s for n, s in opened.manifest.items() if n not in orphans}
        files[DCP_METADATA_FILENAME] = FileSpans(len(raw), ((0, len(raw), crc32c(raw)),))
        storage.write(CHECKSUMS_FILENAME, manifest_json(files))
        refresh_record(storage, CHECKSUMS_FILENAME)
    for name in orphans:
        storage.delete(name)
    logger.info(
        "removed %d keys with prefix %r from %s; deleted %d files", len(removed), key_prefix, storage.url, len(orphans)
    )
    return removed
