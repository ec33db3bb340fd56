"""Helpers of Megatron-Core's zarr strategy module, kept under its names.

``megatron.core.dist_checkpointing.strategies.zarr`` exposes these to code that loads zarr
checkpoints its own way; `dist_ckpt.strategies.zarr` re-exports them from here.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Tuple, Union

import numpy as np
import torch

from dist_ckpt.backends.zarr.layout import LAYOUT_CHUNKED, ZARR_DIR, checkpoint_node
from dist_ckpt.backends.zarr.metadata import (
    JsonCheck,
    check_tensor_dirs_present,
    list_tensor_names,
    open_tensor_info,
    tensors_metadata,
)
from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError, LoadMismatchError
from dist_ckpt.integrity.safe_json import shown
from dist_ckpt.model.dtypes import numpy_to_tensor
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor
from dist_ckpt.storage.location import LocationLike
from dist_ckpt.storage.object_path import ObjectPath

__all__ = ["flatten_range", "load_zarr_based_sharded_metadata", "pad_to_expected_shape", "postprocess_numpy_array"]


def load_zarr_based_sharded_metadata(
    checkpoint_dir: Union[ObjectPath, LocationLike],
    get_shape_dtype_fn: Callable[[Any], Tuple[Tuple[int, ...], np.dtype]],
    manifest: Optional[Mapping[str, Any]] = None,
    check: JsonCheck = None,
) -> ShardedStateDict:
    """``{key: ShardedTensor}`` for every stored tensor, shapes read with ``get_shape_dtype_fn``.

    Args:
        checkpoint_dir: the checkpoint: a path, URL or storage, or its root node.
        get_shape_dtype_fn: returns ``(shape, numpy dtype)`` of the zarr array at a path (a
            ``str`` for a local array, the `ObjectPath` for one on S3); lets each engine
            (zarr-python, TensorStore) open arrays its own way.
        manifest: the checkpoint's checksum manifest (None: saved without one); every tensor
            directory it lists must be present.
        check: verifies every ``zarr.json`` read (against the manifest).
    """
    node = checkpoint_dir if isinstance(checkpoint_dir, ObjectPath) else checkpoint_node(checkpoint_dir, "zarr")
    root = node / ZARR_DIR
    check_tensor_dirs_present(root, manifest)
    out = tensors_metadata(root, check, manifest)
    for name in list_tensor_names(root):
        info = open_tensor_info(root, name, check)
        if info is None or info.layout != LAYOUT_CHUNKED:
            continue
        local = info.path.storage.local_paths
        try:
            shape, np_dtype = get_shape_dtype_fn(str(info.path.local_path()) if local else info.path)
        except CheckpointingException:
            raise
        except Exception as e:  # noqa: BLE001 -- the engine's library failed on damaged metadata
            raise CorruptCheckpointError(
                f"{str(info.path / 'zarr.json')!r} of tensor {info.key!r} cannot be opened as a zarr array "
                f"({type(e).__name__}: {shown(e)}): the checkpoint is damaged"
            ) from e
        if tuple(shape) != info.global_shape or np.dtype(np_dtype).itemsize != info.dtype.itemsize:
            raise CorruptCheckpointError(
                f"{info.path}: the array is {tuple(shape)} {np_dtype}, its attributes say {info.global_shape} "
                f"{info.dtype}"
            )
    return out


def flatten_range(sharded_tensor: ShardedTensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened and cut to ``sharded_tensor.flattened_range`` (unchanged if none)."""
    if sharded_tensor.flattened_range is None:
        return x
    return x.flatten()[sharded_tensor.flattened_range]


def pad_to_expected_shape(x: torch.Tensor, expected_sharded_ten: ShardedTensor) -> torch.Tensor:
    """Crop or zero-pad ``x`` (at the end of each axis) to the expected local shape."""
    target = expected_sharded_ten.local_shape
    if tuple(x.shape) == tuple(target):
        return x
    if x.ndim != len(target):
        raise LoadMismatchError(f"{expected_sharded_ten.key!r}: cannot pad a {x.ndim}-d tensor to local shape {target}")
    out = torch.zeros(target, dtype=x.dtype, device=x.device)
    common = tuple(slice(0, min(a, b)) for a, b in zip(x.shape, target))
    out[common] = x[common]
    return out


def postprocess_numpy_array(
    loaded_array: np.ndarray, sharded_tensor: ShardedTensor, apply_flattened_range: bool = True
) -> torch.Tensor:
    """Turn a loaded numpy array into the tensor ``sharded_tensor`` expects (dtype, padding,
    flattened range)."""
    x = numpy_to_tensor(np.ascontiguousarray(loaded_array), sharded_tensor.dtype)
    if sharded_tensor.allow_shape_mismatch:
        x = pad_to_expected_shape(x, sharded_tensor)
    if apply_flattened_range:
        x = flatten_range(sharded_tensor, x)
    return x
