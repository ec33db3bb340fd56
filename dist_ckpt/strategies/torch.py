"""Megatron-Core module path ``dist_ckpt.strategies.torch``:
re-exports the ``torch_dist`` strategies of `dist_ckpt.backends.torch_dist`
and ``register_default_torch_strategies`` of [`dist_ckpt.engine.registry`][dist_ckpt.engine.registry].

Code written for ``megatron.core.dist_checkpointing.strategies.torch`` imports from here unchanged.
"""

from dist_ckpt.backends.torch_dist.load import TorchDistLoadShardedStrategy
from dist_ckpt.backends.torch_dist.save import TorchDistSaveOptions, TorchDistSaveShardedStrategy
from dist_ckpt.engine.registry import register_default_torch_strategies

__all__ = [
    "TorchDistLoadShardedStrategy",
    "TorchDistSaveOptions",
    "TorchDistSaveShardedStrategy",
    "register_default_torch_strategies",
]
