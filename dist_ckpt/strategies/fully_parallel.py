"""Megatron-Core module path ``dist_ckpt.strategies.fully_parallel``:
re-exports [`dist_ckpt.parallel.fully_parallel`][dist_ckpt.parallel.fully_parallel] and the
precomputed distribution of [`dist_ckpt.parallel.shard_distribution`][dist_ckpt.parallel.shard_distribution].

Code written for ``megatron.core.dist_checkpointing.strategies.fully_parallel`` imports from here unchanged.
"""

from dist_ckpt.parallel.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
    distribute_main_replicas,
)
from dist_ckpt.parallel.shard_distribution import distribute_main_replicas_with_precomputed_distribution
from dist_ckpt.parallel.shard_distribution import sharded_tensor_shard_id as _sharded_tensor_shard_id

__all__ = [
    "FullyParallelLoadStrategyWrapper",
    "FullyParallelSaveStrategyWrapper",
    "_sharded_tensor_shard_id",  # imported from here by Megatron-Core's users
    "distribute_main_replicas",
    "distribute_main_replicas_with_precomputed_distribution",
]
