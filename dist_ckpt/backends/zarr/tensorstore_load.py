"""The load side of the TensorStore engine of the zarr backend (``zarr``, version 1).

A load checks everything before the first read (`read_plan.plan_request()`: keys, dtypes,
shapes, coverage, and the checksums of the files it will touch), reads the chunks of plain bytes
on local disks from their files (`dist_ckpt.backends.zarr.direct`: whole chunks straight into
their destinations, parts of chunks, strided views and dtype conversions through buffers of the
chunk, within ``max_staged_bytes``), and issues every other read of the rank to TensorStore
before awaiting any: whole-chunk boxes land in place, fragment reads and dtype conversions go
through staging buffers bounded by ``max_staged_bytes``. A failed read is a
[`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError] naming the key and the damaged
chunk file (see [`tensorstore_engine`][dist_ckpt.backends.zarr.tensorstore_engine] for the engine
as a whole).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Deque, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from dist_ckpt.backends.base import loaded_shape
from dist_ckpt.backends.zarr.checksums import check_files, chunk_files
from dist_ckpt.backends.zarr.direct import read_chunk_part
from dist_ckpt.backends.zarr.layout import ZARR_DIR
from dist_ckpt.backends.zarr.metadata import damaged_chunks
from dist_ckpt.backends.zarr.nodes import ByteBudget, in_threads
from dist_ckpt.backends.zarr.read_plan import ReadOp, ReadPlan
from dist_ckpt.backends.zarr.strategy_base import ShapeDtype, ZarrLoadStrategyBase
from dist_ckpt.backends.zarr.tensorstore_arrays import (
    ENGINE,
    memory_array,
    open_for_read,
    open_ts_array,
    ts_context,
    wait_all,
)
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import CorruptCheckpointError
from dist_ckpt.integrity.checksums import FileDigest
from dist_ckpt.model.dict_utils import dict_list_map_inplace
from dist_ckpt.model.dtype_cast import copy_cast
from dist_ckpt.model.dtypes import numpy_to_tensor, tensor_to_numpy
from dist_ckpt.model.geometry import Box, piece_view, sub_view
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor, StateDict
from dist_ckpt.storage import Storage, check_regular
from dist_ckpt.storage.object_path import ObjectPath

__all__ = ["DEFAULT_MAX_STAGED_BYTES", "TensorStoreLoadShardedStrategy"]

#: staged (fragment) reads in flight are capped at this many bytes, bounding extra memory
DEFAULT_MAX_STAGED_BYTES = 256 << 20


@dataclass
class _Target:
    """Where one requested ShardedTensor is loaded: ``dest`` (on the CPU), then ``result``."""

    sh: ShardedTensor
    dest: torch.Tensor
    result: torch.Tensor
    holder: Box


class TensorStoreLoadShardedStrategy(ZarrLoadStrategyBase):
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
        max_staged_bytes: cap on the bytes held in staging buffers at once: of fragment reads
            (flattened tensors), and of the chunk files read into a buffer before their part is
            copied into place (a part of a chunk, a strided view, a dtype conversion; a buffer
            larger than the cap is read alone); whole chunks read into contiguous destinations
            need none.
        verify_checksums: check every chunk file a load touches against ``zarr/checksums.json``
            (when the checkpoint has one) before reading it.
        allow_dtype_cast: a requested dtype may differ from the stored one: such reads are
            staged (in the stored dtype, within ``max_staged_bytes``: the whole chunk, for a chunk
            file read without TensorStore) and converted while copied into place (see
            `dist_ckpt.model.dtype_cast`); False raises ``LoadMismatchError`` instead.
    """

    engine: ClassVar[str] = ENGINE

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

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> StateDict:
        # 1. metadata, dtype/shape checks and coverage, before any data is read
        planned = self._plan_load(sharded_state_dict, checkpoint_dir)
        local, requested, manifest, plans = planned.node, planned.requested, planned.manifest, planned.plans
        # 2. destinations: in place where possible; padding zero-filled first
        targets = {id(sh): self._target(sh) for sh in requested}
        for sh in requested:
            t = targets[id(sh)]
            for piece, _ in plans[id(sh)].pad:
                piece_view(t.dest, piece, sh.prepend_axis_num, t.holder).zero_()
        # chunks of plain bytes in local files are read from their files into place (see `direct`),
        # checked from the bytes read; TensorStore reads the rest
        direct = [(sh, op) for sh in requested for op in plans[id(sh)].ops if op.chunk is not None]
        budget = ByteBudget(self.max_staged_bytes)  # buffers of chunks read for a part, a strided view, a cast
        in_threads(lambda item: self._read_direct(*item, plans, targets, local, manifest, budget), direct)
        done = {id(op) for _, op in direct}
        plans = {i: replace(plan, ops=[op for op in plan.ops if id(op) not in done]) for i, plan in plans.items()}
        if local.storage.local_paths:  # TensorStore opens files by path itself: the storage checks where each leads
            for plan in plans.values():
                for op in plan.ops:
                    for f in [op.array_path / "zarr.json", *chunk_files(op.array_path, op.region)]:
                        # a link out of the checkpoint: UnsafeLinkError; a FIFO (TensorStore would block on it)
                        check_regular(f.local_path(), str(f))
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
    def _read_direct(
        sh: ShardedTensor,
        op: ReadOp,
        plans: Dict[int, ReadPlan],
        targets: Dict[int, _Target],
        checkpoint: ObjectPath,
        manifest: Optional[Dict[str, FileDigest]],
        budget: ByteBudget,
    ) -> None:
        """Read ``op``'s part of the chunk file it names into place, without TensorStore
        (`dist_ckpt.backends.zarr.direct.read_chunk_part()`)."""
        t = targets[id(sh)]
        view = op.target_in(t.dest, sh.prepend_axis_num, t.holder)
        read_chunk_part(op, view, plans[id(sh)].stored_dtype, sh.key, manifest, checkpoint / ZARR_DIR, budget)

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
        context = ts_context(self.concurrency)
        paths = {op.array_path for plan in plans.values() for op in plan.ops}
        opening = {p: open_for_read(p, context) for p in sorted(paths, key=str)}
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
                    view = op.target_in(t.dest, sh.prepend_axis_num, t.holder)
                    source = arrays[op.array_path][
                        tuple(slice(o, o + s) for o, s in zip(op.region.offset, op.region.shape))
                    ]
                    if op.src_box == op.inter and op.region.shape == op.inter.shape and stored == sh.dtype:
                        # a box of a chunked array: TensorStore copies straight into the destination,
                        # viewed as the array's data type (raw bits for bfloat16 and float8, or
                        # the zarr-extensions type of older checkpoints): a copy, never a conversion
                        array_type = np.dtype(source.dtype.numpy_dtype)
                        memory = memory_array(tensor_to_numpy(view).view(array_type))
                        direct.append(((sh, op), memory.write(source)))
                        continue
                    staged.append(((sh, op), source.read(), view, stored))
                    staged_bytes += op.region.numel * stored.itemsize
                    while staged_bytes > self.max_staged_bytes and len(staged) > 1:
                        staged_bytes -= self._finish_staged(staged.popleft(), failed)
        finally:  # even when issuing failed: no read may still be writing into our tensors
            while staged:
                self._finish_staged(staged.popleft(), failed)
            failed += wait_all(direct)
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

    def _shape_dtype(self, node: ObjectPath) -> ShapeDtype:
        context = ts_context(self.concurrency)

        def shape_dtype(path: Union[str, ObjectPath]) -> Tuple[Tuple[int, ...], np.dtype]:
            array = open_ts_array(path, context)  # a str is a local path
            return tuple(int(n) for n in array.shape), np.dtype(array.dtype.numpy_dtype)

        return shape_dtype


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
