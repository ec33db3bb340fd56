"""FP8 tensors in a state dict: recognise them and replace them by their high-precision values.

Two kinds exist. Transformer Engine's ``Float8Tensor`` (FP8 training with FP8 parameters) is a
``torch.Tensor`` subclass holding FP8 bytes and a scale, whose ``dtype`` is the nominal
high-precision type; a checkpoint written from it must hold the dequantized values, and a
collective exchanging it must send the nominal tensor. A plain tensor of a torch ``float8_*``
dtype has no nominal type; every float8 value is exactly a float32 value.

Transformer Engine is never imported here: a ``Float8Tensor`` exists only if its module was
imported by the caller, so the check looks at the tensor's class, not at an import.
"""

from __future__ import annotations

from typing import Any

import torch

from dist_ckpt.model.dict_utils import Nested, nested_values
from dist_ckpt.model.sharded import ShardedTensor

_TE_MODULE_PREFIX = "transformer_engine."

#: the torch float8 dtypes of this torch build (older builds lack some of them)
TORCH_FLOAT8_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)


def is_float8tensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a Transformer Engine ``Float8Tensor`` (or a subclass of it).

    Example:

    ```python
    is_float8tensor(torch.zeros(2))                                   # False
    is_float8tensor(torch.zeros(2, dtype=torch.float8_e4m3fn))        # False: plain float8
    ```
    """
    return isinstance(tensor, torch.Tensor) and any(
        cls.__name__ == "Float8Tensor" and cls.__module__.startswith(_TE_MODULE_PREFIX) for cls in type(tensor).__mro__
    )


def is_plain_float8(tensor: Any) -> bool:
    """Whether ``tensor`` is an ordinary torch tensor of a ``float8_*`` dtype."""
    return isinstance(tensor, torch.Tensor) and not is_float8tensor(tensor) and tensor.dtype in TORCH_FLOAT8_DTYPES


def dequantize_float8(tensor: torch.Tensor) -> torch.Tensor:
    """The high-precision values of an FP8 tensor: a ``Float8Tensor`` in its nominal dtype, a
    plain float8 tensor as float32 (exact); any other tensor is returned as is."""
    if is_float8tensor(tensor):
        dequantize = getattr(tensor, "dequantize", None) or getattr(tensor, "from_float8")
        result: torch.Tensor = dequantize()
        return result
    if is_plain_float8(tensor):
        return tensor.to(torch.float32)
    return tensor


def force_all_tensors_to_non_fp8(sharded_state_dict: Nested) -> None:
    """Replace, in place, the ``data`` of every leaf holding an FP8 tensor by its dequantized
    values (`dequantize_float8()`); other leaves are left untouched.

    A ShardedTensor whose plain float8 data becomes float32 gets ``dtype`` float32 too, so it
    stays consistent; a ``Float8Tensor``'s nominal dtype is already the ShardedTensor's.

    Example:

    ```python
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, dtype=torch.float8_e4m3fn))}
    force_all_tensors_to_non_fp8(sd)
    sd["w"].data.dtype, sd["w"].dtype                   # (torch.float32, torch.float32)
    ```
    """
    for leaf in nested_values(sharded_state_dict):
        data = getattr(leaf, "data", None)
        if not isinstance(data, torch.Tensor) or not (is_float8tensor(data) or is_plain_float8(data)):
            continue
        leaf.data = dequantize_float8(data)
        if isinstance(leaf, ShardedTensor):
            leaf.dtype = leaf.data.dtype


__all__ = [
    "TORCH_FLOAT8_DTYPES",
    "dequantize_float8",
    "force_all_tensors_to_non_fp8",
    "is_float8tensor",
    "is_plain_float8",
]
