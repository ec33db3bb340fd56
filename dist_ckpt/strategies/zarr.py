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
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import uuid
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import zarr
from zarr.codecs import BytesCodec

from ..dict_utils import dict_list_map_inplace, nested_values
from ..distributed import get_rank, run_collectively
from ..dtypes import dtype_from_name, dtype_info, numpy_to_tensor, tensor_to_numpy
from ..errors import CorruptCheckpointError, KeyMismatchError, LoadMismatchError, format_keys
from ..geometry import Box, ShardPiece, piece_view, shard_pieces, sub_view
from ..mapping import ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from ..storage import decode_key, encode_key, fsync_dir, fsync_file
from ._zarr_dtypes import register_extension_dtypes
from .base import LoadShardedStrategy, SaveShardedStrategy

logger = logging.getLogger(__name__)

ZARR_DIR = "zarr"
ATTR = "dist_ckpt"
LAYOUT_CHUNKED = "chunked"
LAYOUT_FLATTENED = "flattened"
#: fragments of flattened tensors are split into zarr chunks of at most this many elements, so a
#: load that needs part of a fragment reads a bounded amount more than it needs
FRAGMENT_CHUNK_ELEMENTS = 1 << 22
_ARRAY_OPTIONS: Dict[str, Any] = {
    "serializer": BytesCodec(),
    "compressors": None,
    "fill_value": 0,
    # zarr skips chunks equal to the fill value by default; every chunk must exist on disk so
    # that a missing chunk can be told apart from an all-zero one
    "config": {"write_empty_chunks": True},
}


def _is_origin(sh: ShardedTensor) -> bool:
    return not any(sh.global_offset)


