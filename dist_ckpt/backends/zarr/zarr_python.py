"""The Zarr backend (``zarr``, version 1): zarr v3 arrays written with zarr-python 3 (on local disks,
their plain chunk files and metadata directly: `dist_ckpt.backends.zarr.direct`).

Layout inside a checkpoint directory (every node is plain zarr v3, uncompressed little-endian
``bytes`` codec, so TensorStore and any zarr v3 reader open it):

```text
zarr/zarr.json                          root group
zarr/<key>/zarr.json                    a tensor saved as a regular grid of shards:
zarr/<key>/c.<i>.<j>...                   one zarr chunk per saved shard (c/<i>/<j> before 2026-11)
zarr/<key>/zarr.json                    a tensor saved as flattened ranges (distributed
zarr/<key>/<chunk>_<start>/...            optimizer): a group of 1-D fragment arrays
```

A chunk is exactly one main-replica shard, so each chunk file is written once, by one rank, with
no read-modify-write. Flattened shards cannot be chunk-aligned (their boundaries are arbitrary),
so each becomes its own 1-D array. Array attributes carry ``{"dist_ckpt": {...}}``: the key,
the dtype name, and for fragments their global offset and flat range.

Loads read only the chunks that overlap the requested shard. zarr-python returns the fill value
for a missing chunk; the loader checks that every chunk it reads exists, so a deleted chunk is
reported instead of silently read as zeros.

Checksums: the save ends with ``zarr/checksums.json``, a crc32c of every file under ``zarr/``
(see `dist_ckpt.backends.zarr.checksums`); the loader checks every file it reads against it, from the bytes
zarr-python reads (no extra I/O).

Object stores: an ``s3://`` checkpoint is written and read by zarr-python itself, through
``zarr.storage.ObjectStore`` over the obstore client of the checkpoint's ``S3Storage`` (same
endpoint, credentials, retries): each chunk is one object, PUT once by one rank. Nothing is
fsynced there (an object is durable when its PUT returns), and the save digests each object from
the bytes zarr-python hands the store, not by downloading it again.

The engine is three modules: `zarr_python_save` (the save, and streaming whole tensors),
`zarr_python_load` (the load, and removing stored tensors) and `zarr_python_stores` (the stores
zarr-python reads and writes through). This module is the engine's public face: its strategies,
the names Megatron-Core's ``strategies.zarr`` has, and `register_default_zarr_strategies()`.
"""

from __future__ import annotations

from dist_ckpt.backends.zarr.megatron import (
    flatten_range,
    load_zarr_based_sharded_metadata,
    pad_to_expected_shape,
    postprocess_numpy_array,
)
from dist_ckpt.backends.zarr.zarr_python_load import ZarrLoadShardedStrategy
from dist_ckpt.backends.zarr.zarr_python_save import ZarrSaveShardedStrategy

__all__ = [
    "ZarrLoadShardedStrategy",
    "ZarrSaveShardedStrategy",
    "flatten_range",
    "load_zarr_based_sharded_metadata",
    "pad_to_expected_shape",
    "postprocess_numpy_array",
    "register_default_zarr_strategies",
]


def register_default_zarr_strategies() -> None:
    """Make the Zarr strategies the defaults for ``("zarr", 1)`` (they already are, lazily)."""
    from dist_ckpt.backends.registry import StrategyAction, register_default_strategy

    register_default_strategy(StrategyAction.SAVE_SHARDED, "zarr", 1, ZarrSaveShardedStrategy, override=True)
    register_default_strategy(StrategyAction.LOAD_SHARDED, "zarr", 1, ZarrLoadShardedStrategy, override=True)
