"""Megatron-Core module path ``dist_ckpt.strategies.tensorstore``:
re-exports [`dist_ckpt.backends.zarr.tensorstore_engine`][dist_ckpt.backends.zarr.tensorstore_engine].

Code written for ``megatron.core.dist_checkpointing.strategies.tensorstore`` imports from here unchanged.
"""

from dist_ckpt.backends.zarr.tensorstore_engine import (
    TensorStoreLoadShardedStrategy,
    TensorStoreSaveShardedStrategy,
    merge_global_slice_with_shape,
    open_ts_array,
    register_default_tensorstore_strategies,
)

__all__ = [
    "TensorStoreLoadShardedStrategy",
    "TensorStoreSaveShardedStrategy",
    "merge_global_slice_with_shape",
    "open_ts_array",
    "register_default_tensorstore_strategies",
]
