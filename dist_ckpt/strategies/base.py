"""Megatron-Core module path ``dist_ckpt.strategies.base``: the strategy interfaces and the registry.

Re-exports [`dist_ckpt.backends.base`][dist_ckpt.backends.base] (interfaces) and
[`dist_ckpt.backends.registry`][dist_ckpt.backends.registry]; code written for
``megatron.core.dist_checkpointing.strategies.base`` imports from here unchanged.
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
    check_stream_entry,
    load_destination,
    loaded_shape,
    main_replica_shards,
)
from dist_ckpt.backends.registry import (
    ENTRY_POINT_GROUP,
    Strategy,
    StrategyAction,
    StrategyFactory,
    StrategyKey,
    StrategySpec,
    alternative_strategies,
    get_alternative_strategy,
    get_default_strategy,
    register_default_strategy,
    registered_strategies,
    resolve_strategy,
    unregister_strategy,
)

__all__ = [
    "AsyncSaveShardedStrategy",
    "ENTRY_POINT_GROUP",
    "LoadCommonStrategy",
    "LoadShardedStrategy",
    "LoadStrategyBase",
    "SaveCommonStrategy",
    "SaveShardedStrategy",
    "SaveStrategyBase",
    "Strategy",
    "StrategyAction",
    "StrategyFactory",
    "StrategyKey",
    "StrategySpec",
    "TensorLayout",
    "TensorStreamWriter",
    "alternative_strategies",
    "check_stream_entry",
    "get_alternative_strategy",
    "get_default_strategy",
    "load_destination",
    "loaded_shape",
    "main_replica_shards",
    "register_default_strategy",
    "registered_strategies",
    "resolve_strategy",
    "unregister_strategy",
]
