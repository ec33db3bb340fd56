"""Writing the safetensors index (rank 0, after every rank's files are durable), and rewriting a
version-3 index without some tensors.

The shard table (``index.<crc>.bin``) is written first, then ``index.json``, each whole or not
at all ([`write()`][dist_ckpt.storage.base.Storage.write]: a durable rename on a local disk, a PUT
on an object store); since a table's name is the crc of its content, a rewritten index never
changes the table an older ``index.json`` names, and a crash leaves either the old pair or the
new one.

Example:

```python
write_index(gather_bytes(part.encode(results, True)), LocalStorage("ckpt/iter_10"), block_bytes=1 << 20)
```
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from dist_ckpt.backends.safetensors.index import INDEX_FILENAME, SAFETENSORS_DIR, index_files, read_index
from dist_ckpt.backends.safetensors.index_parts import COLUMNS, MergedIndex, merge_index_parts
from dist_ckpt.backends.safetensors.index_v3 import is_table_file
from dist_ckpt.backends.safetensors.tensor_index import TensorIndex
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.model.dtypes import dtype_to_name
from dist_ckpt.storage import Storage

__all__ = ["merged_from_index", "remove_from_v3", "write_index", "write_merged"]

logger = logging.getLogger(__name__)


def write_index(gathered: Optional[Sequence[bytes]], checkpoint_dir: Storage, block_bytes: Optional[int]) -> None:
    """Rank 0: merge every rank's index part (``gathered[r]`` from rank r) and write the index
    (the other ranks return at once).

    Example:

    ```python
    write_index(gather_bytes(local_part), storage, 1 << 20)
    ```
    """
    if get_rank() != 0:
        return
    assert gathered is not None, "gather_bytes gives rank 0 every rank's part"
    write_merged(merge_index_parts(gathered), checkpoint_dir, block_bytes)


def write_merged(merged: MergedIndex, checkpoint_dir: Storage, block_bytes: Optional[int]) -> str:
    """Write the shard table, then ``index.json`` (a save without tensor bytes gets both too);
    returns the table's file name.

    Example:

    ```python
    write_merged(merge_index_parts(parts), LocalStorage("ckpt/iter_10"), None)   # "index.1a2b3c4d.bin"
    ```
    """
    doc, table, table_name = index_files(merged, block_bytes)
    checkpoint_dir.write(f"{SAFETENSORS_DIR}/{table_name}", table)
    checkpoint_dir.write(f"{SAFETENSORS_DIR}/{INDEX_FILENAME}", doc)
    logger.debug(
        "safetensors index: %d tensors, %d files, %d shards, %d bytes of data, %d + %d index bytes",
        len(merged.keys),
        len(merged.files),
        merged.rows.shape[0],
        sum(size for _, size, _, _ in merged.files),
        len(doc),
        len(table),
    )
    return table_name


def merged_from_index(index: TensorIndex, keep: Callable[[str], bool]) -> MergedIndex:
    """The kept tensors of a read index as a `MergedIndex` (files no kept shard uses are left out)."""
    keys = sorted(k for k in index.tensors if keep(k))
    width = max((len(index.tensors[k].global_shape) for k in keys), default=0)
    rows: List[List[int]] = []
    crcs: List[int] = []
    key_rows, key_blocks = [], []
    file_ids: Dict[str, int] = {}
    for key in keys:
        tensor = index.tensors[key]
        key_rows.append((len(rows), len(tensor.shards)))
        first_crc = len(crcs)
        for s in tensor.shards:
            file = file_ids.setdefault(s.file, len(file_ids))
            flat = s.flat_range or (-1, -1)
            pad = [0] * (width - len(s.global_offset))
            rows.append([file, *flat, *s.byte_range, *s.global_offset, *pad, *s.chunk_shape, *pad])
            crcs.extend(s.crcs or ())
        key_blocks.append((first_crc, len(crcs) - first_crc))
    ranks = _file_ranks(index)
    files: List[Tuple[str, int, int, Optional[int]]] = [
        (name, index.file_sizes[name], ranks.get(name, 0), index.header_crcs.get(name)) for name in file_ids
    ]
    return MergedIndex(
        files=files,
        keys=keys,
        dtypes=[dtype_to_name(index.tensors[k].dtype) for k in keys],
        shapes=[tuple(index.tensors[k].global_shape) for k in keys],
        flattened=[index.tensors[k].flattened for k in keys],
        ndim=width,
        rows=np.asarray(rows, dtype=np.int64).reshape(len(rows), len(COLUMNS) + 2 * width),
        key_rows=np.asarray(key_rows, dtype=np.int64).reshape(len(keys), 2),
        crcs=np.asarray(crcs, dtype=np.uint32),
        key_blocks=np.asarray(key_blocks, dtype=np.int64).reshape(len(keys), 2),
        checksums=index.block_bytes is not None,
    )


def _file_ranks(index: TensorIndex) -> Dict[str, int]:
    """The rank that wrote each file, from its name (``rank<rank>_<writer>.safetensors``)."""
    ranks = {}
    for name in index.file_sizes:
        head = name.split("_", 1)[0]
        if head.startswith("rank") and head[4:].isdigit():
            ranks[name] = int(head[4:])
    return ranks


def remove_from_v3(location: Storage, key_prefix: str) -> Tuple[List[str], List[str]]:
    """Rewrite a version-3 index without the tensors whose key starts with ``key_prefix``, then
    delete the files no remaining shard uses and the old shard table. Returns (removed keys,
    deleted files).

    Example:

    ```python
    removed, deleted = remove_from_v3(LocalStorage("ckpt/iter_10"), "optimizer.")
    ```
    """
    index = read_index(location)
    for tensor in index.tensors.values():
        tensor.shards  # noqa: B018 -- reads and checks every tensor's rows before anything changes
    removed = sorted(k for k in index.tensors if k.startswith(key_prefix))
    merged = merged_from_index(index, lambda k: not k.startswith(key_prefix))
    old_tables = _table_files(location)
    new_table = write_merged(merged, location, index.block_bytes)
    used = {name for name, _, _, _ in merged.files}
    orphans = [name for name in index.file_sizes if name not in used]
    stale = [name for name in old_tables if name != new_table]
    root = location.child(SAFETENSORS_DIR)
    for name in orphans + stale:
        root.delete(name)
    return removed, orphans


def _table_files(location: Storage) -> List[str]:
    """The shard tables in ``safetensors/`` (the current one and any left by an interrupted rewrite)."""
    return sorted(o.key for o in location.child(SAFETENSORS_DIR).list() if is_table_file(o.key))
