"""Megatron-Core module path ``dist_ckpt.strategies.torch``:
re-exports the ``torch_dist`` strategies of `dist_ckpt.backends.torch_dist`, Megatron-Core's DCP
planners ([`planners`][dist_ckpt.backends.torch_dist.planners]) and translation helpers
([`pyt_state_dict`][dist_ckpt.backends.torch_dist.pyt_state_dict]), ``MCoreMetadata`` and
``MCoreSavePlan`` (the classes megatron-core <= 0.15 pickled into ``.metadata``, as
[`metadata`][dist_ckpt.backends.torch_dist.metadata] reads them), ``get_reformulation_metadata``
([`reformulation`][dist_ckpt.backends.torch_dist.reformulation], megatron-core < 0.16) and
``register_default_torch_strategies`` of [`dist_ckpt.backends.registry`][dist_ckpt.backends.registry].

Code written for ``megatron.core.dist_checkpointing.strategies.torch`` imports from here unchanged.
"""

from dist_ckpt.backends.registry import register_default_torch_strategies
from dist_ckpt.backends.torch_dist.load import TorchDistLoadShardedStrategy
from dist_ckpt.backends.torch_dist.metadata import LegacyMCoreMetadata as MCoreMetadata
from dist_ckpt.backends.torch_dist.metadata import LegacyMCoreSavePlan as MCoreSavePlan
from dist_ckpt.backends.torch_dist.planners import MCoreLoadPlanner, MCoreSavePlanner
from dist_ckpt.backends.torch_dist.pyt_state_dict import (
    flatten_state_dict,
    mcore_to_pyt_state_dict,
    sharded_tensor_to_torch_sharded_tensor,
)
from dist_ckpt.backends.torch_dist.reformulation import get_reformulation_metadata
from dist_ckpt.backends.torch_dist.save import TorchDistSaveOptions, TorchDistSaveShardedStrategy

__all__ = [
    "MCoreLoadPlanner",
    "MCoreMetadata",
    "MCoreSavePlan",
    "MCoreSavePlanner",
    "TorchDistLoadShardedStrategy",
    "TorchDistSaveOptions",
    "TorchDistSaveShardedStrategy",
    "flatten_state_dict",
    "get_reformulation_metadata",
    "mcore_to_pyt_state_dict",
    "register_default_torch_strategies",
    "sharded_tensor_to_torch_sharded_tensor",
]
