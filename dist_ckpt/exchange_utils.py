"""Megatron-Core module path ``dist_ckpt.exchange_utils``: re-exports
[`dist_ckpt.parallel.shard_distribution`][dist_ckpt.parallel.shard_distribution],
``distribute_shards_to_ranks`` of [`dist_ckpt.parallel.exchange`][dist_ckpt.parallel.exchange] and
``is_float8tensor`` of [`dist_ckpt.model.fp8`][dist_ckpt.model.fp8].

Code written for ``megatron.core.dist_checkpointing.exchange_utils`` imports from here unchanged.
"""

from dist_ckpt.model.fp8 import is_float8tensor
from dist_ckpt.parallel.exchange import distribute_shards_to_ranks
from dist_ckpt.parallel.shard_distribution import (
    ShardDistribution,
    determine_main_replica_uniform_distribution,
    exchange_by_distribution,
    exchange_loaded_objects_gather_object,
    exchange_loaded_tensors_broadcast,
    exchange_loaded_tensors_gather_object,
    exchange_loaded_tensors_gather_rounds,
)
from dist_ckpt.parallel.shard_distribution import empty_tensor_for_exchange as _get_empty_tensor_for_exchange
from dist_ckpt.parallel.shard_distribution import sharded_tensor_shard_id as _sharded_tensor_shard_id

__all__ = [
    "ShardDistribution",
    "_get_empty_tensor_for_exchange",  # Megatron-Core's private names that its users import
    "_sharded_tensor_shard_id",
    "determine_main_replica_uniform_distribution",
    "distribute_shards_to_ranks",
    "exchange_by_distribution",
    "exchange_loaded_objects_gather_object",
    "exchange_loaded_tensors_broadcast",
    "exchange_loaded_tensors_gather_object",
    "exchange_loaded_tensors_gather_rounds",
    "is_float8tensor",
]
