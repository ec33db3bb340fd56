"""Megatron-Core module path ``dist_ckpt.state_dict_utils``: re-exports
[`dist_ckpt.engine.preprocess`][dist_ckpt.engine.preprocess] and
``filter_out_empty_flatten_tensor`` of [`dist_ckpt.model.state_dict_utils`][dist_ckpt.model.state_dict_utils].

Code written for ``megatron.core.dist_checkpointing.state_dict_utils`` imports from here unchanged.
"""

from dist_ckpt.engine.preprocess import load_preprocess, save_preprocess
from dist_ckpt.model.state_dict_utils import filter_out_empty_flatten_tensor

__all__ = ["filter_out_empty_flatten_tensor", "load_preprocess", "save_preprocess"]
