"""TensorStore's API as the TensorStore engine uses it: the one module of the zarr backend that
imports ``tensorstore``.

Both halves of the engine (`tensorstore_save`, `tensorstore_load`) open arrays through here: a
context without a chunk cache, the array's spec (the ``file`` kvstore driver on local disks, the
``s3`` driver configured from the checkpoint's ``S3Storage`` elsewhere), and the three ways an
array is opened -- to read (a missing chunk fails the read instead of reading as the fill value),
to write, and to create (an all-zero chunk is still written). Without ``tensorstore`` installed,
importing this module (and so either half of the engine) raises
[`MissingDependencyError`][dist_ckpt.errors.MissingDependencyError] naming the pip extra.

Also here: the engine's public helpers of Megatron-Core's ``strategies.tensorstore``
(`open_ts_array()`, `merge_global_slice_with_shape()`).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from dist_ckpt.errors import CorruptCheckpointError, LoadMismatchError, MissingDependencyError

try:
    import tensorstore as ts
except ImportError as _e:  # pragma: no cover -- exercised in a subprocess without tensorstore
    raise MissingDependencyError(
        f"the TensorStore engine of the 'zarr' backend needs the 'tensorstore' package ({_e}): "
        f"pip install 'dist_ckpt[tensorstore]'"
    ) from _e

from dist_ckpt.backends.zarr.layout import s3_storage
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.storage.object_path import ObjectPath

__all__ = [
    "ENGINE",
    "create_array",
    "memory_array",
    "merge_global_slice_with_shape",
    "open_for_read",
    "open_for_write",
    "open_ts_array",
    "ts_context",
    "wait_all",
]

#: how the engine's errors name it (e.g. when a checkpoint's storage is refused)
ENGINE = "the TensorStore engine"


def ts_context(concurrency: Optional[int]) -> "ts.Context":
    """A TensorStore context without a chunk cache (every byte is read once, into its
    destination) and, if given, a cap on concurrent file operations."""
    spec: Dict[str, Any] = {"cache_pool": {"total_bytes_limit": 0}}
    if concurrency is not None:
        spec["file_io_concurrency"] = {"limit": int(concurrency)}
        spec["data_copy_concurrency"] = {"limit": int(concurrency)}
    return ts.Context(spec)


def _spec(arr_path: ObjectPath) -> Dict[str, Any]:
    """The array's TensorStore spec: the ``file`` driver where the storage has ``local_paths``,
    else the ``s3`` driver configured from the storage (`checkpoint_node()` checked)."""
    if arr_path.storage.local_paths:
        return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(arr_path.local_path())}}
    return {"driver": "zarr3", "kvstore": s3_storage(arr_path).tensorstore_kvstore(arr_path.key)}


def _read_spec(arr_path: ObjectPath) -> Dict[str, Any]:
    """The spec of the array opened for reading: missing chunks make reads fail
    (``fill_missing_data_reads=False``) instead of returning the fill value."""
    return dict(_spec(arr_path), fill_missing_data_reads=False)


def open_for_read(arr_path: ObjectPath, context: "ts.Context") -> Any:
    """The future of the zarr v3 array at ``arr_path`` opened for reading (see `_read_spec()`)."""
    return ts.open(_read_spec(arr_path), open=True, read=True, context=context)


def open_for_write(arr_path: ObjectPath, context: "ts.Context") -> Any:
    """The future of the existing array at ``arr_path`` opened for writing whole chunks (an
    all-zero chunk is written too: ``store_data_equal_to_fill_value``)."""
    return ts.open(dict(_spec(arr_path), store_data_equal_to_fill_value=True), open=True, write=True, context=context)


def create_array(path: ObjectPath, metadata: Dict[str, Any], context: "ts.Context") -> Any:
    """The future of a new array at ``path`` with the zarr v3 ``metadata`` (see `nodes.array_metadata()`)."""
    # store_data_equal_to_fill_value: an all-zero chunk must still exist on disk, so that a
    # missing chunk can be told apart from a zero one
    spec = dict(_spec(path), metadata=metadata, store_data_equal_to_fill_value=True)
    return ts.open(spec, create=True, context=context)


def memory_array(array: np.ndarray) -> "ts.TensorStore":
    """``array``'s memory as a writable TensorStore (no copy): a read written into it lands in place."""
    return ts.array(array, copy=False, write=True)


