"""Exchange of shard metadata between ranks: one compact binary table per rank, never a pickle.

Each rank describes its ShardedTensors and ShardedObjects (data excluded) as a
`ShardTable` and sends it as bytes (a few dozen per shard,
zlib-compressed columns; see `dist_ckpt.model.columns`). The receiver decodes every rank's
bytes into one table with numpy -- identical key tables, as the ranks of one pipeline stage
send, are decoded once -- and checks it without building a Python object per shard. Only
Megatron-Core's API (`all_gather_metadata()`, `gather_metadata()`), which returns
ShardedBase lists, turns the rows back into objects.

Example:

```python
table = gather_shard_tables(ShardTable.from_shards(local_metadata, get_rank()))   # rank 0: every rank's
```
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from dist_ckpt.collectives.distributed import ProcessGroup, all_gather_bytes, gather_bytes, get_rank, get_world_size
from dist_ckpt.model.shard_table import (
    ShardTable,
    concat_tables,
    decode_table,
    dtype_from_token,
    dtype_token,
    encode_table,
)
from dist_ckpt.model.sharded import ShardedBase

__all__ = [
    "all_gather_metadata",
    "all_gather_shard_tables",
    "decode_tables",
    "dtype_from_token",
    "dtype_token",
    "gather_metadata",
    "gather_shard_tables",
]


def decode_tables(blobs: Sequence[bytes]) -> ShardTable:
    """One table of every rank's encoded table (``blobs[r]`` from group rank r)."""
    cache: Dict[bytes, List[str]] = {}
    tables = [decode_table(b, rank, f"shard metadata from rank {rank}", cache) for rank, b in enumerate(blobs)]
    return concat_tables(tables)


def gather_shard_tables(local: ShardTable, dst: int = 0, group: Optional[ProcessGroup] = None) -> Optional[ShardTable]:
    """Collective: every rank's table, concatenated in rank order, on group rank ``dst`` (None elsewhere)."""
    blobs = gather_bytes(encode_table(local), dst, group)
    return None if blobs is None else decode_tables(blobs)


def all_gather_shard_tables(local: ShardTable, group: Optional[ProcessGroup] = None) -> ShardTable:
    """Collective: every rank's table, concatenated in rank order, on every rank."""
    return decode_tables(all_gather_bytes(encode_table(local), group))


def all_gather_metadata(
    local_metadata: Sequence[ShardedBase], group: Optional[ProcessGroup] = None
) -> List[List[ShardedBase]]:
    """Every rank's shard metadata on every rank (use sparingly: O(world * shards) per rank)."""
    local = ShardTable.from_shards(local_metadata, get_rank(group))
    return all_gather_shard_tables(local, group).to_shards(get_world_size(group))


def gather_metadata(
    local_metadata: Sequence[ShardedBase], dst: int = 0, group: Optional[ProcessGroup] = None
) -> Optional[List[List[ShardedBase]]]:
    """Every rank's shard metadata on rank ``dst`` only (None on the others)."""
    gathered = gather_shard_tables(ShardTable.from_shards(local_metadata, get_rank(group)), dst, group)
    return None if gathered is None else gathered.to_shards(get_world_size(group))
