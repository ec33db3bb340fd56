"""The TensorStore engine for the zarr backend (``zarr``, version 1).

It reads and writes exactly the layout of `zarr_layout` -- zarr v3, one chunk per saved
shard, one 1-D fragment array per flattened shard, the same ``dist_ckpt`` attributes -- with
TensorStore instead of zarr-python, so a checkpoint written by either engine loads with the
other, bit for bit, for every dtype of `dist_ckpt.model.dtypes`.

Why a second engine: TensorStore runs I/O on its own thread pool and returns futures. A rank
issues all its reads (or writes) before waiting for any, so they proceed concurrently, and a
whole-chunk read lands directly in the destination tensor without a staging copy.

Missing data is never read as zeros: arrays are opened with ``fill_missing_data_reads=False``
(a missing chunk fails the read), and a failed read is reported as a
[`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError] naming the key and the damaged chunk file.

Local disks: whole plain chunks are read and written, and array metadata written, without
TensorStore (`dist_ckpt.backends.zarr.direct`: one read straight into the destination, checked
from the bytes read); TensorStore reads the rest (partial chunks, fragments, dtype conversions,
other codecs) and does all the I/O on object stores.

Checksums: saves end with ``zarr/checksums.json``, like the zarr-python engine's. TensorStore
decodes chunks in its own threads without showing their bytes, so for the reads TensorStore does
the loader checks every chunk file by reading it once before TensorStore does (a second pass over
those bytes, the second one from the page cache); ``verify_checksums=False`` skips it (see
`zarr_checksums`).

Object stores: an ``s3://`` checkpoint is written and read by TensorStore's own ``s3`` kvstore
driver, configured from the checkpoint's ``S3Storage``
([`tensorstore_kvstore()`][dist_ckpt.storage.s3.S3Storage.tensorstore_kvstore]: bucket, path, region, endpoint,
retries; credentials from the same AWS environment). Chunks are PUT whole
(``store_data_equal_to_fill_value=True``: an all-zero chunk is written, never deleted), nothing
is fsynced, and -- since TensorStore never shows the bytes -- both the save's digests and the
load's checksum verification download each chunk object once more (pass
``verify_checksums=False`` to load without the second download).

Selecting it (the zarr-python engine stays the registered default):

```python
from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreLoadShardedStrategy
dc.load(sd, "ckpt", sharded_strategy=TensorStoreLoadShardedStrategy())
register_default_tensorstore_strategies()  # or: make it the default loader, as Megatron does
```
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Deque, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError, LoadMismatchError, MissingDependencyError

try:
    import tensorstore as ts
except ImportError as _e:  # pragma: no cover -- exercised in a subprocess without tensorstore
    raise MissingDependencyError(
        f"the TensorStore engine of the 'zarr' backend needs the 'tensorstore' package ({_e}): "
        f"pip install 'dist_ckpt[tensorstore]'"
    ) from _e

from dist_ckpt.backends.base import LoadShardedStrategy, SaveShardedStrategy, loaded_shape, main_replica_shards
from dist_ckpt.backends.stored_shards import StoredShardInfo
from dist_ckpt.backends.zarr.checksums import (
    MANIFEST_KEY,
    check_files,
    chunk_files,
    commit_checksums,
    manifest_check,
    read_checksums,
    verify_zarr,
)
from dist_ckpt.backends.zarr.direct import (
    can_read_directly,
    direct_writes,
    read_chunk_into,
    write_array_json,
    write_chunk_file,
    written_files,
)
from dist_ckpt.backends.zarr.layout import (
    ATTR,
    PARTIAL_ZARR_DIR,
    ZARR_DIR,
    checkpoint_node,
    chunk_key,
    fragment_chunk_elements,
    fragment_name,
    s3_storage,
    tensor_dir,
)
from dist_ckpt.backends.zarr.megatron import load_zarr_based_sharded_metadata
from dist_ckpt.backends.zarr.metadata import damaged_chunks, describe_zarr
from dist_ckpt.backends.zarr.nodes import (
    array_chunk_shape,
    array_metadata,
    as_stored,
    chunked_attributes,
    cpu_contiguous,
    creates_array,
    creates_flattened_group,
    flattened_attributes,
    fragment_attributes,
    fsync_written,
    in_threads,
    publish_written,
    write_group,
    writing_root,
)
from dist_ckpt.backends.zarr.read_plan import ReadOp, ReadPlan, plan_request
from dist_ckpt.engine.distributed import get_rank, run_collectively
from dist_ckpt.engine.registry import StrategyAction, register_default_strategy
from dist_ckpt.integrity.checksums import FileDigest, IntegrityReport, bytes_digest
from dist_ckpt.model.dict_utils import dict_list_map_inplace, nested_values
from dist_ckpt.model.dtype_cast import copy_cast
from dist_ckpt.model.dtypes import numpy_to_tensor, tensor_to_numpy
from dist_ckpt.model.geometry import Box, piece_view, sub_view
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor, StateDict
from dist_ckpt.storage import Storage
from dist_ckpt.storage.object_path import ObjectPath

__all__ = [
    "TensorStoreLoadShardedStrategy",
    "TensorStoreSaveShardedStrategy",
    "merge_global_slice_with_shape",
    "open_ts_array",
    "register_default_tensorstore_strategies",
]

logger = logging.getLogger(__name__)

#: staged (fragment) reads in flight are capped at this many bytes, bounding extra memory
DEFAULT_MAX_STAGED_BYTES = 256 << 20


def _context(concurrency: Optional[int]) -> "ts.Context":
    """A TensorStore context without a chunk cache (every byte is read once, into its
    destination) and, if given, a cap on concurrent file operations."""
    spec: Dict[str, Any] = {"cache_pool": {"total_bytes_limit": 0}}
    if concurrency is not None:
        spec["file_io_concurrency"] = {"limit": int(concurrency)}
        spec["data_copy_concurrency"] = {"limit": int(concurrency)}
    return ts.Context(spec)


_ENGINE = "the TensorStore engine"


def _spec(arr_path: ObjectPath) -> Dict[str, Any]:
    """The array's TensorStore spec: the ``file`` driver where the storage has ``local_paths``,
    else the ``s3`` driver configured from the storage (`checkpoint_node()` checked)."""
    if arr_path.storage.local_paths:
        return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(arr_path.local_path())}}
    return {"driver": "zarr3", "kvstore": s3_storage(arr_path).tensorstore_kvstore(arr_path.key)}


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
    spec = dict(_spec(ObjectPath.of(arr_path)), fill_missing_data_reads=False)
    try:
        return ts.open(spec, open=True, read=True, context=context or _context(None)).result()
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


def _wait_all(pending: Sequence[Tuple[Any, Any]]) -> List[Tuple[Any, BaseException]]:
    """Wait for every future (never leave I/O running into memory we hand back); return the
    ``(tag, error)`` of those that failed."""
    failed: List[Tuple[Any, BaseException]] = []
    for tag, future in pending:
        try:
            future.result()
        except Exception as e:  # noqa: BLE001 -- collected and reported with context
            failed.append((tag, e))
    return failed


# --------------------------------------------------------------------------- save


class TensorStoreSaveShardedStrategy(SaveShardedStrategy):
    """Writes each main-replica shard as one zarr chunk (one fragment array if flattened).

    Two collective steps, each ending with an error exchange: (1) the holder of each tensor's
    first chunk creates its array (or group), flattened shards create their fragment arrays;
    (2) every rank issues the writes of all its chunks at once, waits for them, and fsyncs the
    files and directories it wrote. Each chunk is written once, whole, by one rank.
    """

    owned_paths: ClassVar[Tuple[str, ...]] = (ZARR_DIR, PARTIAL_ZARR_DIR)
    object_storage: ClassVar[bool] = True
    integrity_records: ClassVar[Tuple[str, ...]] = (MANIFEST_KEY,)

    def __init__(self, backend: str = "zarr", version: int = 1, *, concurrency: Optional[int] = None) -> None:
        if (backend, version) != ("zarr", 1):
            raise CheckpointingException(
                f"TensorStoreSaveShardedStrategy writes backend ('zarr', 1) only, got ({backend!r}, {version})"
            )
        super().__init__(backend, version)
        self.concurrency = concurrency

    def check_location(self, checkpoint_dir: Storage) -> None:
        """Local directories and S3 (TensorStore's s3 driver); other object stores are refused."""
        checkpoint_node(checkpoint_dir, _ENGINE)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> None:
        node = checkpoint_node(checkpoint_dir, _ENGINE)
        root = writing_root(node)  # renamed to zarr/ once complete (local disks)
        shards = main_replica_shards(sharded_state_dict)
        context = _context(self.concurrency)
        # 1. tensor nodes exist before any rank writes into them
        created_digests: Dict[ObjectPath, FileDigest] = {}
        created = run_collectively(
            "creating zarr arrays (tensorstore)", lambda: self._create_nodes(root, shards, context, created_digests)
        )
        # 2. every chunk, concurrently, then durable
        digests: Dict[ObjectPath, FileDigest] = dict(created_digests)

        def write() -> List[ObjectPath]:
            chunks = self._write_chunks(root, shards, context, digests)
            fsync_written(created + chunks, root)  # this rank's arrays and chunks: one syncfs
            return chunks

        chunks = run_collectively("writing zarr chunks (tensorstore)", write)
        # 3. rank 0 records the checksum of every file written, then gives the tree its name
        commit_checksums(root, created + chunks, digests)
        run_collectively("publishing the zarr tree", lambda: publish_written(node) if get_rank() == 0 else None)

    @staticmethod
    def _create_nodes(
        root: ObjectPath, shards: List[ShardedTensor], context: "ts.Context", digests: Dict[ObjectPath, FileDigest]
    ) -> List[ObjectPath]:
        """Create this rank's nodes; the digests of those written directly go into ``digests``."""
        root.mkdir()
        written: List[ObjectPath] = []
        if get_rank() == 0:
            written.append(write_group(root, {}))
        pending: List[Tuple[Tuple[str, ObjectPath], Any]] = []
        direct: List[Tuple[ObjectPath, Dict[str, Any]]] = []
        for sh in shards:
            path = tensor_dir(root, sh.key)
            if sh.flattened_range is None:
                if creates_array(sh):
                    meta = array_metadata(sh.global_shape, array_chunk_shape(sh), sh.dtype, chunked_attributes(sh))
                    if direct_writes(root):  # the same document TensorStore would write, without its per-array work
                        direct.append((path, meta))
                    else:
                        pending.append(((sh.key, path), _create_array(path, meta, context)))
                continue
            if creates_flattened_group(sh):
                written.append(write_group(path, {ATTR: flattened_attributes(sh)}))
            length = sh.flattened_range.stop - sh.flattened_range.start
            if length > 0:
                frag = path / fragment_name(sh)
                meta = array_metadata((length,), (fragment_chunk_elements(length),), sh.dtype, fragment_attributes(sh))
                pending.append(((sh.key, frag), _create_array(frag, meta, context)))
        written += written_files(in_threads(lambda item: write_array_json(*item), direct), digests)
        failed = _wait_all(pending)
        if failed:
            (key, path), error = failed[0]
            raise CheckpointingException(
                f"[rank {get_rank()}] cannot create the zarr array of {key!r} at {str(path)!r}: {error}"
                + (f" ({len(failed) - 1} more arrays failed)" if len(failed) > 1 else "")
            ) from error
        written += [path / "zarr.json" for (_, path), _ in pending]
        return written  # made durable with the chunks

    @staticmethod
    def _write_chunks(
        root: ObjectPath, shards: List[ShardedTensor], context: "ts.Context", digests: Dict[ObjectPath, FileDigest]
    ) -> List[ObjectPath]:
        """Write every chunk, concurrently (the caller makes them durable). A chunk of a tensor saved as a
        grid is its shard's bytes exactly (uncompressed, little-endian), so its digest goes into
        ``digests`` from memory: the manifest then needs no second read of the file."""
        targets: List[Tuple[ShardedTensor, ObjectPath, Tuple[slice, ...], np.ndarray, List[ObjectPath]]] = []
        direct: List[Tuple[ShardedTensor, np.ndarray]] = []
        for sh in shards:
            if sh.data is None:
                raise CheckpointingException(f"[rank {get_rank()}] main replica of {sh.key!r} has no data to save")
            data = as_stored(tensor_to_numpy(cpu_contiguous(sh.data)), sh.dtype)
            if sh.flattened_range is None:
                if math.prod(sh.local_shape) == 0:
                    continue
                if direct_writes(root):  # one file from the tensor's memory (see `direct`)
                    direct.append((sh, data))
                    continue
                path = tensor_dir(root, sh.key)
                region = tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sh.full_local_shape))
                files = [path / chunk_key(sh.local_chunk_offset_in_global())]
                targets.append((sh, path, region, data.reshape(sh.full_local_shape), files))
                if sys.byteorder == "little":  # the bytes the file will hold
                    digests[files[0]] = bytes_digest(data.reshape(-1).view(np.uint8))
                continue
            length = sh.flattened_range.stop - sh.flattened_range.start
            if length == 0:
                continue
            path = tensor_dir(root, sh.key) / fragment_name(sh)
            chunk = fragment_chunk_elements(length)
            files = [path / chunk_key((i,)) for i in range(math.ceil(length / chunk))]
            targets.append((sh, path, (slice(0, length),), data, files))
        written = written_files(
            in_threads(lambda item: write_chunk_file(tensor_dir(root, item[0].key), *item), direct), digests
        )
        # open every array concurrently, then issue every write before waiting for any
        opened: Dict[ObjectPath, Any] = {}
        for _, path, _, _, _ in targets:
            if path not in opened:
                opened[path] = ts.open(
                    dict(_spec(path), store_data_equal_to_fill_value=True), open=True, write=True, context=context
                )
        pending: List[Tuple[Tuple[str, ObjectPath], Any]] = []
        open_failed = []
        for sh, path, region, data, _ in targets:
            try:
                array = opened[path].result()
            except Exception as e:  # noqa: BLE001 -- reported below with the key
                open_failed.append(((sh.key, path), e))
                continue
            pending.append(((sh.key, path), array[region].write(data)))
        failed = open_failed + _wait_all(pending)
        if failed:
            (key, path), error = failed[0]
            raise CheckpointingException(
                f"[rank {get_rank()}] writing tensor {key!r} to {str(path)!r} failed: {error}"
                + (f" ({len(failed) - 1} more writes failed)" if len(failed) > 1 else "")
            ) from error
        return written + [f for *_, files in targets for f in files]


