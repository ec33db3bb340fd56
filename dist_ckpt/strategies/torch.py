"""Megatron-Core module path ``dist_ckpt.strategies.torch``:
re-exports the ``torch_dist`` strategies of `dist_ckpt.backends.torch_dist`
and ``register_default_torch_strategies`` of [`dist_ckpt.backends.registry`][dist_ckpt.backends.registry].

Code written for ``megatron.core.dist_checkpointing.strategies.torch`` imports from here unchanged.
"""

from dist_ckpt.backends.registry import register_default_torch_strategies
from dist_ckpt.backends.torch_dist.load import TorchDistLoadShardedStrategy
from dist_ckpt.backends.torch_dist.save import TorchDistSaveOptions, TorchDistSaveShardedStrategy

__all__ = [
    "TorchDistLoadShardedStrategy",
    "TorchDistSaveOptions",
    "TorchDistSaveShardedStrategy",
    "register_default_torch_strategies",
]
