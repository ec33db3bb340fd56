"""The TensorStore engine for the zarr backend (``zarr``, version 1).

It reads and writes exactly the layout of `dist_ckpt.backends.zarr.layout` -- zarr v3, one chunk per saved
shard, one 1-D fragment array per flattened shard, the same ``dist_ckpt`` attributes -- with
TensorStore instead of zarr-python, so a checkpoint written by either engine loads with the
other, bit for bit, for every dtype of `dist_ckpt.model.dtypes`.

Why a second engine: TensorStore runs I/O on its own thread pool and returns futures. A rank
issues all its reads (or writes) before waiting for any, so they proceed concurrently, and a
whole-chunk read lands directly in the destination tensor without a staging copy.

Missing data is never read as zeros: arrays are opened with ``fill_missing_data_reads=False``
(a missing chunk fails the read), and a failed read is reported as a
[`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError] naming the key and the damaged chunk file.

Local disks: chunks of plain bytes are read and written, and array metadata written, without
TensorStore (`dist_ckpt.backends.zarr.direct`: a whole chunk read straight into its
destination, a part of one, a strided view or a dtype conversion through a buffer of the chunk,
checked from the bytes read); TensorStore reads the rest (fragments of flattened tensors, other
codecs) and does all the I/O on object stores.

Checksums: saves end with ``zarr/checksums.json``, like the zarr-python engine's. TensorStore
decodes chunks in its own threads without showing their bytes, so for the reads TensorStore does
the loader checks every chunk file by reading it once before TensorStore does (a second pass over
those bytes, the second one from the page cache); ``verify_checksums=False`` skips it (see
`dist_ckpt.backends.zarr.checksums`).

Object stores: an ``s3://`` checkpoint is written and read by TensorStore's own ``s3`` kvstore
driver, configured from the checkpoint's ``S3Storage``
([`tensorstore_kvstore()`][dist_ckpt.storage.s3.S3Storage.tensorstore_kvstore]: bucket, path, region, endpoint,
retries; credentials from the same AWS environment). Chunks are PUT whole
(``store_data_equal_to_fill_value=True``: an all-zero chunk is written, never deleted), nothing
is fsynced, and -- since TensorStore never shows the bytes -- both the save's digests and the
load's checksum verification download each chunk object once more (pass
``verify_checksums=False`` to load without the second download).

The engine is three modules: `tensorstore_save` (the save), `tensorstore_load` (the load) and
`tensorstore_arrays` (the one module that imports TensorStore: contexts, specs, opening arrays).
This module is the engine's public face: its strategies and helpers, the names Megatron-Core's
``strategies.tensorstore`` has, and `register_default_tensorstore_strategies()`.

Selecting it (the zarr-python engine stays the registered default):

```python
from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreLoadShardedStrategy
dc.load(sd, "ckpt", sharded_strategy=TensorStoreLoadShardedStrategy())
register_default_tensorstore_strategies()  # or: make it the default loader, as Megatron does
```
"""

from __future__ import annotations

from dist_ckpt.backends.registry import StrategyAction, register_default_strategy
from dist_ckpt.backends.zarr.tensorstore_arrays import merge_global_slice_with_shape, open_ts_array
from dist_ckpt.backends.zarr.tensorstore_load import TensorStoreLoadShardedStrategy
from dist_ckpt.backends.zarr.tensorstore_save import TensorStoreSaveShardedStrategy

__all__ = [
    "TensorStoreLoadShardedStrategy",
    "TensorStoreSaveShardedStrategy",
    "merge_global_slice_with_shape",
    "open_ts_array",
    "register_default_tensorstore_strategies",
]


def register_default_tensorstore_strategies(include_save: bool = False) -> None:
    """Make TensorStore the default loader of the zarr backend ``("zarr", 1)``, as Megatron-Core
    does (``override=True``: it replaces the zarr-python loader); with ``include_save`` also the
    default saver.

    Example:

    ```python
    register_default_tensorstore_strategies()
    dc.load(sd, "ckpt")          # now reads with TensorStore
    ```
    """
    register_default_strategy(StrategyAction.LOAD_SHARDED, "zarr", 1, TensorStoreLoadShardedStrategy, override=True)
    if include_save:
        register_default_strategy(StrategyAction.SAVE_SHARDED, "zarr", 1, TensorStoreSaveShardedStrategy, override=True)
