"""The Zarr backend (``zarr``, version 1): zarr v3 arrays written with zarr-python 3.

Layout inside a checkpoint directory (every node is plain zarr v3, uncompressed little-endian
``bytes`` codec, so TensorStore and any zarr v3 reader open it)::

    zarr/zarr.json                          root group
    zarr/<key>/zarr.json                    a tensor saved as a regular grid of shards:
    zarr/<key>/c/<i>/<j>...                   one zarr chunk per saved shard
    zarr/<key>/zarr.json                    a tensor saved as flattened ranges (distributed
    zarr/<key>/<chunk>_<start>/...            optimizer): a group of 1-D fragment arrays

A chunk is exactly one main-replica shard, so each chunk file is written once, by one rank, with
no read-modify-write. Flattened shards cannot be chunk-aligned (their boundaries are arbitrary),
so each becomes its own 1-D array. Array attributes carry ``{"dist_ckpt": {...}}``: the key,
the dtype name, and for fragments their global offset and flat range.

Loads read only the chunks that overlap the requested shard. zarr-python returns the fill value
for a missing chunk; the loader checks that every chunk it reads exists, so a deleted chunk is
reported instead of silently read as zeros.

Checksums: the save ends with ``zarr/checksums.json``, a crc32c of every file under ``zarr/``
(see :mod:`.zarr_checksums`); the loader checks every file it reads against it, from the bytes
zarr-python reads (no extra I/O).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import uuid
from itertools import product
from pathlib import Path
from typing import Any, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import zarr
from zarr.codecs import BytesCodec

from ..checksums import IntegrityReport
from ..dict_utils import dict_list_map_inplace, nested_values
from ..distributed import get_rank, run_collectively
from ..dtypes import dtype_info, numpy_to_tensor, tensor_to_numpy
from ..errors import CheckpointingException, CorruptCheckpointError
from ..geometry import Box, piece_view, sub_view
from ..mapping import ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from ..storage.location import CheckpointLocation, require_local
from ..storage import fsync_dir, fsync_file
from ._zarr_dtypes import register_extension_dtypes
from .stored_shards import StoredShardInfo, describe_zarr
from .base import LoadShardedStrategy, SaveShardedStrategy, TensorLayout, TensorStreamWriter, check_stream_entry
from .zarr_checksums import (
    VerifyingStore,
    commit_checksums,
    drop_from_checksums,
    read_checksums,
    verify_zarr,
)
from .zarr_layout import (
    ATTR,
    FRAGMENT_CHUNK_ELEMENTS,
    LAYOUT_CHUNKED,
    LAYOUT_FLATTENED,
    ZARR_DIR,
    ReadOp,
    flatten_range,
    fragment_name,
    list_tensor_names,
    load_zarr_based_sharded_metadata,
    open_tensor_info,
    pad_to_expected_shape,
    plan_request,
    postprocess_numpy_array,
    tensor_dir,
)

__all__ = [
    "ZarrLoadShardedStrategy",
    "ZarrSaveShardedStrategy",
    "flatten_range",
    "load_zarr_based_sharded_metadata",
    "pad_to_expected_shape",
    "postprocess_numpy_array",
    "register_default_zarr_strategies",
]

logger = logging.getLogger(__name__)

_ARRAY_OPTIONS: Dict[str, Any] = {"serializer": BytesCodec(), "compressors": None, "fill_value": 0}
# zarr skips chunks equal to the fill value by default; every chunk must exist on disk so that a
# missing chunk can be told apart from an all-zero one (zarr reads both as zeros)
_WRITE_EMPTY: Any = {"write_empty_chunks": True}


def _is_origin(sh: ShardedTensor) -> bool:
    return not any(sh.global_offset)


def _cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def _fsync_tree(paths: Sequence[Path], stop_at: Path) -> None:
    """fsync files, then every directory from their parents up to ``stop_at``."""
    dirs = set()
    for p in paths:
        fsync_file(p)
        parent = p.parent
        while parent != stop_at and stop_at in parent.parents:
            dirs.add(parent)
            parent = parent.parent
    dirs.add(stop_at)
    for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
        fsync_dir(d)


class ZarrSaveShardedStrategy(SaveShardedStrategy):
    """Writes each main-replica shard as one zarr chunk (or one fragment array if flattened).

    Three collective steps: (1) the rank holding the first chunk of each tensor creates its array
    (or group) and flattened fragments are written; (2) every rank writes its chunks into the
    arrays; (3) the ranks digest the files they wrote and rank 0 writes ``zarr/checksums.json``.
    Each step ends with an error exchange, so a failure on one rank raises everywhere.
    """

    owned_paths: ClassVar[Tuple[str, ...]] = (ZARR_DIR,)
    can_stream: ClassVar[bool] = True

    def __init__(self, backend: str = "zarr", version: int = 1) -> None:
        super().__init__(backend, version)
        register_extension_dtypes()

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointLocation) -> None:
        root = require_local(checkpoint_dir, "the zarr backend") / ZARR_DIR
        shards = [
            s
            for s in nested_values(sharded_state_dict)
            if isinstance(s, ShardedTensor) and is_main_replica(s.replica_id)
        ]
        created = run_collectively("creating zarr arrays", lambda: self._create_nodes(root, shards))
        chunks = run_collectively("writing zarr chunks", lambda: self._write_chunks(root, shards))
        commit_checksums(root, created + chunks)

    def begin_stream(self, checkpoint_dir: CheckpointLocation, layout: Sequence[TensorLayout]) -> TensorStreamWriter:
        """Write whole tensors one at a time, each one chunk (one process): the checkpoint a
        one-rank save of whole tensors writes, ``zarr/checksums.json`` included."""
        return _ZarrStreamWriter(self, require_local(checkpoint_dir, "the zarr backend") / ZARR_DIR, layout)

    def _create_nodes(self, root: Path, shards: List[ShardedTensor], create_root: bool = True) -> List[Path]:
        root.mkdir(parents=True, exist_ok=True)
        written: List[Path] = []
        if get_rank() == 0 and create_root:
            zarr.create_group(store=str(root), overwrite=False)
            written.append(root / "zarr.json")
        for sh in shards:
            info = dtype_info(sh.dtype)
            path = tensor_dir(root, sh.key)
            attrs = {"key": sh.key, "dtype": info.name}
            if sh.flattened_range is None:
                if _is_origin(sh):
                    zarr.create_array(
                        store=str(path),
                        shape=sh.global_shape,
                        chunks=tuple(max(1, c) for c in sh.full_local_shape),
                        dtype=info.numpy_dtype,
                        attributes={ATTR: dict(attrs, layout=LAYOUT_CHUNKED)},
                        overwrite=False,
                        config=_WRITE_EMPTY,
                        **_ARRAY_OPTIONS,
                    )
                    written.append(path / "zarr.json")
                continue
            start, stop = sh.flattened_range.start, sh.flattened_range.stop
            chunk_numel = math.prod(sh.local_shape)
            if _is_origin(sh) and start == 0 and (stop > 0 or chunk_numel == 0):
                group_attrs = dict(
                    attrs,
                    layout=LAYOUT_FLATTENED,
                    global_shape=list(sh.global_shape),
                    chunk_shape=list(sh.full_local_shape),
                )
                zarr.create_group(store=str(path), attributes={ATTR: group_attrs}, overwrite=False)
                written.append(path / "zarr.json")
            if stop > start:
                written += self._write_fragment(path / fragment_name(sh), sh)
        _fsync_tree(written, root)
        return written

    @staticmethod
    def _write_fragment(path: Path, sh: ShardedTensor) -> List[Path]:
        assert sh.flattened_range is not None and sh.data is not None
        start, stop = sh.flattened_range.start, sh.flattened_range.stop
        length = stop - start
        chunk = min(length, FRAGMENT_CHUNK_ELEMENTS)
        arr = zarr.create_array(
            store=str(path),
            shape=(length,),
            chunks=(chunk,),
            dtype=dtype_info(sh.dtype).numpy_dtype,
            attributes={ATTR: {"global_offset": list(sh.global_offset), "flat_range": [start, stop]}},
            overwrite=False,
            config=_WRITE_EMPTY,
            **_ARRAY_OPTIONS,
        )
        arr[:] = tensor_to_numpy(_cpu_contiguous(sh.data))
        chunk_files = [path / arr.metadata.encode_chunk_key((i,)) for i in range(math.ceil(length / chunk))]
        return [path / "zarr.json"] + chunk_files

    def _write_chunks(self, root: Path, shards: List[ShardedTensor]) -> List[Path]:
        arrays: Dict[str, Any] = {}
        written: List[Path] = []
        for sh in shards:
            if sh.flattened_range is not None or math.prod(sh.local_shape) == 0:
                continue
            assert sh.data is not None, f"{sh.key!r} has no data to save"
            path = tensor_dir(root, sh.key)
            if sh.key not in arrays:
                arrays[sh.key] = zarr.open_array(store=str(path), mode="r+").with_config(_WRITE_EMPTY)
            arr = arrays[sh.key]
            local = tensor_to_numpy(_cpu_contiguous(sh.data)).reshape(sh.full_local_shape)
            region = tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sh.full_local_shape))
            arr[region] = local
            written.append(path / arr.metadata.encode_chunk_key(sh.local_chunk_offset_in_global()))
        _fsync_tree(written, root)
        return written


class _ZarrStreamWriter(TensorStreamWriter):
    """Creates the root group, then each tensor's array and its one chunk as it is added; the
    checksum manifest at :meth:`finish` (see :meth:`ZarrSaveShardedStrategy.begin_stream`)."""

    def __init__(self, strategy: ZarrSaveShardedStrategy, root: Path, layout: Sequence[TensorLayout]) -> None:
        self.strategy, self.root, self.layout = strategy, root, list(layout)
        root.mkdir(parents=True, exist_ok=False)
        zarr.create_group(store=str(root), overwrite=False)
        self.written: List[Path] = [root / "zarr.json"]
        self._added = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        check_stream_entry(self.layout, self._added, key, tensor)
        self._added += 1
        sh = [ShardedTensor.from_rank_offsets(key, tensor.detach())]
        self.written += self.strategy._create_nodes(self.root, sh, create_root=False)
        self.written += self.strategy._write_chunks(self.root, sh)

    def finish(self) -> None:
        if self._added != len(self.layout):
            raise CheckpointingException(
                f"the stream into {self.root} finished after {self._added} of its {len(self.layout)} tensors"
            )
        _fsync_tree([self.root / "zarr.json"], self.root)
        commit_checksums(self.root, self.written)


def _destination(sh: ShardedTensor) -> torch.Tensor:
    """The tensor to load into: ``sh.data`` when it is real memory of the right shape, else new."""
    shape = sh.local_shape if sh.flattened_range is None else (sh.flattened_range.stop - sh.flattened_range.start,)
    data = sh.data
    if data is not None and data.device.type != "meta" and tuple(data.shape) == tuple(shape):
        return data
    return torch.empty(shape, dtype=sh.dtype)


def _chunk_coords(region: Box, chunk_shape: Sequence[int]) -> Iterator[Tuple[int, ...]]:
    ranges = [range(o // c, (o + s - 1) // c + 1) for o, s, c in zip(region.offset, region.shape, chunk_shape)]
    return product(*ranges)


class _ArrayReader:
    """Reads regions of zarr arrays with zarr-python, refusing missing or short chunk files and,
    with ``stores``, files whose checksum differs from the manifest."""

    def __init__(self, stores: Optional[VerifyingStore] = None) -> None:
        self._arrays: Dict[Path, Any] = {}
        self._stores = stores

    def read(self, path: Path, region: Box, key: str) -> np.ndarray:
        array: Any = self._arrays.get(path)
        if array is None:
            store = self._stores.open(path) if self._stores is not None else str(path)
            try:
                array = self._arrays[path] = zarr.open_array(store=store, mode="r")
            except CheckpointingException:
                raise
            except Exception as e:  # noqa: BLE001 -- unreadable metadata means a damaged checkpoint
                raise CorruptCheckpointError(f"[rank {get_rank()}] cannot open zarr array {str(path)!r} of tensor {key!r}: {e}") from e
        chunk_shape = array.metadata.chunk_grid.chunk_shape
        chunk_bytes = math.prod(chunk_shape) * array.dtype.itemsize
        for coords in _chunk_coords(region, chunk_shape):
            chunk_file = path / array.metadata.encode_chunk_key(coords)
            try:
                size = chunk_file.stat().st_size
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"[rank {get_rank()}] chunk file {str(chunk_file)!r} of tensor {key!r} is missing; the checkpoint is incomplete"
                ) from None
            if size != chunk_bytes:
                raise CorruptCheckpointError(
                    f"[rank {get_rank()}] chunk file {str(chunk_file)!r} of tensor {key!r} has {size} bytes, "
                    f"expected {chunk_bytes}: it is truncated or damaged"
                )
        try:
            return np.asarray(array[tuple(slice(o, o + s) for o, s in zip(region.offset, region.shape))])
        except CheckpointingException:
            raise  # e.g. a checksum mismatch, which names the file
        except Exception as e:  # noqa: BLE001 -- a decode failure means a damaged chunk
            raise CorruptCheckpointError(
                f"[rank {get_rank()}] cannot read tensor {key!r} from {str(path)!r} (region offset "
                f"{region.offset}, shape {region.shape}): {type(e).__name__}: {e}"
            ) from e


class ZarrLoadShardedStrategy(LoadShardedStrategy):
    """Loads zarr checkpoints into any sharding, reading only the chunks each shard overlaps.

    Tensors are loaded in place into ``ShardedTensor.data`` when it is allocated with the right
    shape (any device); otherwise new CPU tensors are returned.

    Args:
        verify_checksums: check every file read against ``zarr/checksums.json`` (when the
            checkpoint has one).
    """

    supported_backends: ClassVar[Tuple[str, ...]] = ("zarr",)
    supported_versions: ClassVar[Tuple[int, ...]] = (1,)

    def __init__(self, verify_checksums: bool = True) -> None:
        register_extension_dtypes()
        self.verify_checksums = verify_checksums

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: CheckpointLocation) -> StateDict:
        requested = [s for s in nested_values(sharded_state_dict) if isinstance(s, ShardedTensor)]
        plans = plan_request(requested, require_local(checkpoint_dir, "the zarr backend"))  # every check happens before any read
        root = require_local(checkpoint_dir, "the zarr backend") / ZARR_DIR
        manifest = read_checksums(require_local(checkpoint_dir, "the zarr backend")) if self.verify_checksums and requested else None
        reader = _ArrayReader(VerifyingStore(root, manifest) if manifest is not None else None)

        def load_one(x: Any) -> Any:
            if not isinstance(x, ShardedTensor):
                return x
            dest = _destination(x)
            holder = Box(x.global_offset, x.full_local_shape)
            plan = plans[id(x)]
            for piece, _ in plan.pad:
                piece_view(dest, piece, x.prepend_axis_num, holder).zero_()
            for op in plan.ops:
                self._copy(reader, op, dest, x, holder)
            return dest

        return dict_list_map_inplace(load_one, sharded_state_dict)  # type: ignore[no-any-return]

    @staticmethod
    def _copy(reader: _ArrayReader, op: ReadOp, dest: torch.Tensor, sh: ShardedTensor, holder: Box) -> None:
        data = numpy_to_tensor(reader.read(op.array_path, op.region, sh.key), sh.dtype).view(op.src_box.shape)
        target = piece_view(dest, op.dst, sh.prepend_axis_num, holder)
        sub_view(target, op.dst.box, op.inter).copy_(sub_view(data, op.src_box, op.inter))

    def load_tensors_metadata(self, checkpoint_dir: CheckpointLocation) -> ShardedStateDict:
        def shape_dtype(path: str) -> Tuple[Tuple[int, ...], np.dtype]:
            array = zarr.open_array(store=path, mode="r")
            return tuple(array.shape), np.dtype(array.dtype)

        return load_zarr_based_sharded_metadata(require_local(checkpoint_dir, "the zarr backend"), shape_dtype)

    def verify_integrity(self, checkpoint_dir: CheckpointLocation) -> IntegrityReport:
        """Every file of ``zarr/`` against ``zarr/checksums.json`` (see :mod:`.zarr_checksums`)."""
        return verify_zarr(require_local(checkpoint_dir, "the zarr backend"))

    def describe_stored_shards(self, checkpoint_dir: CheckpointLocation) -> Optional[Dict[str, List[StoredShardInfo]]]:
        """Every chunk (a saved shard) or fragment (a saved flattened range), from the metadata."""
        return describe_zarr(require_local(checkpoint_dir, "the zarr backend"))

    def remove_sharded_tensors(self, checkpoint_dir: CheckpointLocation, key_prefix: str) -> None:
        """Delete tensors whose key starts with ``key_prefix``; each key goes whole or not at all."""
        root = require_local(checkpoint_dir, "the zarr backend") / ZARR_DIR
        for name in list_tensor_names(root):
            info = open_tensor_info(root, name)
            if info is not None and info.key.startswith(key_prefix):
                trash = root / f".removing-{uuid.uuid4().hex}"
                os.replace(root / name, trash)  # atomic: the key disappears in one step
                fsync_dir(root)
                drop_from_checksums(root, name)
                shutil.rmtree(trash)


def register_default_zarr_strategies() -> None:
    """Make the Zarr strategies the defaults for ``("zarr", 1)`` (they already are, lazily)."""
    from .base import StrategyAction, register_default_strategy

    register_default_strategy(StrategyAction.SAVE_SHARDED, "zarr", 1, ZarrSaveShardedStrategy, override=True)
    register_default_strategy(StrategyAction.LOAD_SHARDED, "zarr", 1, ZarrLoadShardedStrategy, override=True)
