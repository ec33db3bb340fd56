"""Loading flattened N-D tensors saved in another layout: Megatron-Core's ``strategies.resharding`` (pure).

The distributed optimizer of megatron-core <= 0.15 saves each N-D tensor of global shape
``[X, Y, Z]``, split into chunks of ``[x, y, z]`` and then flattened into ranges, as a tensor of
shape ``[X // x, Y // y, Z // z, x * y * z]`` (one flat row per chunk: the *reformulated* layout,
see ``backends/torch_dist/layout.py``). A job with another TP/PP/DP split asks for flattened
ranges of *other* chunks. This module turns such a request into requests for the checkpoint's
own chunks and back, as Megatron-Core did before 0.16:

1. `apply_nd_flattened_tensors_reformulation()` replaces each flattened ShardedTensor whose
   chunks differ from the checkpoint's (``reformulation_metadata``: the saved shapes, from
   ``strategies.torch.get_reformulation_metadata``) by requests for every stored chunk that
   overlaps it, each whole (a flattened range over the full chunk);
2. the state dict is loaded;
3. `restore_nd_flattened_tensors_formulation()` assembles each requested chunk from the loaded
   stored chunks and cuts the requested flattened range out of it.

dist_ckpt's own load does this by itself (any flattened range from any layout); the module is for
code written against Megatron-Core's API.

Example:

```python
metadata = get_reformulation_metadata(sharded_state_dict, checkpoint_dir)
request, restore = apply_nd_flattened_tensors_reformulation(sharded_state_dict, metadata)
loaded = dc.load(request, checkpoint_dir)
state_dict = restore_nd_flattened_tensors_formulation(loaded, restore)
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from dist_ckpt.errors import InvalidShardedTensorError, KeyMismatchError
from dist_ckpt.model.dict_utils import dict_list_map_inplace, extract_matching_values
from dist_ckpt.model.factories import ShardedTensorFactory, apply_factories, apply_factory_merges
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor, StateDict

__all__ = [
    "ReformulationRestoreMetadata",
    "TensorReformulationMetadata",
    "apply_nd_flattened_tensors_reformulation",
    "is_nd_flattened_tensor",
    "nd_flattened_tensor_reformulated_global_shape",
    "reformulate_single_nd_flattened_tensor",
    "restore_nd_flattened_tensors_formulation",
]

Shape = Tuple[int, ...]

#: what `restore_nd_flattened_tensors_formulation()` needs: the factories that stood for the
#: reformulated tensors, without data, where the tensors were
ReformulationRestoreMetadata = ShardedStateDict


@dataclass(frozen=True)
class TensorReformulationMetadata:
    """How the checkpoint stores one flattened N-D tensor.

    Attributes:
        ckpt_orig_global_shape: the tensor's global shape (prepended axes included).
        ckpt_reform_global_shape: the stored, reformulated shape: chunks per axis, then the
            elements of one chunk.

    Raises:
        InvalidShardedTensorError: an empty original shape, or a stored shape that does not have
            one more axis than it.
    """

    ckpt_orig_global_shape: Shape
    ckpt_reform_global_shape: Shape

    def __post_init__(self) -> None:
        orig, reform = tuple(self.ckpt_orig_global_shape), tuple(self.ckpt_reform_global_shape)
        if not orig or len(reform) != len(orig) + 1:
            raise InvalidShardedTensorError(
                f"TensorReformulationMetadata: a stored shape {reform} needs one more axis than the original {orig}"
            )
        object.__setattr__(self, "ckpt_orig_global_shape", orig)
        object.__setattr__(self, "ckpt_reform_global_shape", reform)


def is_nd_flattened_tensor(sh_ten: Any) -> bool:
    """Whether ``sh_ten`` is a ShardedTensor with a ``flattened_range`` (of any number of axes)."""
    return isinstance(sh_ten, ShardedTensor) and sh_ten.flattened_range is not None


def nd_flattened_tensor_reformulated_global_shape(sh_ten: ShardedTensor) -> Shape:
    """The reformulated shape ``sh_ten``'s own layout gives: its chunks per axis, then one chunk's elements.

    Raises:
        InvalidShardedTensorError: not a flattened ShardedTensor on a regular grid.
    """
    if not is_nd_flattened_tensor(sh_ten) or sh_ten.axis_fragmentations is None:
        raise InvalidShardedTensorError(
            f"{getattr(sh_ten, 'key', sh_ten)!r} is not a flattened ShardedTensor on a grid"
        )
    return tuple(sh_ten.axis_fragmentations) + (math.prod(sh_ten.local_shape),)


def _overlap(a_start: int, a_len: int, b_start: int, b_len: int) -> Tuple[int, int, int]:
    """(offset in a, offset in b, length) of the overlap of ``[a_start, +a_len)`` and ``[b_start, +b_len)``."""
    start, stop = max(a_start, b_start), min(a_start + a_len, b_start + b_len)
    return start - a_start, start - b_start, max(stop - start, 0)


def reformulate_single_nd_flattened_tensor(
    sh_ten: ShardedTensor, reformulation_metadata: TensorReformulationMetadata
) -> ShardedTensorFactory:
    """A factory standing for ``sh_ten``: it builds requests for the stored chunks it overlaps, and
    merges them back into ``sh_ten``'s flattened range.

    Raises:
        InvalidShardedTensorError: the stored layout does not tile the original shape, or its
            prepended axes are not of size one, or it has another number of axes than ``sh_ten``.
    """
    rmd = reformulation_metadata
    orig, grid = rmd.ckpt_orig_global_shape, rmd.ckpt_reform_global_shape[:-1]
    where = f"{sh_ten.key!r} (stored as {rmd.ckpt_reform_global_shape} of {orig})"
    if len(grid) != len(sh_ten.global_shape) or any(n == 0 or g % n for g, n in zip(orig, grid)):
        raise InvalidShardedTensorError(
            f"{where}: the stored chunks do not tile the global shape {sh_ten.global_shape}"
        )
    block = tuple(g // n for g, n in zip(orig, grid))  # one stored chunk, prepended axes included
    prepend = sh_ten.prepend_axis_num
    if block[:prepend] != (1,) * prepend:
        raise InvalidShardedTensorError(f"{where}: stored chunks span several entries of a prepended axis")
    stored_local = block[prepend:]
    wanted_offset, wanted_shape = tuple(sh_ten.global_offset), tuple(sh_ten.full_local_shape)
    ranges = [range(o // b, -(-(o + n) // b)) for o, n, b in zip(wanted_offset, wanted_shape, block)]
    pieces: List[ShardedTensor] = [
        ShardedTensor(
            sh_ten.key,
            None,
            sh_ten.dtype,
            stored_local,
            orig,
            tuple(i * b for i, b in zip(index, block)),
            grid,
            sh_ten.replica_id,
            prepend,
            sh_ten.allow_shape_mismatch,
            flattened_range=slice(0, math.prod(stored_local)),  # the whole stored chunk
        )
        for index in product(*ranges)
    ]
    local_shape, flat = tuple(sh_ten.local_shape), sh_ten.flattened_range
    assert flat is not None  # a flattened tensor is what is reformulated

    def build(key: str, data: Optional[torch.Tensor], replica_id: Any, flattened_range: Optional[slice] = None) -> Any:
        return list(pieces)

    @torch.no_grad()
    def merge(loaded: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(loaded) != len(pieces):
            raise KeyMismatchError(f"{where}: {len(loaded)} stored chunks were loaded for the {len(pieces)} requested")
        out = torch.empty(local_shape, dtype=sh_ten.dtype, device=loaded[0].device if loaded else None)
        for piece, tensor in zip(pieces, loaded):
            src, dst = tensor.view(stored_local), out
            for dim, (p_off, w_off) in enumerate(zip(piece.global_offset[prepend:], wanted_offset[prepend:])):
                in_src, in_dst, length = _overlap(p_off, stored_local[dim], w_off, local_shape[dim])
                src, dst = src.narrow(dim, in_src, length), dst.narrow(dim, in_dst, length)
            dst.copy_(src)
        return out.flatten()[flat]

    return ShardedTensorFactory(sh_ten.key, sh_ten.data, build, merge, sh_ten.replica_id, flat)  # type: ignore[arg-type]


def apply_nd_flattened_tensors_reformulation(
    sharded_state_dict: ShardedStateDict, reformulation_metadata: Dict[str, TensorReformulationMetadata]
) -> Tuple[ShardedStateDict, ReformulationRestoreMetadata]:
    """Step 1 of the module docstring, in place: ``(the request, what step 3 needs)``.

    A flattened tensor stored in its own layout is left as it is; a 1-D one without metadata
    too (checkpoints older than the metadata stored 1-D tensors as they are).

    Raises:
        KeyMismatchError: a flattened N-D tensor without an entry in ``reformulation_metadata``.
    """

    def reformulate(x: Any) -> Any:
        if not is_nd_flattened_tensor(x):
            return x
        rmd = reformulation_metadata.get(x.key)
        if rmd is None:
            if len(x.global_shape) == 1:
                return x
            raise KeyMismatchError(
                f"no reformulation metadata for the flattened tensor {x.key!r} (there is some for "
                f"{sorted(reformulation_metadata)}); get it with get_reformulation_metadata"
            )
        if rmd.ckpt_reform_global_shape == nd_flattened_tensor_reformulated_global_shape(x):
            return x  # the checkpoint's chunks are the requested ones
        return reformulate_single_nd_flattened_tensor(x, rmd)

    dict_list_map_inplace(reformulate, sharded_state_dict)
    factories, _ = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(sharded_state_dict)

    def drop_data(x: Any) -> Any:
        x.data = None  # the merge needs no data: do not keep the tensors alive
        return x

    dict_list_map_inplace(drop_data, factories)
    return sharded_state_dict, factories  # type: ignore[return-value]  # a dict: the state dict is one


def restore_nd_flattened_tensors_formulation(
    state_dict: StateDict, formulation_restore_metadata: ReformulationRestoreMetadata
) -> StateDict:
    """Step 3 of the module docstring: each requested flattened range, from the loaded stored chunks."""
    return apply_factory_merges(state_dict, formulation_restore_metadata)  # type: ignore[no-any-return]
