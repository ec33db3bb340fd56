"""Megatron-Core module path ``dist_ckpt.strategies.safetensors``:
re-exports [`dist_ckpt.backends.safetensors.strategy`][dist_ckpt.backends.safetensors.strategy].

Code written for ``megatron.core.dist_checkpointing.strategies.safetensors`` imports from here unchanged.
"""

from dist_ckpt.backends.safetensors.strategy import (
    SafetensorsLoadOptions,
    SafetensorsLoadShardedStrategy,
    SafetensorsSaveOptions,
    SafetensorsSaveShardedStrategy,
    deferred_starts,
)

__all__ = [
    "SafetensorsLoadOptions",
    "SafetensorsLoadShardedStrategy",
    "SafetensorsSaveOptions",
    "SafetensorsSaveShardedStrategy",
    "deferred_starts",
]
