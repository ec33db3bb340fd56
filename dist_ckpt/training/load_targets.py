"""Load into live tensors in place, and check afterwards that every element was loaded.

A `LoadTarget` pairs a live tensor (a parameter, an optimizer state, a DTensor's local
shard) with the [`ShardedTensor`][dist_ckpt.model.sharded.ShardedTensor] that requests it from the checkpoint. The
ShardedTensor's ``data`` is the live memory itself whenever possible (same dtype; for a flattened range, a
contiguous tensor viewed as 1-D), so the backend writes straight into it. Otherwise -- a dtype
that differs from the stored one, a non-contiguous local shard that must be flattened -- it is
a separate buffer, copied (and cast, like ``torch.nn.Module.load_state_dict``) into the live
tensor by `finish_targets()`.

Validation (``validate=True`` in
[`dist_ckpt.training.model_optim.load_model_and_optim_state()`][dist_ckpt.training.model_optim.load_model_and_optim_state]),
as in OLMo-core: `fill_for_validation()` fills every floating-point (or complex) destination with NaN before loading,
and `find_holes()` reports the keys where NaN remains, i.e. elements that no stored shard covered. Integer and bool
tensors cannot hold a sentinel that a valid checkpoint could not also contain, so they are skipped (logged at DEBUG);
their coverage is still checked by the backends, which refuse a request that the stored fragments do not
cover. A checkpoint that legitimately stores NaN fails this check: load it with
``validate=False``.

Example:

```python
target = make_target("model.fc.weight", model.fc.weight, stored_dtype=torch.float32)
fill_for_validation([target])
loaded = dc.load({"w": target.sharded}, "ckpt")
finish_targets([target], [loaded["w"]])
assert not find_holes([target])
```
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.training.dtensor_shards import local_tensor, sharded_tensor_from_box, tensor_box

logger = logging.getLogger(__name__)

__all__ = ["LoadTarget", "can_hold_nan", "fill_for_validation", "find_holes", "finish_targets", "make_target"]


@dataclass
class LoadTarget:
    """One live tensor to fill from the checkpoint.

    Attributes:
        key: checkpoint key.
        dest: the live local tensor (a DTensor's local shard, or the tensor itself).
        sharded: the request; ``sharded.data`` is ``dest``'s memory when ``in_place``.
        in_place: whether the backend writes ``dest`` directly (no copy afterwards).
    """

    key: str
    dest: torch.Tensor
    sharded: ShardedTensor
    in_place: bool


def make_target(key: str, tensor: torch.Tensor, stored_dtype: Optional[torch.dtype] = None) -> LoadTarget:
    """A load target for ``tensor`` (plain or DTensor), requesting it as ``stored_dtype``.

    Args:
        key: checkpoint key.
        tensor: the live tensor to fill.
        stored_dtype: dtype of the stored tensor; a different dtype from ``tensor``'s loads into
            a buffer that is cast on copy. None means ``tensor``'s dtype.
    """
    dest = local_tensor(tensor)
    box = tensor_box(key, tensor)
    dtype = dest.dtype if stored_dtype is None else stored_dtype
    flattened = bool(box.global_shape) and box.local_shape[0] != box.global_shape[0]
    in_place = dtype == dest.dtype and (dest.is_contiguous() or not flattened)
    buffer = dest if in_place else torch.empty(dest.shape, dtype=dtype, device=dest.device)
    return LoadTarget(key, dest, sharded_tensor_from_box(key, buffer, box), in_place)


def finish_targets(targets: Sequence[LoadTarget], loaded: Sequence[torch.Tensor]) -> None:
    """Copy each loaded value into its live tensor, unless the backend already wrote it there."""
    with torch.no_grad():
        for target, value in zip(targets, loaded):
            if target.in_place and value is target.sharded.data:
                continue
            target.dest.copy_(value.reshape(target.dest.shape))


def can_hold_nan(dtype: torch.dtype) -> bool:
    """Whether NaN can mark an unloaded element of ``dtype`` (floating point or complex)."""
    return dtype.is_floating_point or dtype.is_complex


def fill_for_validation(targets: Sequence[LoadTarget]) -> None:
    """Fill every NaN-capable destination (and separate buffer) with NaN before loading."""
    skipped = []
    with torch.no_grad():
        for target in targets:
            if not can_hold_nan(target.dest.dtype):
                skipped.append(target.key)
                continue
            target.dest.fill_(float("nan"))
            buffer = target.sharded.data
            if not target.in_place and buffer is not None and can_hold_nan(buffer.dtype):
                buffer.fill_(float("nan"))
    if skipped:
        logger.debug("validate: %d integer/bool tensors are not NaN-checked: %s", len(skipped), skipped[:10])


def find_holes(targets: Sequence[LoadTarget]) -> List[str]:
    """``"key (n of m elements)"`` for every destination where NaN remains after loading."""
    holes = []
    for target in targets:
        if not can_hold_nan(target.dest.dtype) or target.dest.numel() == 0:
            continue
        count = int(torch.isnan(target.dest).sum().item())
        if count:
            holes.append(f"{target.key!r} ({count} of {target.dest.numel()} local elements)")
    return holes