def _fragment_name(sh: ShardedTensor) -> str:
    assert sh.flattened_range is not None
    chunk = ".".join(map(str, sh.local_chunk_offset_in_global()))
    return f"{chunk}_{sh.flattened_range.start}"


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

    Two collective steps: (1) the rank holding the first chunk of each tensor creates its array
    (or group) and flattened fragments are written; (2) every rank writes its chunks into the
    arrays. Each step ends with an error exchange, so a failure on one rank raises everywhere.
    """

    owned_paths: ClassVar[Tuple[str, ...]] = (ZARR_DIR,)

    def __init__(self, backend: str = "zarr", version: int = 1) -> None:
        super().__init__(backend, version)
        register_extension_dtypes()

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        root = Path(checkpoint_dir) / ZARR_DIR
        shards = [
            s
            for s in nested_values(sharded_state_dict)
            if isinstance(s, ShardedTensor) and is_main_replica(s.replica_id)
        ]
        run_collectively("creating zarr arrays", lambda: self._create_nodes(root, shards))
        run_collectively("writing zarr chunks", lambda: self._write_chunks(root, shards))

    def _create_nodes(self, root: Path, shards: List[ShardedTensor]) -> None:
        root.mkdir(parents=True, exist_ok=True)
        written: List[Path] = []
        if get_rank() == 0:
            zarr.create_group(store=str(root), overwrite=False)
            written.append(root / "zarr.json")
        for sh in shards:
            info = dtype_info(sh.dtype)
            path = root / encode_key(sh.key)
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
                written += self._write_fragment(path / _fragment_name(sh), sh)
        _fsync_tree(written, root)

    @staticmethod
    def _write_fragment(path: Path, sh: ShardedTensor) -> List[Path]:
        assert sh.flattened_range is not None and sh.data is not None
        start, stop = sh.flattened_range.start, sh.flattened_range.stop
        length = stop - start
        chunk = min(length, FRAGMENT_CHUNK_ELEMENTS)
        info = dtype_info(sh.dtype)
        arr = zarr.create_array(
            store=str(path),
            shape=(length,),
            chunks=(chunk,),
            dtype=info.numpy_dtype,
            attributes={ATTR: {"global_offset": list(sh.global_offset), "flat_range": [start, stop]}},
            overwrite=False,
            **_ARRAY_OPTIONS,
        )
        arr[:] = tensor_to_numpy(_cpu_contiguous(sh.data))
        chunk_files = [path / arr.metadata.encode_chunk_key((i,)) for i in range(math.ceil(length / chunk))]
        return [path / "zarr.json"] + chunk_files

    def _write_chunks(self, root: Path, shards: List[ShardedTensor]) -> None:
        arrays: Dict[str, Any] = {}
        written: List[Path] = []
        for sh in shards:
            if sh.flattened_range is not None or math.prod(sh.local_shape) == 0:
                continue
            assert sh.data is not None, f"{sh.key!r} has no data to save"
            path = root / encode_key(sh.key)
            if sh.key not in arrays:
                arrays[sh.key] = zarr.open_array(store=str(path), mode="r+", config=_ARRAY_OPTIONS["config"])
            arr = arrays[sh.key]
            local = tensor_to_numpy(_cpu_contiguous(sh.data)).reshape(sh.full_local_shape)
            region = tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sh.full_local_shape))
            arr[region] = local
            written.append(path / arr.metadata.encode_chunk_key(sh.local_chunk_offset_in_global()))
        _fsync_tree(written, root)


@dataclass
class _Fragment:
    array: Any
    path: Path
    pieces: List[ShardPiece]


@dataclass
class _StoredTensor:
    """One tensor of a zarr checkpoint, opened for reading."""

    key: str
    path: Path
    dtype: torch.dtype
    global_shape: Tuple[int, ...]
    layout: str
    array: Any = None  # chunked layout
    fragments: List[_Fragment] = field(default_factory=list)  # flattened layout

    @property
    def bounds(self) -> Box:
        return Box((0,) * len(self.global_shape), self.global_shape)


def _open_stored(root: Path, name: str) -> Optional[_StoredTensor]:
    path = root / name
    if not (path / "zarr.json").is_file():
        return None
    try:
        node = zarr.open(store=str(path), mode="r")
        attrs = dict(node.attrs).get(ATTR)
        if not isinstance(attrs, dict):
            raise CorruptCheckpointError(f"{path / 'zarr.json'} lacks the {ATTR!r} attributes")
        dtype = dtype_from_name(attrs["dtype"])
        key = attrs["key"]
        if attrs.get("layout") == LAYOUT_FLATTENED and isinstance(node, zarr.Group):
            stored = _StoredTensor(key, path, dtype, tuple(attrs["global_shape"]), LAYOUT_FLATTENED)
            chunk_shape = tuple(attrs["chunk_shape"])
            for frag_name, frag in sorted(node.arrays()):
                fattrs: Dict[str, Any] = dict(frag.attrs)[ATTR]  # type: ignore[assignment]
                rng = (int(fattrs["flat_range"][0]), int(fattrs["flat_range"][1]))
                pieces = shard_pieces(tuple(fattrs["global_offset"]), chunk_shape, 0, rng)
                stored.fragments.append(_Fragment(frag, path / frag_name, pieces))
            return stored
        if not isinstance(node, zarr.Array):
            raise CorruptCheckpointError(f"{path / 'zarr.json'} describes a group where an array was expected")
        return _StoredTensor(key, path, dtype, tuple(node.shape), LAYOUT_CHUNKED, array=node)
    except CorruptCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 -- any parse failure means corrupt metadata
        raise CorruptCheckpointError(f"cannot read zarr metadata of {str(path)!r}: {type(e).__name__}: {e}") from e


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


def _read(array: Any, path: Path, region: Box, key: str) -> np.ndarray:
    chunk_shape = array.metadata.chunk_grid.chunk_shape
    for coords in _chunk_coords(region, chunk_shape):
        chunk_file = path / array.metadata.encode_chunk_key(coords)
        if not chunk_file.is_file():
            raise CorruptCheckpointError(
                f"[rank {get_rank()}] chunk file {str(chunk_file)!r} of tensor {key!r} is missing; the checkpoint is incomplete"
            )
    try:
        return np.asarray(array[tuple(slice(o, o + s) for o, s in zip(region.offset, region.shape))])
    except Exception as e:  # noqa: BLE001 -- a decode failure means a damaged chunk
        raise CorruptCheckpointError(
            f"[rank {get_rank()}] cannot read tensor {key!r} from {str(path)!r} (region offset "
            f"{region.offset}, shape {region.shape}): {type(e).__name__}: {e}"
        ) from e


class ZarrLoadShardedStrategy(LoadShardedStrategy):
    """Loads zarr checkpoints into any sharding, reading only the chunks each shard overlaps.

    Tensors are loaded in place into ``ShardedTensor.data`` when it is allocated with the right
    shape (any device); otherwise new CPU tensors are returned.
    """

    supported_backends: ClassVar[Tuple[str, ...]] = ("zarr",)
    supported_versions: ClassVar[Tuple[int, ...]] = (1,)

    def __init__(self) -> None:
        register_extension_dtypes()

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        root = Path(checkpoint_dir) / ZARR_DIR
        requested = [s for s in nested_values(sharded_state_dict) if isinstance(s, ShardedTensor)]
        stored: Dict[str, _StoredTensor] = {}
        absent = set()
        for sh in requested:
            if sh.key in stored or sh.key in absent:
                continue
            node = _open_stored(root, encode_key(sh.key))
            if node is None:
                absent.add(sh.key)
            else:
                stored[sh.key] = node
        if absent:
            raise KeyMismatchError(
                f"[rank {get_rank()}] tensors requested by load but absent from checkpoint "
                f"{str(checkpoint_dir)!r}: {format_keys(absent)}",
                unexpected_keys=absent,
            )
        problems = [p for sh in requested for p in self._mismatches(sh, stored[sh.key])]
        if problems:
            raise LoadMismatchError(
                f"[rank {get_rank()}] checkpoint {str(checkpoint_dir)!r} does not match the requested tensors: "
                + "; ".join(problems[:10])
                + (f"; ... and {len(problems) - 10} more" if len(problems) > 10 else "")
            )

        def load_one(x: Any) -> Any:
            return self._load_tensor(x, stored[x.key]) if isinstance(x, ShardedTensor) else x

        return dict_list_map_inplace(load_one, sharded_state_dict)  # type: ignore[no-any-return]

    @staticmethod
    def _mismatches(sh: ShardedTensor, stored: _StoredTensor) -> List[str]:
        out = []
        if sh.dtype != stored.dtype:
            out.append(f"{sh.key!r} is stored as {stored.dtype}, requested as {sh.dtype}")
        if len(sh.global_shape) != len(stored.global_shape) or (
            sh.global_shape != stored.global_shape and not sh.allow_shape_mismatch
        ):
            out.append(
                f"{sh.key!r} has global shape {stored.global_shape} in the checkpoint, requested "
                f"{sh.global_shape} (set allow_shape_mismatch=True to pad or crop)"
            )
        return out

    def _load_tensor(self, sh: ShardedTensor, stored: _StoredTensor) -> torch.Tensor:
        dest = _destination(sh)
        holder = Box(sh.global_offset, sh.full_local_shape)
        rng = None if sh.flattened_range is None else (sh.flattened_range.start, sh.flattened_range.stop)
        expected = 0
        filled = 0
        for piece in shard_pieces(sh.global_offset, sh.local_shape, sh.prepend_axis_num, rng):
            view = piece_view(dest, piece, sh.prepend_axis_num, holder)
            region = piece.box.intersect(stored.bounds)
            if region != piece.box:
                view.zero_()  # allow_shape_mismatch: the part outside the stored tensor is padding
            if region is None:
                continue
            expected += region.numel
            if stored.layout == LAYOUT_CHUNKED:
                data = _read(stored.array, stored.path, region, sh.key)
                sub_view(view, piece.box, region).copy_(numpy_to_tensor(data, sh.dtype))
                filled += region.numel
            else:
                filled += self._fill_from_fragments(view, piece.box, region, stored, sh.key)
        if filled != expected:
            raise CorruptCheckpointError(
                f"[rank {get_rank()}] tensor {sh.key!r} in {str(stored.path)!r}: the stored fragments "
                f"cover {filled} of the {expected} requested elements (fragments are missing or overlap)"
            )
        return dest

    @staticmethod
    def _fill_from_fragments(view: torch.Tensor, view_box: Box, region: Box, stored: _StoredTensor, key: str) -> int:
        filled = 0
        for frag in stored.fragments:
            for fp in frag.pieces:
                inter = region.intersect(fp.box)
                if inter is None:
                    continue
                assert fp.flat_offset is not None
                if not fp.box.shape:  # a 0-d tensor: one element
                    rows_box, lo, hi = fp.box, fp.flat_offset, fp.flat_offset + 1
                else:
                    row = math.prod(fp.box.shape[1:])
                    r0 = inter.offset[0] - fp.box.offset[0]
                    nrows = inter.shape[0]
                    lo = fp.flat_offset + r0 * row
                    hi = lo + nrows * row
                    rows_box = Box((inter.offset[0],) + fp.box.offset[1:], (nrows,) + fp.box.shape[1:])
                data = _read(frag.array, frag.path, Box((lo,), (hi - lo,)), key)
                src = numpy_to_tensor(data, stored.dtype).view(rows_box.shape)
                sub_view(view, view_box, inter).copy_(sub_view(src, rows_box, inter))
                filled += inter.numel
        return filled

    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        root = Path(checkpoint_dir) / ZARR_DIR
        out: ShardedStateDict = {}
        if not root.is_dir():
            raise CorruptCheckpointError(f"{str(root)!r} is missing: the zarr part of the checkpoint is gone")
        for entry in sorted(os.listdir(root)):
            if entry.startswith(".") or entry == "zarr.json":
                continue
            stored = _open_stored(root, entry)
            if stored is None:
                continue
            meta = torch.empty(stored.global_shape, dtype=stored.dtype, device="meta")
            out[stored.key] = ShardedTensor.from_rank_offsets(stored.key, meta)
        return out

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        """Delete tensors whose key starts with ``key_prefix``; each key goes whole or not at all."""
        root = Path(checkpoint_dir) / ZARR_DIR
        for entry in sorted(os.listdir(root)):
            if entry.startswith(".") or entry == "zarr.json":
                continue
            key = decode_key(entry)
            if key is None:
                stored = _open_stored(root, entry)
                key = stored.key if stored is not None else None
            if key is not None and key.startswith(key_prefix):
                trash = root / f".removing-{uuid.uuid4().hex}"
                os.replace(root / entry, trash)  # atomic: the key disappears in one step
                fsync_dir(root)
                shutil.rmtree(trash)


def register_default_zarr_strategies() -> None:
    """Make the Zarr strategies the defaults for ``("zarr", 1)`` (they already are, lazily)."""
    from .base import StrategyAction, register_default_strategy

    register_default_strategy(StrategyAction.SAVE_SHARDED, "zarr", 1, ZarrSaveShardedStrategy, override=True)
    register_default_strategy(StrategyAction.LOAD_SHARDED, "zarr", 1, ZarrLoadShardedStrategy, override=True)
