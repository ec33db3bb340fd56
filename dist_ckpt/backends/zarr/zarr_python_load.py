"""The load side of the zarr-python engine of the zarr backend (``zarr``, version 1), and the
removal of stored tensors.

A load checks everything before the first read (`read_plan.plan_request()`: keys, dtypes, shapes,
coverage), then reads only the chunks each requested shard overlaps, several tensors at a time:
chunks of plain bytes on local disks from their files (`dist_ckpt.backends.zarr.direct`: a whole
chunk straight into its destination, else through a buffer of the chunk), the rest with
zarr-python. zarr-python returns the fill value
for a missing chunk, so the reader checks that every chunk it reads exists and has its size; with
``zarr/checksums.json`` every file read is checked against it, from the bytes zarr-python reads
(no extra I/O). See [`zarr_python`][dist_ckpt.backends.zarr.zarr_python] for the engine as a whole.
"""

from __future__ import annotations

import math
import os
import shutil
import uuid
from typing import Any, ClassVar, Dict, Mapping, Optional, Tuple, Union

import numpy as np
import torch
import zarr

from dist_ckpt.backends.base import load_destination
from dist_ckpt.backends.zarr.checksums import VerifyingStore, drop_from_checksums
from dist_ckpt.backends.zarr.direct import read_chunk_part
from dist_ckpt.backends.zarr.dtypes import register_extension_dtypes
from dist_ckpt.backends.zarr.layout import ZARR_DIR, checkpoint_node, chunk_coords, s3_storage
from dist_ckpt.backends.zarr.metadata import list_tensor_names, open_tensor_info
from dist_ckpt.backends.zarr.nodes import READ_BUDGET_BYTES, ByteBudget, in_threads
from dist_ckpt.backends.zarr.read_plan import ReadOp, ReadPlan
from dist_ckpt.backends.zarr.strategy_base import ShapeDtype, ZarrLoadStrategyBase
from dist_ckpt.backends.zarr.zarr_python_stores import ENGINE, Stores, as_storage_errors, client_error
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError
from dist_ckpt.integrity.checksums import FileDigest
from dist_ckpt.model.dict_utils import dict_list_map_inplace
from dist_ckpt.model.dtype_cast import copy_cast
from dist_ckpt.model.dtypes import numpy_to_tensor
from dist_ckpt.model.geometry import Box, piece_view, sub_view
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor, StateDict
from dist_ckpt.storage import Storage, fsync_dir
from dist_ckpt.storage.object_path import ObjectPath

__all__ = ["ZarrLoadShardedStrategy", "remove_tensor_objects"]


