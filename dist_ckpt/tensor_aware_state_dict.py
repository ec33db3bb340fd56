"""Megatron-Core module path ``dist_ckpt.tensor_aware_state_dict``: re-exports
[`dist_ckpt.engine.tensor_aware`][dist_ckpt.engine.tensor_aware].

Code written for ``megatron.core.dist_checkpointing.tensor_aware_state_dict`` imports from here unchanged.
"""

from dist_ckpt.engine.tensor_aware import MCoreTensorAwareStateDict

__all__ = ["MCoreTensorAwareStateDict"]
