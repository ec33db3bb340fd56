"""Megatron-Core module path ``dist_ckpt.strategies.two_stage``: re-exports
[`dist_ckpt.parallel.two_stage`][dist_ckpt.parallel.two_stage].

Code written for ``megatron.core.dist_checkpointing.strategies.two_stage`` imports from here unchanged.
"""

from dist_ckpt.parallel.two_stage import (
    TwoStageDataParallelLoadShardedStrategy,
    _ShardedTensorMetadata,  # listed in Megatron-Core's documentation of this module
    sharded_tensor_chunk_id,
    timed,
)

__all__ = ["TwoStageDataParallelLoadShardedStrategy", "_ShardedTensorMetadata", "sharded_tensor_chunk_id", "timed"]