class _ArrayReader:
    """Reads regions of zarr arrays with zarr-python, refusing missing or short chunk files and,
    with ``stores``, files whose checksum differs from the manifest."""

    def __init__(
        self,
        root: ObjectPath,
        stores: Optional[VerifyingStore] = None,
        manifest: Optional[Mapping[str, FileDigest]] = None,
    ) -> None:
        self._arrays: Dict[ObjectPath, Any] = {}
        self._stores = stores
        self._manifest = manifest
        self._plain = Stores(read_only=True)
        self._verifying: Any = None
        if not root.storage.local_paths and stores is not None:  # one verifying store at zarr/
            zarr_dir = ObjectPath(root.storage.child(root.key))
            self._verifying = stores.open_objects(s3_storage(zarr_dir).obstore_store(), str(root))
        self._root = root

    def _store_of(self, path: ObjectPath) -> Tuple[Any, str]:
        if path.storage.local_paths:
            return (self._stores.open(path) if self._stores is not None else str(path.local_path())), ""
        if self._verifying is not None:
            return self._verifying, path.relative_to(self._root)
        return self._plain.at(path)

    def read_chunk_file(self, op: ReadOp, target: torch.Tensor, stored: torch.dtype, key: str) -> None:
        """Put ``op``'s part of the chunk file it names into ``target``, read without zarr and
        checked against the manifest (`dist_ckpt.backends.zarr.direct.read_chunk_part()`)."""
        read_chunk_part(op, target, stored, key, self._manifest, self._root)

    def read(self, path: ObjectPath, region: Box, key: str) -> np.ndarray:
        array: Any = self._arrays.get(path)
        if array is None:
            store, name = self._store_of(path)
            try:
                array = self._arrays[path] = zarr.open_array(store=store, path=name, mode="r")
            except CheckpointingException:
                raise
            except Exception as e:  # noqa: BLE001 -- unreadable metadata means a damaged checkpoint
                typed = client_error(path, e, "GET")
                if typed is not None:
                    raise typed from e
                raise CorruptCheckpointError(
                    f"[rank {get_rank()}] cannot open zarr array {str(path)!r} of tensor {key!r}: {e}"
                ) from e
        chunk_shape = array.metadata.chunk_grid.chunk_shape
        chunk_bytes = math.prod(chunk_shape) * array.dtype.itemsize
        for coords in chunk_coords(region, chunk_shape):
            chunk_file = path / array.metadata.encode_chunk_key(coords)
            try:  # through the storage: a link out of the checkpoint is refused before zarr opens the file
                size = chunk_file.stat().st_size
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"[rank {get_rank()}] chunk file {str(chunk_file)!r} of tensor {key!r} is missing; the checkpoint "
                    "is incomplete"
                ) from None
            if size != chunk_bytes:
                raise CorruptCheckpointError(
                    f"[rank {get_rank()}] chunk file {str(chunk_file)!r} of tensor {key!r} has {size} bytes, "
                    f"expected {chunk_bytes}: it is truncated or damaged"
                )
        try:
            return np.asarray(array[tuple(slice(o, o + s) for o, s in zip(region.offset, region.shape))])
        except CheckpointingException as e:  # e.g. a checksum mismatch, which names the file
            if repr(key) in str(e):
                raise
            raise type(e)(f"[rank {get_rank()}] tensor {key!r}: {e}") from None
        except Exception as e:  # noqa: BLE001 -- a decode failure means a damaged chunk
            typed = client_error(path, e, "GET")
            if typed is not None:
                raise typed from e
            raise CorruptCheckpointError(
                f"[rank {get_rank()}] cannot read tensor {key!r} from {str(path)!r} (region offset "
                f"{region.offset}, shape {region.shape}): {type(e).__name__}: {e}"
            ) from e


def _read_bytes(plan: ReadPlan) -> int:
    """The most memory reading ``plan`` takes besides its destination, for the read budget: each
    region zarr-python decodes, and one buffer of a chunk file at a time (the ops run in turn)."""
    decoded = sum(op.region.numel for op in plan.ops if op.chunk is None)
    chunk = max((op.chunk_box.numel for op in plan.ops if op.chunk_box is not None), default=0)
    return (decoded + chunk) * plan.stored_dtype.itemsize


