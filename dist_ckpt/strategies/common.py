"""Megatron-Core module path ``dist_ckpt.strategies.common``:
re-exports `dist_ckpt.backends.torch_common.strategy`
and ``register_default_common_strategies`` of [`dist_ckpt.backends.registry`][dist_ckpt.backends.registry].

Code written for ``megatron.core.dist_checkpointing.strategies.common`` imports from here unchanged.
"""

from dist_ckpt.backends.registry import register_default_common_strategies
from dist_ckpt.backends.torch_common.strategy import (
    COMMON_CHECKSUMS_FNAME,
    COMMON_STATE_FNAME,
    KEY_FNAME,
    OBJECTS_CHECKSUMS_FNAME,
    OBJECTS_DIR,
    UNSAFE_KEYS_FNAME,
    TorchCommonLoadStrategy,
    TorchCommonSaveStrategy,
    find_unsafe_values,
    logger,
    verify_common,
)

__all__ = [
    "COMMON_CHECKSUMS_FNAME",
    "COMMON_STATE_FNAME",
    "KEY_FNAME",
    "OBJECTS_CHECKSUMS_FNAME",
    "OBJECTS_DIR",
    "TorchCommonLoadStrategy",
    "TorchCommonSaveStrategy",
    "UNSAFE_KEYS_FNAME",
    "find_unsafe_values",
    "register_default_common_strategies",
    "logger",
    "verify_common",
]
