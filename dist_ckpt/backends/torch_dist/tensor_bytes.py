"""Tensors over exactly their own bytes, so that ``torch.save`` (DCP's item format) and pickling
write only those bytes: both write a tensor's whole storage, so a view into a larger buffer (a
distributed optimizer's flat buffer, a slice of a parameter) would otherwise be copied or written
whole.

Example:

```python
part = torch.arange(1000)[10:20]
len(pickle.dumps(exact_storage(part))) < len(pickle.dumps(part))     # 10 elements, not 1000
```
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["exact_storage", "on_storage"]


def on_storage(storage: torch.UntypedStorage, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A contiguous tensor of ``shape`` over the whole of ``storage`` (no copy)."""
    strides, step = [], 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= max(n, 1)
    empty = torch.empty(0, dtype=dtype, device=storage.device)
    return empty.set_(storage, 0, tuple(shape), tuple(reversed(strides)))


def exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on a storage holding exactly its bytes (a view, no copy) when it is a contiguous
    part of a larger storage; any other tensor is returned as it is."""
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    return on_storage(tensor.untyped_storage()[start : start + tensor.nbytes], tensor.dtype, tensor.shape)
