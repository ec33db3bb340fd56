"""How ``load_tensors_metadata`` describes a stored tensor: as it was saved.

Every backend answers ``load_tensors_metadata`` with one data-less ShardedTensor per stored
tensor, built here, so that all describe a tensor the same way -- Megatron-Core's way:

* a tensor saved whole or in boxes (tensor / pipeline parallel) is described with its shape:
  ``local_shape == global_shape``, no ``flattened_range``; loading the description returns the
  tensor with that shape;
* a tensor saved as flattened ranges (distributed-optimizer state) is described as it was saved:
  ``local_shape == global_shape ==`` its shape and a ``flattened_range`` covering all of it, so
  loading the description returns it flat (1-D, the row-major flattening of the whole tensor),
  beside the other tensors with their shapes.

Callers that want every tensor with its shape whatever the saved form (``unshard``, ``convert``,
the HuggingFace export) use `shaped()`.

Example:

```python
meta = stored_tensor_metadata("optimizer.exp_avg", torch.float32, (24, 10), flattened=True)
meta.local_shape, meta.flattened_range          # (24, 10), slice(0, 240)
shaped(meta).flattened_range                    # None
```
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from dist_ckpt.model.sharded import ShardedTensor

__all__ = ["shaped", "stored_tensor_metadata"]


def stored_tensor_metadata(key: str, dtype: torch.dtype, global_shape: Sequence[int], flattened: bool) -> ShardedTensor:
    """The description of stored tensor ``key`` (data on the meta device): with its shape, or,
    when it was saved as flattened ranges (``flattened``), as one range covering all of it."""
    if not flattened:
        return ShardedTensor.from_rank_offsets(key, torch.empty(tuple(global_shape), dtype=dtype, device="meta"))
    numel = math.prod(global_shape)
    flat = torch.empty(numel, dtype=dtype, device="meta")
    return ShardedTensor.from_rank_offsets_flat(key, flat, tuple(global_shape), flattened_range=slice(0, numel))


def shaped(meta: ShardedTensor) -> ShardedTensor:
    """``meta`` (a description from ``load_tensors_metadata``) as the whole tensor with its shape.

    Example:

    ```python
    request = {k: shaped(sh) for k, sh in dc.load_tensors_metadata(ckpt).items()}
    ```
    """
    if meta.flattened_range is None:
        return meta
    return stored_tensor_metadata(meta.key, meta.dtype, meta.global_shape, flattened=False)
