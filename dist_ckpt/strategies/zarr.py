"""Megatron-Core module path ``dist_ckpt.strategies.zarr``: re-exports
[`dist_ckpt.backends.zarr.zarr_python`][dist_ckpt.backends.zarr.zarr_python].

Code written for ``megatron.core.dist_checkpointing.strategies.zarr`` imports from here unchanged.
"""

from dist_ckpt.backends.zarr.zarr_python import (
    ZarrLoadShardedStrategy,
    ZarrSaveShardedStrategy,
    flatten_range,
    load_zarr_based_sharded_metadata,
    pad_to_expected_shape,
    postprocess_numpy_array,
    register_default_zarr_strategies,
)

__all__ = [
    "ZarrLoadShardedStrategy",
    "ZarrSaveShardedStrategy",
    "flatten_range",
    "load_zarr_based_sharded_metadata",
    "pad_to_expected_shape",
    "postprocess_numpy_array",
    "register_default_zarr_strategies",
]
