"""Megatron-Core module path ``dist_ckpt.optimizer``: re-exports
[`dist_ckpt.model.optimizer`][dist_ckpt.model.optimizer].

Code written for ``megatron.core.dist_checkpointing.optimizer`` imports from here unchanged.
"""

from dist_ckpt.model.optimizer import (
    ShardedParam,
    get_optim_param_to_id_map,
    get_param_id_to_sharded_param_map,
    logger,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)

__all__ = [
    "ShardedParam",
    "get_optim_param_to_id_map",
    "get_param_id_to_sharded_param_map",
    "logger",
    "make_sharded_optimizer_tensor",
    "optim_state_to_sharding_state",
]
