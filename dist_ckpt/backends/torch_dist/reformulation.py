"""The stored shapes of flattened N-D tensors, from a torch_dist checkpoint's ``.metadata``:
Megatron-Core's ``strategies.torch.get_reformulation_metadata``, the input of
[`apply_nd_flattened_tensors_reformulation`][dist_ckpt.model.nd_reformulation.apply_nd_flattened_tensors_reformulation].

Example:

```python
metadata = get_reformulation_metadata(sharded_state_dict, "ckpt/iter_10")
metadata["optimizer.exp_avg"].ckpt_reform_global_shape      # (4, 1, 768): 4 chunks of 768 elements
```
"""

from __future__ import annotations

from typing import Dict

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dist_ckpt.backends.torch_dist.layout import REFORMULATED_SHAPE
from dist_ckpt.backends.torch_dist.metadata import mcore_data, read_metadata
from dist_ckpt.errors import KeyMismatchError
from dist_ckpt.model.dict_utils import nested_values
from dist_ckpt.model.nd_reformulation import TensorReformulationMetadata, is_nd_flattened_tensor
from dist_ckpt.model.sharded import ShardedStateDict
from dist_ckpt.storage.location import LocationLike

__all__ = ["get_reformulation_metadata"]


def get_reformulation_metadata(
    sharded_state_dict: ShardedStateDict, checkpoint_dir: LocationLike
) -> Dict[str, TensorReformulationMetadata]:
    """For each flattened ShardedTensor of ``sharded_state_dict``: its original and its stored
    (reformulated) global shape in the checkpoint (read with the restricted unpickler).

    A 1-D flattened tensor without a record is left out (stored as it is, by older versions).

    Raises:
        KeyMismatchError: a flattened N-D tensor that the checkpoint does not hold reformulated.
    """
    md = read_metadata(checkpoint_dir)
    extra = mcore_data(md)
    out: Dict[str, TensorReformulationMetadata] = {}
    for sh in nested_values(sharded_state_dict):
        if not is_nd_flattened_tensor(sh) or sh.key in out:
            continue
        original = extra.get(sh.key, {}).get(REFORMULATED_SHAPE)
        stored = md.state_dict_metadata.get(sh.key)
        if original is None or not isinstance(stored, TensorStorageMetadata):
            if len(sh.global_shape) == 1:
                continue
            raise KeyMismatchError(
                f"{sh.key!r}: the checkpoint {str(checkpoint_dir)!r} records no original shape for this flattened "
                f"tensor (it holds {len(extra)} reformulated tensors)"
            )
        out[sh.key] = TensorReformulationMetadata(tuple(original), tuple(stored.size))
    return out