def _create_array(path: ObjectPath, metadata: Dict[str, Any], context: "ts.Context") -> Any:
    # store_data_equal_to_fill_value: an all-zero chunk must still exist on disk, so that a
    # missing chunk can be told apart from a zero one
    spec = dict(_spec(path), metadata=metadata, store_data_equal_to_fill_value=True)
    return ts.open(spec, create=True, context=context)


# --------------------------------------------------------------------------- load


@dataclass
class _Target:
    """Where one requested ShardedTensor is loaded: ``dest`` (on the CPU), then ``result``."""

    sh: ShardedTensor
    dest: torch.Tensor
    result: torch.Tensor
    holder: Box


class TensorStoreLoadShardedStrategy(LoadShardedStrategy):
    """Loads zarr checkpoints with TensorStore into any sharding, reading only the chunks each
    requested shard overlaps, all reads of a rank in flight at once.

    Every check happens before the first read: each requested key must be stored, dtype and
    global shape must match (``allow_shape_mismatch`` pads or crops), and the stored chunks or
    fragments must cover the request (`plan_reads()`).

    Args:
        load_directly_on_device: where a ShardedTensor's ``data`` is allocated off the CPU (a
            GPU), load into it (through a CPU staging tensor) and return it; otherwise return
            a new CPU tensor for such shards and leave ``data`` alone. CPU ``data`` of the right
            shape is always filled in place.
        concurrency: cap on concurrent file operations (TensorStore's default: one per core).
        max_staged_bytes: cap on the bytes of fragment reads (flattened tensors) held in
            staging buffers at once; whole-chunk reads need no staging.
        verify_checksums: check every chunk file a load touches against ``zarr/checksums.json``
            (when the checkpoint has one) before reading it.
        allow_dtype_cast: a requested dtype may differ from the stored one: such reads are
            staged (in the stored dtype, within ``max_staged_bytes``) and converted while copied
            into place (see `dist_ckpt.model.dtype_cast`); False raises
            ``LoadMismatchError`` instead.
    """

    supported_backends: ClassVar[Tuple[str, ...]] = ("zarr",)
    supported_versions: ClassVar[Tuple[int, ...]] = (1,)

    def __init__(
        self,
        load_directly_on_device: bool = False,
        *,
        concurrency: Optional[int] = None,
        max_staged_bytes: int = DEFAULT_MAX_STAGED_BYTES,
        verify_checksums: bool = True,
        allow_dtype_cast: bool = True,
    ) -> None:
        self.load_directly_on_device = load_directly_on_device
        self.concurrency = concurrency
        self.max_staged_bytes = max_staged_bytes
        self.verify_checksums = verify_checksums
        self.allow_dtype_cast = allow_dtype_cast

    def check_location(self, checkpoint_dir: Storage) -> None:
        """Local directories and S3 (TensorStore's s3 driver); other object stores are refused."""
        checkpoint_node(checkpoint_dir, _ENGINE)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> StateDict:
        local = checkpoint_node(checkpoint_dir, _ENGINE)
        requested = [s for s in nested_values(sharded_state_dict) if isinstance(s, ShardedTensor)]
        # 1. metadata, dtype/shape checks and coverage, before any data is read
        manifest = read_checksums(local) if self.verify_checksums and requested else None
        plans = plan_request(requested, local, self.allow_dtype_cast, manifest_check(local / ZARR_DIR, manifest))
        # 2. destinations: in place where possible; padding zero-filled first
        targets = {id(sh): self._target(sh) for sh in requested}
        for sh in requested:
            t = targets[id(sh)]
            for piece, _ in plans[id(sh)].pad:
                piece_view(t.dest, piece, sh.prepend_axis_num, t.holder).zero_()
        # whole chunks of plain bytes are read straight into their destinations (see `direct`),
        # checked from the bytes read; TensorStore reads the rest
        direct = [
            (sh, op)
            for sh in requested
            for op in plans[id(sh)].ops
            if self._direct_view(sh, op, plans, targets) is not None
        ]
        in_threads(lambda item: self._read_direct(*item, plans, targets, local, manifest), direct)
        done = {id(op) for _, op in direct}
        plans = {i: replace(plan, ops=[op for op in plan.ops if id(op) not in done]) for i, plan in plans.items()}
        if local.storage.local_paths:  # TensorStore opens files by path itself: the storage checks where each leads
            for plan in plans.values():
                for op in plan.ops:
                    for f in [op.array_path / "zarr.json", *chunk_files(op.array_path, op.region)]:
                        f.local_path()  # a link out of the checkpoint: UnsafeLinkError
        if manifest is not None:
            _check_touched_files(requested, plans, local, manifest)
        # 3. every read issued before any is awaited
        self._read_all(requested, plans, targets)
        # 4. device copies
        for t in targets.values():
            if t.result is not t.dest:
                t.result.copy_(t.dest)

        def result_of(x: Any) -> Any:
            return targets[id(x)].result if isinstance(x, ShardedTensor) else x

        return dict_list_map_inplace(result_of, sharded_state_dict)  # type: ignore[no-any-return]

    @staticmethod
    def _direct_view(
        sh: ShardedTensor, op: ReadOp, plans: Dict[int, ReadPlan], targets: Dict[int, _Target]
    ) -> Optional[torch.Tensor]:
        """The destination of ``op`` if it is read without TensorStore (`can_read_directly()`)."""
        t = targets[id(sh)]
        view = sub_view(piece_view(t.dest, op.dst, sh.prepend_axis_num, t.holder), op.dst.box, op.inter)
        stored = plans[id(sh)].stored_dtype
        return view if stored == sh.dtype and can_read_directly(op.array_path, view, op.chunk, stored) else None

    def _read_direct(
        self,
        sh: ShardedTensor,
        op: ReadOp,
        plans: Dict[int, ReadPlan],
        targets: Dict[int, _Target],
        checkpoint: ObjectPath,
        manifest: Optional[Dict[str, FileDigest]],
    ) -> None:
        view = self._direct_view(sh, op, plans, targets)
        assert view is not None and op.chunk is not None
        chunk = op.array_path / chunk_key(op.chunk)
        expected = manifest.get(chunk.relative_to(checkpoint / ZARR_DIR)) if manifest is not None else None
        read_chunk_into(op.array_path, op.chunk, view, sh.key, expected)

    def _target(self, sh: ShardedTensor) -> _Target:
        shape = loaded_shape(sh)
        holder = Box(sh.global_offset, sh.full_local_shape)
        data = sh.data
        if data is None or data.device.type == "meta" or tuple(data.shape) != tuple(shape) or data.dtype != sh.dtype:
            fresh = torch.empty(shape, dtype=sh.dtype)
            return _Target(sh, fresh, fresh, holder)
        if data.device.type == "cpu":
            return _Target(sh, data, data, holder)
        staging = torch.empty(shape, dtype=sh.dtype)
        return _Target(sh, staging, data if self.load_directly_on_device else staging, holder)

    def _read_all(
        self, requested: List[ShardedTensor], plans: Dict[int, ReadPlan], targets: Dict[int, _Target]
    ) -> None:
        context = _context(self.concurrency)
        paths = {op.array_path for plan in plans.values() for op in plan.ops}
        opening = {
            p: ts.open(dict(_spec(p), fill_missing_data_reads=False), open=True, read=True, context=context)
            for p in sorted(paths, key=str)
        }
        arrays: Dict[ObjectPath, Any] = {}
        for path, future in opening.items():
            try:
                arrays[path] = future.result()
            except Exception as e:  # noqa: BLE001 -- a damaged zarr.json
                key = next(sh.key for sh in requested for op in plans[id(sh)].ops if op.array_path == path)
                raise CorruptCheckpointError(
                    f"[rank {get_rank()}] cannot open zarr array {str(path)!r} of tensor {key!r} with TensorStore: {e}"
                ) from e
        direct: List[Tuple[Tuple[ShardedTensor, ReadOp], Any]] = []
        staged: Deque[Tuple[Tuple[ShardedTensor, ReadOp], Any, torch.Tensor, torch.dtype]] = deque()
        staged_bytes = 0
        failed: List[Tuple[Tuple[ShardedTensor, ReadOp], BaseException]] = []
        try:
            for sh in requested:
                t = targets[id(sh)]
                stored = plans[id(sh)].stored_dtype
                for op in plans[id(sh)].ops:
                    view = sub_view(piece_view(t.dest, op.dst, sh.prepend_axis_num, t.holder), op.dst.box, op.inter)
                    source = arrays[op.array_path][
                        tuple(slice(o, o + s) for o, s in zip(op.region.offset, op.region.shape))
                    ]
                    if op.src_box == op.inter and op.region.shape == op.inter.shape and stored == sh.dtype:
                        # a box of a chunked array: TensorStore copies straight into the destination,
                        # viewed as the array's data type (raw bits for bfloat16 and float8, or
                        # the zarr-extensions type of older checkpoints): a copy, never a conversion
                        array_type = np.dtype(source.dtype.numpy_dtype)
                        memory = ts.array(tensor_to_numpy(view).view(array_type), copy=False, write=True)
                        direct.append(((sh, op), memory.write(source)))
                        continue
                    staged.append(((sh, op), source.read(), view, stored))
                    staged_bytes += op.region.numel * stored.itemsize
                    while staged_bytes > self.max_staged_bytes and len(staged) > 1:
                        staged_bytes -= self._finish_staged(staged.popleft(), failed)
        finally:  # even when issuing failed: no read may still be writing into our tensors
            while staged:
                self._finish_staged(staged.popleft(), failed)
            failed += _wait_all(direct)
        if failed:
            (sh, op), error = failed[0]
            raise _read_error(sh, op, error, len(failed) - 1)

    @staticmethod
    def _finish_staged(
        item: Tuple[Tuple[ShardedTensor, ReadOp], Any, torch.Tensor, torch.dtype], failed: List[Any]
    ) -> int:
        """Copy a staged read (in the stored dtype) into its destination view, converting."""
        (sh, op), future, view, stored = item
        try:
            data = numpy_to_tensor(np.asarray(future.result()), stored).view(op.src_box.shape)
            copy_cast(view, sub_view(data, op.src_box, op.inter))
        except Exception as e:  # noqa: BLE001 -- reported with the damaged file
            failed.append(((sh, op), e))
        return op.region.numel * stored.itemsize

    def with_dtype_cast(self, allow: bool) -> "TensorStoreLoadShardedStrategy":
        """This loader with ``allow_dtype_cast`` set to ``allow``."""
        if self.allow_dtype_cast == allow:
            return self
        return TensorStoreLoadShardedStrategy(
            self.load_directly_on_device,
            concurrency=self.concurrency,
            max_staged_bytes=self.max_staged_bytes,
            verify_checksums=self.verify_checksums,
            allow_dtype_cast=allow,
        )

    def load_tensors_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        context = _context(self.concurrency)

        def shape_dtype(path: Union[str, ObjectPath]) -> Tuple[Tuple[int, ...], np.dtype]:
            array = open_ts_array(path, context)  # a str is a local path
            return tuple(int(n) for n in array.shape), np.dtype(array.dtype.numpy_dtype)

        node = checkpoint_node(checkpoint_dir, _ENGINE)
        manifest = read_checksums(node) if self.verify_checksums else None
        return load_zarr_based_sharded_metadata(node, shape_dtype, manifest, manifest_check(node / ZARR_DIR, manifest))

    def verify_integrity(self, checkpoint_dir: Storage) -> IntegrityReport:
        """Every file of ``zarr/`` against ``zarr/checksums.json`` (see `zarr_checksums`)."""
        return verify_zarr(checkpoint_node(checkpoint_dir, _ENGINE))

    def describe_stored_shards(self, checkpoint_dir: Storage) -> Optional[Dict[str, List[StoredShardInfo]]]:
        """Every chunk (a saved shard) or fragment (a saved flattened range), from the metadata."""
        return describe_zarr(checkpoint_node(checkpoint_dir, _ENGINE))


