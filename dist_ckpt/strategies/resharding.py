"""Megatron-Core module path ``dist_ckpt.strategies.resharding`` (megatron-core < 0.16): re-exports
[`dist_ckpt.model.nd_reformulation`][dist_ckpt.model.nd_reformulation].

Code written for ``megatron.core.dist_checkpointing.strategies.resharding`` imports from here unchanged.
"""

from dist_ckpt.model.nd_reformulation import (
    ReformulationRestoreMetadata,
    TensorReformulationMetadata,
    apply_nd_flattened_tensors_reformulation,
    is_nd_flattened_tensor,
    nd_flattened_tensor_reformulated_global_shape,
    reformulate_single_nd_flattened_tensor,
    restore_nd_flattened_tensors_formulation,
)

__all__ = [
    "ReformulationRestoreMetadata",
    "TensorReformulationMetadata",
    "apply_nd_flattened_tensors_reformulation",
    "is_nd_flattened_tensor",
    "nd_flattened_tensor_reformulated_global_shape",
    "reformulate_single_nd_flattened_tensor",
    "restore_nd_flattened_tensors_formulation",
]
