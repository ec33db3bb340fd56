"""Megatron-Core module path ``dist_ckpt.strategies.checkpointable``: re-exports
[`dist_ckpt.backends.torch_dist.checkpointable`][dist_ckpt.backends.torch_dist.checkpointable].

Code written for ``megatron.core.dist_checkpointing.strategies.checkpointable`` imports from here unchanged.
"""

from dist_ckpt.backends.torch_dist.checkpointable import CheckpointableShardedTensor, LocalShardsContainer

__all__ = ["CheckpointableShardedTensor", "LocalShardsContainer"]