def _check_touched_files(
    requested: List[ShardedTensor],
    plans: Dict[int, ReadPlan],
    checkpoint_dir: ObjectPath,
    manifest: Dict[str, FileDigest],
) -> None:
    """Check every file the plans read (array metadata and chunks) against the manifest."""
    root = checkpoint_dir / ZARR_DIR
    seen = set()
    batches = []
    for sh in requested:
        for op in plans[id(sh)].ops:
            files = [op.array_path / "zarr.json", *chunk_files(op.array_path, op.region)]
            fresh = [f for f in files if f not in seen]
            seen.update(fresh)
            batches.append((fresh, sh.key))
    # several files at a time: a cold load's reads are in flight together
    in_threads(lambda batch: check_files(root, batch[0], manifest, batch[1]), batches)


def _read_error(sh: ShardedTensor, op: ReadOp, error: BaseException, more: int) -> CorruptCheckpointError:
    damage = damaged_chunks(op.array_path, op.region)
    cause = "; ".join(damage) if damage else f"TensorStore: {error}"
    return CorruptCheckpointError(
        f"[rank {get_rank()}] cannot read tensor {sh.key!r} from {str(op.array_path)!r} (region offset "
        f"{op.region.offset}, shape {op.region.shape}): {cause}; the checkpoint is incomplete or damaged"
        + (f" ({more} more reads failed)" if more else "")
    )


def register_default_tensorstore_strategies(include_save: bool = False) -> None:
    """Make TensorStore the default loader of the zarr backend ``("zarr", 1)``, as Megatron-Core
    does (``override=True``: it replaces the zarr-python loader); with ``include_save`` also the
    default saver.

    Example:

    ```python
    register_default_tensorstore_strategies()
    dc.load(sd, "ckpt")          # now reads with TensorStore
    ```
    """
    register_default_strategy(StrategyAction.LOAD_SHARDED, "zarr", 1, TensorStoreLoadShardedStrategy, override=True)
    if include_save:
        register_default_strategy(StrategyAction.SAVE_SHARDED, "zarr", 1, TensorStoreSaveShardedStrategy, override=True)