def open_ts_array(
    arr_path: Union[ObjectPath, str, "os.PathLike[str]"], context: Optional["ts.Context"] = None
) -> "ts.TensorStore":
    """Open the zarr v3 array at ``arr_path`` for reading with TensorStore.

    Missing chunks make reads fail (``fill_missing_data_reads=False``) instead of returning the
    fill value, so a damaged checkpoint is never loaded as zeros. The array has its stored data
    type: raw bits (``uint16``, ``uint8``) for bfloat16 and float8 tensors (see
    `dist_ckpt.backends.zarr.layout`); `postprocess_numpy_array()` makes the tensor.

    Example:

    ```python
    arr = open_ts_array("ckpt/zarr/layer.weight")          # a local path, or a node of any storage
    first_rows = arr[0:4].read().result()   # numpy array
    tensor = postprocess_numpy_array(first_rows, sharded_tensor)   # its dtype, e.g. bfloat16
    ```
    """
    spec = _read_spec(ObjectPath.of(arr_path))
    try:
        return ts.open(spec, open=True, read=True, context=context or ts_context(None)).result()
    except Exception as e:  # noqa: BLE001 -- unreadable metadata means a damaged checkpoint
        raise CorruptCheckpointError(
            f"[rank {get_rank()}] cannot open zarr array {str(arr_path)!r} with TensorStore: {e}"
        ) from e


def merge_global_slice_with_shape(
    global_slice: Sequence[Union[int, slice]], actual_shape: Sequence[int], key: str
) -> Tuple[Union[int, slice], ...]:
    """Intersect a shard's global index with the stored tensor's shape (no overflow).

    With ``allow_shape_mismatch`` a requested shard may extend past the stored tensor; its
    index must be cut to the stored shape before indexing the array. Integer entries (prepended
    axes) and slice starts must lie inside the stored tensor.

    Example:

    ```python
    merge_global_slice_with_shape((0, slice(4, 12)), (2, 10), "w")  # -> (0, slice(4, 10))
    ```

    Raises:
        LoadMismatchError: the index has another number of axes, or starts outside the tensor.
    """
    if len(global_slice) != len(actual_shape):
        raise LoadMismatchError(
            f"{key!r}: index {tuple(global_slice)} has {len(global_slice)} axes, the stored tensor "
            f"has shape {tuple(actual_shape)}"
        )
    merged: List[Union[int, slice]] = []
    for axis, (index, size) in enumerate(zip(global_slice, actual_shape)):
        if isinstance(index, slice):
            start = 0 if index.start is None else index.start
            if not 0 <= start < size:
                raise LoadMismatchError(
                    f"{key!r}: along axis {axis} the requested range starts at {start}, outside the "
                    f"stored size {size}; nothing of this shard is stored"
                )
            stop = size if index.stop is None else min(index.stop, size)
            merged.append(slice(start, stop, index.step))
        else:
            if not 0 <= index < size:
                raise LoadMismatchError(f"{key!r}: index {index} along axis {axis} is outside the stored size {size}")
            merged.append(index)
    return tuple(merged)


def wait_all(pending: Sequence[Tuple[Any, Any]]) -> List[Tuple[Any, BaseException]]:
    """Wait for every future (never leave I/O running into memory we hand back); return the
    ``(tag, error)`` of those that failed."""
    failed: List[Tuple[Any, BaseException]] = []
    for tag, future in pending:
        try:
            future.result()
        except Exception as e:  # noqa: BLE001 -- collected and reported with context
            failed.append((tag, e))
    return failed
