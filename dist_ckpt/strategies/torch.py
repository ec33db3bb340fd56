"""Megatron-Core module path ``dist_ckpt.strategies.torch``:
re-exports the ``torch_dist`` strategies of `dist_ckpt.backends.torch_dist`.

Code written for ``megatron.core.dist_checkpointing.strategies.torch`` imports from here unchanged.
"""

from dist_ckpt.backends.torch_dist.load import TorchDistLoadShardedStrategy
from dist_ckpt.backends.torch_dist.save import TorchDistSaveOptions, TorchDistSaveShardedStrategy

__all__ = ["TorchDistLoadShardedStrategy", "TorchDistSaveOptions", "TorchDistSaveShardedStrategy"]
