"""Megatron-Core module path ``dist_ckpt.strategies.state_dict_saver``: re-exports
[`dist_ckpt.backends.torch_dist.async_plan`][dist_ckpt.backends.torch_dist.async_plan].

Code written for ``megatron.core.dist_checkpointing.strategies.state_dict_saver`` imports from here unchanged.
"""

from dist_ckpt.backends.torch_dist.async_plan import (
    CheckpointWriteError,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
    verify_global_md_reuse,
)

__all__ = [
    "CheckpointWriteError",
    "save_state_dict_async_finalize",
    "save_state_dict_async_plan",
    "verify_global_md_reuse",
]
