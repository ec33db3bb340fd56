"""Checkpoint formats (backends) and saving/loading algorithms (strategies).

Importing this package imports no backend: built-ins are resolved lazily by
[`dist_ckpt.backends.base`][dist_ckpt.backends.base].
"""

from dist_ckpt.backends.base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    LoadStrategyBase,
    SaveCommonStrategy,
    SaveShardedStrategy,
    SaveStrategyBase,
    TensorLayout,
    TensorStreamWriter,
)
from dist_ckpt.backends.registry import (
    StrategyAction,
    StrategyKey,
    alternative_strategies,
    get_alternative_strategy,
    get_default_strategy,
    register_default_strategy,
    registered_strategies,
)
from dist_ckpt.backends.stored_shards import StoredShardInfo

__all__ = [
    "AsyncSaveShardedStrategy",
    "LoadCommonStrategy",
    "LoadShardedStrategy",
    "LoadStrategyBase",
    "SaveCommonStrategy",
    "SaveShardedStrategy",
    "SaveStrategyBase",
    "StrategyAction",
    "StoredShardInfo",
    "StrategyKey",
    "TensorLayout",
    "TensorStreamWriter",
    "alternative_strategies",
    "get_alternative_strategy",
    "get_default_strategy",
    "register_default_strategy",
    "registered_strategies",
]