class ZarrLoadShardedStrategy(ZarrLoadStrategyBase):
    """Loads zarr checkpoints into any sharding, reading only the chunks each shard overlaps.

    Tensors are loaded in place into ``ShardedTensor.data`` when it is allocated with the right
    shape (any device); otherwise new CPU tensors are returned. Each region read (one chunk's
    worth at most) is decoded in its stored dtype and converted while copied into place when the
    request asks for another dtype.

    Args:
        verify_checksums: check every file read against ``zarr/checksums.json`` (when the
            checkpoint has one).
        allow_dtype_cast: a requested dtype may differ from the stored one (see
            `dist_ckpt.model.dtype_cast`); False raises ``LoadMismatchError`` instead.
    """

    object_storage: ClassVar[bool] = True
    engine: ClassVar[str] = ENGINE

    def __init__(self, verify_checksums: bool = True, allow_dtype_cast: bool = True) -> None:
        register_extension_dtypes()  # checkpoints that stored "data_type": "bfloat16" (before raw bits)
        self.verify_checksums = verify_checksums
        self.allow_dtype_cast = allow_dtype_cast

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> StateDict:
        planned = self._plan_load(sharded_state_dict, checkpoint_dir)  # checks first
        root, manifest, plans = planned.node / ZARR_DIR, planned.manifest, planned.plans
        reader = _ArrayReader(root, VerifyingStore(root, manifest) if manifest is not None else None, manifest)

        budget = ByteBudget(READ_BUDGET_BYTES)

        def load_one(x: Any) -> Any:
            if not isinstance(x, ShardedTensor):
                return x
            dest = load_destination(x)
            holder = Box(x.global_offset, x.full_local_shape)
            plan = plans[id(x)]
            for piece, _ in plan.pad:
                piece_view(dest, piece, x.prepend_axis_num, holder).zero_()
            with budget.hold(_read_bytes(plan)):
                for op in plan.ops:
                    self._copy(reader, op, dest, x, holder, plan.stored_dtype)
            return dest

        # several tensors at a time: their reads are in flight together (a cold load waits on
        # the disk, not on one chunk file after another)
        loaded = dict(zip(map(id, planned.requested), in_threads(load_one, planned.requested)))
        return dict_list_map_inplace(  # type: ignore[no-any-return]
            lambda x: loaded[id(x)] if isinstance(x, ShardedTensor) else x, sharded_state_dict
        )

    @staticmethod
    def _copy(
        reader: _ArrayReader, op: ReadOp, dest: torch.Tensor, sh: ShardedTensor, holder: Box, stored: torch.dtype
    ) -> None:
        target = op.target_in(dest, sh.prepend_axis_num, holder)
        if op.chunk is not None:
            reader.read_chunk_file(op, target, stored, sh.key)
            return
        data = numpy_to_tensor(reader.read(op.array_path, op.region, sh.key), stored).view(op.src_box.shape)
        copy_cast(target, sub_view(data, op.src_box, op.inter))

    def with_dtype_cast(self, allow: bool) -> "ZarrLoadShardedStrategy":
        """This loader with ``allow_dtype_cast`` set to ``allow``."""
        if self.allow_dtype_cast == allow:
            return self
        return ZarrLoadShardedStrategy(self.verify_checksums, allow)

    def _shape_dtype(self, node: ObjectPath) -> ShapeDtype:
        stores = Stores(read_only=True)

        def shape_dtype(path: Union[str, ObjectPath]) -> Tuple[Tuple[int, ...], np.dtype]:
            store, name = stores.at(path) if isinstance(path, ObjectPath) else (path, "")  # a str: a local path
            with as_storage_errors(path if isinstance(path, ObjectPath) else node, "GET"):
                array = zarr.open_array(store=store, path=name, mode="r")
            return tuple(array.shape), np.dtype(array.dtype)

        return shape_dtype

    def remove_sharded_tensors(self, checkpoint_dir: Storage, key_prefix: str) -> None:
        """Delete tensors whose key starts with ``key_prefix``; each key goes whole or not at all
        (on an object store, which cannot rename: its ``zarr.json`` goes first, and from then on
        the key is absent)."""
        node = checkpoint_node(checkpoint_dir, ENGINE)
        if not node.storage.local_paths:
            remove_tensor_objects(node / ZARR_DIR, key_prefix)
            return
        root = node / ZARR_DIR
        directory = root.local_path()
        for name in list_tensor_names(root):
            info = open_tensor_info(root, name)
            if info is not None and info.key.startswith(key_prefix):
                trash = directory / f".removing-{uuid.uuid4().hex}"
                os.replace(directory / name, trash)  # atomic: the key disappears in one step
                fsync_dir(directory)
                drop_from_checksums(root, name)
                shutil.rmtree(trash)


def remove_tensor_objects(root: ObjectPath, key_prefix: str) -> None:
    """[`ZarrLoadShardedStrategy.remove_sharded_tensors()`][dist_ckpt.backends.zarr.zarr_python.ZarrLoadShardedStrategy.remove_sharded_tensors]
    on an object store (either engine's checkpoints: the layout is the same)."""
    zarr_dir = root.storage.child(root.key)
    for name in list_tensor_names(root):
        info = open_tensor_info(root, name)
        if info is not None and info.key.startswith(key_prefix):
            zarr_dir.delete(f"{name}/zarr.json")  # the key is gone from here on
            drop_from_checksums(root, name)
            zarr_dir.delete_prefix(name)
