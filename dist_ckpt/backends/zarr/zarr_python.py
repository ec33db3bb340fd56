"""The Zarr backend (``zarr``, version 1): zarr v3 arrays written with zarr-python 3 (on local disks,
their plain chunk files and metadata directly: `dist_ckpt.backends.zarr.direct`).

Layout inside a checkpoint directory (every node is plain zarr v3, uncompressed little-endian
``bytes`` codec, so TensorStore and any zarr v3 reader open it):

```text
zarr/zarr.json                          root group
zarr/<key>/zarr.json                    a tensor saved as a regular grid of shards:
zarr/<key>/c/<i>/<j>...                   one zarr chunk per saved shard
zarr/<key>/zarr.json                    a tensor saved as flattened ranges (distributed
zarr/<key>/<chunk>_<start>/...            optimizer): a group of 1-D fragment arrays
```

A chunk is exactly one main-replica shard, so each chunk file is written once, by one rank, with
no read-modify-write. Flattened shards cannot be chunk-aligned (their boundaries are arbitrary),
so each becomes its own 1-D array. Array attributes carry ``{"dist_ckpt": {...}}``: the key,
the dtype name, and for fragments their global offset and flat range.

Loads read only the chunks that overlap the requested shard. zarr-python returns the fill value
for a missing chunk; the loader checks that every chunk it reads exists, so a deleted chunk is
reported instead of silently read as zeros.

Checksums: the save ends with ``zarr/checksums.json``, a crc32c of every file under ``zarr/``
(see `zarr_checksums`); the loader checks every file it reads against it, from the bytes
zarr-python reads (no extra I/O).

Object stores: an ``s3://`` checkpoint is written and read by zarr-python itself, through
``zarr.storage.ObjectStore`` over the obstore client of the checkpoint's ``S3Storage`` (same
endpoint, credentials, retries): each chunk is one object, PUT once by one rank. Nothing is
fsynced there (an object is durable when its PUT returns), and the save digests each object from
the bytes zarr-python hands the store (`_Stores`), not by downloading it again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import uuid
from typing import Any, ClassVar, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import zarr
from zarr.codecs import BytesCodec

from dist_ckpt.backends.base import (
    LoadShardedStrategy,
    SaveShardedStrategy,
    TensorLayout,
    TensorStreamWriter,
    check_stream_entry,
    load_destination,
    main_replica_shards,
)
from dist_ckpt.backends.stored_shards import StoredShardInfo
from dist_ckpt.backends.zarr.checksums import (
    MANIFEST_KEY,
    VerifyingStore,
    commit_checksums,
    drop_from_checksums,
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
from dist_ckpt.backends.zarr.dtypes import register_extension_dtypes
from dist_ckpt.backends.zarr.layout import (
    ATTR,
    PARTIAL_ZARR_DIR,
    ZARR_DIR,
    checkpoint_node,
    chunk_coords,
    chunk_key,
    fragment_chunk_elements,
    fragment_name,
    s3_storage,
    tensor_dir,
)
from dist_ckpt.backends.zarr.megatron import (
    flatten_range,
    load_zarr_based_sharded_metadata,
    pad_to_expected_shape,
    postprocess_numpy_array,
)
from dist_ckpt.backends.zarr.metadata import describe_zarr, list_tensor_names, open_tensor_info
from dist_ckpt.backends.zarr.nodes import (
    READ_BUDGET_BYTES,
    ByteBudget,
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
    stored_numpy_dtype,
    writing_root,
)
from dist_ckpt.backends.zarr.read_plan import ReadOp, plan_request
from dist_ckpt.engine.distributed import get_rank, run_collectively
from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError
from dist_ckpt.integrity.checksums import FileDigest, IntegrityReport, bytes_digest
from dist_ckpt.model.dict_utils import dict_list_map_inplace, nested_values
from dist_ckpt.model.dtype_cast import copy_cast
from dist_ckpt.model.dtypes import numpy_to_tensor, tensor_to_numpy
from dist_ckpt.model.geometry import Box, piece_view, sub_view
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor, StateDict
from dist_ckpt.storage import Storage, fsync_dir
from dist_ckpt.storage.location import require_local, resolve_location
from dist_ckpt.storage.object_path import ObjectPath

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


_ENGINE = "the zarr backend (zarr-python)"


class _Stores:
    """Where zarr-python finds a node: a local path (storages with ``local_paths``), or a path
    under one ``ObjectStore`` per S3 storage (one client, its connection pool shared by every
    array of the checkpoint).

    A writable store records the digest of every object it PUTs or file it writes (``digests``,
    by node), from the very bytes it sends, so that the checksum manifest needs no download or
    second read."""

    def __init__(self, read_only: bool) -> None:
        self.read_only = read_only
        self.digests: Dict[ObjectPath, FileDigest] = {}
        self._object_stores: Dict[str, Any] = {}

    def at(self, node: ObjectPath) -> Tuple[Any, str]:
        """``(store, path)`` of ``node`` for ``zarr.open_array(store=..., path=...)``."""
        if node.storage.local_paths:
            if self.read_only:
                return str(node.local_path()), ""
            return _recording_local_store(node, self.digests), ""
        url = node.storage.url
        if url not in self._object_stores:
            obstore_store = s3_storage(node).obstore_store()
            if self.read_only:
                self._object_stores[url] = zarr.storage.ObjectStore(obstore_store, read_only=True)
            else:
                self._object_stores[url] = _recording_store(obstore_store, ObjectPath(node.storage), self.digests)
        return self._object_stores[url], node.key


def _client_error(node: ObjectPath, error: BaseException, operation: str) -> Optional[BaseException]:
    """The storage error for ``error`` if it is the S3 client's (raised inside zarr-python while
    it read or wrote objects under ``node``), naming the URL, credentials redacted; else None."""
    if not node.storage.s3_compatible or isinstance(error, CheckpointingException):
        return None
    try:
        import obstore
    except ImportError:  # pragma: no cover -- an S3 node needs obstore
        return None
    if not isinstance(error, (obstore.exceptions.BaseError, OSError)):
        return None
    return s3_storage(node).storage_error(error, operation, node.key)


@contextlib.contextmanager
def _typed(node: ObjectPath, operation: str) -> Iterator[None]:
    """Raise the S3 client's errors from inside zarr-python as storage errors (see
    `_client_error()`); everything else unchanged."""
    try:
        yield
    except Exception as e:
        typed = _client_error(node, e, operation)
        if typed is None:
            raise
        raise typed from e


def _recording_local_store(node: ObjectPath, digests: Dict[ObjectPath, FileDigest]) -> Any:
    """A writable ``zarr.storage.LocalStore`` at ``node`` that records the digest of each file it
    writes, from the bytes it writes: the checksum manifest then needs no second read of every
    chunk (which cost a save as much as a read of the whole checkpoint from the page cache)."""

    class _Recording(zarr.storage.LocalStore):
        async def set(self, key: str, value: Any) -> None:
            await super().set(key, value)
            digests[node / key] = bytes_digest(value.as_numpy_array())

    return _Recording(str(node.local_path()), read_only=False)


def _recording_store(obstore_store: Any, root: ObjectPath, digests: Dict[ObjectPath, FileDigest]) -> Any:
    """A writable ``zarr.storage.ObjectStore`` that records the digest of each object it PUTs."""

    class _Recording(zarr.storage.ObjectStore):  # type: ignore[type-arg]
        async def set(self, key: str, value: Any) -> None:
            await super().set(key, value)
            digests[root / key] = bytes_digest(value.as_numpy_array())

    return _Recording(obstore_store, read_only=False)


class ZarrSaveShardedStrategy(SaveShardedStrategy):
    """Writes each main-replica shard as one zarr chunk (or one fragment array if flattened).

    Three collective steps: (1) the rank holding the first chunk of each tensor creates its array
    (or group) and flattened fragments are written; (2) every rank writes its chunks into the
    arrays; (3) the ranks digest the files they wrote and rank 0 writes ``zarr/checksums.json``.
    Each step ends with an error exchange, so a failure on one rank raises everywhere.
    """

    owned_paths: ClassVar[Tuple[str, ...]] = (ZARR_DIR, PARTIAL_ZARR_DIR)
    object_storage: ClassVar[bool] = True
    can_stream: ClassVar[bool] = True
    integrity_records: ClassVar[Tuple[str, ...]] = (MANIFEST_KEY,)

    def __init__(self, backend: str = "zarr", version: int = 1) -> None:
        super().__init__(backend, version)  # bfloat16 and float8 are written as raw bits (nodes.stored_numpy_dtype)

    def check_location(self, checkpoint_dir: Storage) -> None:
        """Local directories and S3 (through zarr-python's ObjectStore); other object stores are refused."""
        checkpoint_node(checkpoint_dir, _ENGINE)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> None:
        node = checkpoint_node(checkpoint_dir, _ENGINE)
        root = writing_root(node)  # renamed to zarr/ once complete (local disks)
        shards = main_replica_shards(sharded_state_dict)
        stores = _Stores(read_only=False)
        with _typed(root, "writing"):
            created = run_collectively("creating zarr arrays", lambda: self._create_nodes(root, shards, stores))

            def write() -> List[ObjectPath]:
                chunks = self._write_chunks(root, shards, stores)
                fsync_written(created + chunks, root)  # this rank's arrays and chunks: one syncfs
                return chunks

            chunks = run_collectively("writing zarr chunks", write)
        commit_checksums(root, created + chunks, stores.digests)
        run_collectively("publishing the zarr tree", lambda: publish_written(node) if get_rank() == 0 else None)

    def begin_stream(self, checkpoint_dir: Storage, layout: Sequence[TensorLayout]) -> TensorStreamWriter:
        """Write whole tensors one at a time, each one chunk (one process): the checkpoint a
        one-rank save of whole tensors writes, ``zarr/checksums.json`` included. The tree is
        written as ``.partial-zarr`` and renamed to ``zarr`` by `finish()`, as a save does."""
        storage = resolve_location(checkpoint_dir)
        require_local(storage, "streaming into the zarr backend")
        return _ZarrStreamWriter(self, ObjectPath(storage), layout)

    def _create_nodes(
        self, root: ObjectPath, shards: List[ShardedTensor], stores: _Stores, create_root: bool = True
    ) -> List[ObjectPath]:
        root.mkdir()
        written: List[ObjectPath] = []
        if get_rank() == 0 and create_root:
            store, at = stores.at(root)
            zarr.create_group(store=store, path=at or None, overwrite=False)
            written.append(root / "zarr.json")

        def create_array(sh: ShardedTensor) -> ObjectPath:
            path = tensor_dir(root, sh.key)
            if direct_writes(root):  # the same document, without zarr-python's per-array work
                meta = array_metadata(sh.global_shape, array_chunk_shape(sh), sh.dtype, chunked_attributes(sh))
                return written_files([write_array_json(path, meta)], stores.digests)[0]
            store, name = stores.at(path)
            zarr.create_array(
                store=store,
                name=name or None,
                shape=sh.global_shape,
                chunks=array_chunk_shape(sh),
                dtype=stored_numpy_dtype(sh.dtype),
                attributes={ATTR: chunked_attributes(sh)},
                overwrite=False,
                config=_WRITE_EMPTY,
                **_ARRAY_OPTIONS,
            )
            return path / "zarr.json"

        # the arrays of the tensors saved as a grid of chunks, several at a time
        written += in_threads(create_array, [sh for sh in shards if sh.flattened_range is None and creates_array(sh)])
        for sh in shards:
            path = tensor_dir(root, sh.key)
            if sh.flattened_range is None:
                continue
            if creates_flattened_group(sh):
                store, name = stores.at(path)
                zarr.create_group(
                    store=store, path=name or None, attributes={ATTR: flattened_attributes(sh)}, overwrite=False
                )
                written.append(path / "zarr.json")
            if sh.flattened_range.stop > sh.flattened_range.start:
                written += self._write_fragment(path / fragment_name(sh), sh, stores)
        return written  # made durable with the chunks

    @staticmethod
    def _write_fragment(path: ObjectPath, sh: ShardedTensor, stores: _Stores) -> List[ObjectPath]:
        assert sh.flattened_range is not None and sh.data is not None
        length = sh.flattened_range.stop - sh.flattened_range.start
        chunk = fragment_chunk_elements(length)
        store, name = stores.at(path)
        arr = zarr.create_array(
            store=store,
            name=name or None,
            shape=(length,),
            chunks=(chunk,),
            dtype=stored_numpy_dtype(sh.dtype),
            attributes={ATTR: fragment_attributes(sh)},
            overwrite=False,
            config=_WRITE_EMPTY,
            **_ARRAY_OPTIONS,
        )
        arr[:] = as_stored(tensor_to_numpy(cpu_contiguous(sh.data)), sh.dtype)
        chunk_files = [path / arr.metadata.encode_chunk_key((i,)) for i in range(math.ceil(length / chunk))]
        return [path / "zarr.json"] + chunk_files

    def _write_chunks(self, root: ObjectPath, shards: List[ShardedTensor], stores: _Stores) -> List[ObjectPath]:
        """Write every chunk of this rank, several at a time (`IO_THREADS`:
        zarr-python's per-array work and the writes overlap); the caller makes them durable."""
        by_key: Dict[str, List[ShardedTensor]] = {}
        for sh in shards:
            if sh.flattened_range is None and math.prod(sh.local_shape) > 0:
                assert sh.data is not None, f"{sh.key!r} has no data to save"
                by_key.setdefault(sh.key, []).append(sh)

        if direct_writes(root):  # one file per shard, from the tensor's memory (see `direct`)

            def write_file(sh: ShardedTensor) -> Tuple[ObjectPath, FileDigest]:
                data = as_stored(tensor_to_numpy(cpu_contiguous(sh.data)), sh.dtype)  # type: ignore[arg-type]
                return write_chunk_file(tensor_dir(root, sh.key), sh, data)

            return written_files(
                in_threads(write_file, [sh for group in by_key.values() for sh in group]), stores.digests
            )

        def write_key(group: List[ShardedTensor]) -> List[ObjectPath]:
            path = tensor_dir(root, group[0].key)
            store, name = stores.at(path)
            arr = zarr.open_array(store=store, path=name, mode="r+").with_config(_WRITE_EMPTY)
            chunks = []
            for sh in group:
                data = tensor_to_numpy(cpu_contiguous(sh.data))  # type: ignore[arg-type]
                local = as_stored(data, sh.dtype).reshape(sh.full_local_shape)
                arr[tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sh.full_local_shape))] = local
                chunks.append(path / arr.metadata.encode_chunk_key(sh.local_chunk_offset_in_global()))
            return chunks

        return [chunk for chunks in in_threads(write_key, list(by_key.values())) for chunk in chunks]


class _ZarrStreamWriter(TensorStreamWriter):
    """Creates the root group, then each tensor's array and its one chunk as it is added, under
    the staging name ``.partial-zarr``; the checksum manifest and the rename to ``zarr`` at
    `finish()` (see
    [`ZarrSaveShardedStrategy.begin_stream()`][dist_ckpt.backends.zarr.zarr_python.ZarrSaveShardedStrategy.begin_stream])."""

    def __init__(
        self, strategy: ZarrSaveShardedStrategy, checkpoint: ObjectPath, layout: Sequence[TensorLayout]
    ) -> None:
        root = writing_root(checkpoint)
        self.strategy, self.checkpoint, self.root, self.layout = strategy, checkpoint, root, list(layout)
        for existing in (root, checkpoint / ZARR_DIR):
            if existing.is_dir():
                raise FileExistsError(f"{existing} exists already")
        root.mkdir()
        zarr.create_group(store=str(root.local_path()), overwrite=False)
        self.written: List[ObjectPath] = [root / "zarr.json"]
        self._stores = _Stores(read_only=False)
        self._added = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        check_stream_entry(self.layout, self._added, key, tensor)
        self._added += 1
        sh = [ShardedTensor.from_rank_offsets(key, tensor.detach())]
        self.written += self.strategy._create_nodes(self.root, sh, self._stores, create_root=False)
        self.written += self.strategy._write_chunks(self.root, sh, self._stores)

    def finish(self) -> None:
        if self._added != len(self.layout):
            raise CheckpointingException(
                f"the stream into {self.root} finished after {self._added} of its {len(self.layout)} tensors"
            )
        fsync_written(self.written, self.root)  # every tensor's files at once
        commit_checksums(self.root, self.written, self._stores.digests)
        publish_written(self.checkpoint)  # .partial-zarr -> zarr


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
        self._plain = _Stores(read_only=True)
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

    def read_whole_chunk(self, op: ReadOp, dest: torch.Tensor, key: str) -> None:
        """Read the whole chunk ``op`` names straight into ``dest`` (see
        `can_read_directly()`), checked against the manifest."""
        assert op.chunk is not None
        expected = None
        if self._manifest is not None:
            expected = self._manifest.get((op.array_path / chunk_key(op.chunk)).relative_to(self._root))
        read_chunk_into(op.array_path, op.chunk, dest, key, expected)

    def read(self, path: ObjectPath, region: Box, key: str) -> np.ndarray:
        array: Any = self._arrays.get(path)
        if array is None:
            store, name = self._store_of(path)
            try:
                array = self._arrays[path] = zarr.open_array(store=store, path=name, mode="r")
            except CheckpointingException:
                raise
            except Exception as e:  # noqa: BLE001 -- unreadable metadata means a damaged checkpoint
                typed = _client_error(path, e, "GET")
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
            typed = _client_error(path, e, "GET")
            if typed is not None:
                raise typed from e
            raise CorruptCheckpointError(
                f"[rank {get_rank()}] cannot read tensor {key!r} from {str(path)!r} (region offset "
                f"{region.offset}, shape {region.shape}): {type(e).__name__}: {e}"
            ) from e


class ZarrLoadShardedStrategy(LoadShardedStrategy):
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

    supported_backends: ClassVar[Tuple[str, ...]] = ("zarr",)
    supported_versions: ClassVar[Tuple[int, ...]] = (1,)
    object_storage: ClassVar[bool] = True

    def __init__(self, verify_checksums: bool = True, allow_dtype_cast: bool = True) -> None:
        register_extension_dtypes()  # checkpoints that stored "data_type": "bfloat16" (before raw bits)
        self.verify_checksums = verify_checksums
        self.allow_dtype_cast = allow_dtype_cast

    def check_location(self, checkpoint_dir: Storage) -> None:
        """Local directories and S3 (through zarr-python's ObjectStore); other object stores are refused."""
        checkpoint_node(checkpoint_dir, _ENGINE)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> StateDict:
        node = checkpoint_node(checkpoint_dir, _ENGINE)
        requested = [s for s in nested_values(sharded_state_dict) if isinstance(s, ShardedTensor)]
        root = node / ZARR_DIR
        manifest = read_checksums(node) if self.verify_checksums and requested else None
        plans = plan_request(requested, node, self.allow_dtype_cast, manifest_check(root, manifest))  # checks first
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
            with budget.hold(sum(op.region.numel for op in plan.ops) * plan.stored_dtype.itemsize):
                for op in plan.ops:
                    self._copy(reader, op, dest, x, holder, plan.stored_dtype)
            return dest

        # several tensors at a time: their reads are in flight together (a cold load waits on
        # the disk, not on one chunk file after another)
        tensors = [x for x in nested_values(sharded_state_dict) if isinstance(x, ShardedTensor)]
        loaded = dict(zip(map(id, tensors), in_threads(load_one, tensors)))
        return dict_list_map_inplace(  # type: ignore[no-any-return]
            lambda x: loaded[id(x)] if isinstance(x, ShardedTensor) else x, sharded_state_dict
        )

    @staticmethod
    def _copy(
        reader: _ArrayReader, op: ReadOp, dest: torch.Tensor, sh: ShardedTensor, holder: Box, stored: torch.dtype
    ) -> None:
        target = sub_view(piece_view(dest, op.dst, sh.prepend_axis_num, holder), op.dst.box, op.inter)
        if can_read_directly(op.array_path, target, op.chunk, stored):
            reader.read_whole_chunk(op, target, sh.key)
            return
        data = numpy_to_tensor(reader.read(op.array_path, op.region, sh.key), stored).view(op.src_box.shape)
        copy_cast(target, sub_view(data, op.src_box, op.inter))

    def with_dtype_cast(self, allow: bool) -> "ZarrLoadShardedStrategy":
        """This loader with ``allow_dtype_cast`` set to ``allow``."""
        if self.allow_dtype_cast == allow:
            return self
        return ZarrLoadShardedStrategy(self.verify_checksums, allow)

    def load_tensors_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        stores = _Stores(read_only=True)

        def shape_dtype(path: Union[str, ObjectPath]) -> Tuple[Tuple[int, ...], np.dtype]:
            store, name = stores.at(path) if isinstance(path, ObjectPath) else (path, "")  # a str: a local path
            with _typed(path if isinstance(path, ObjectPath) else node, "GET"):
                array = zarr.open_array(store=store, path=name, mode="r")
            return tuple(array.shape), np.dtype(array.dtype)

        node = checkpoint_node(checkpoint_dir, _ENGINE)
        manifest = read_checksums(node) if self.verify_checksums else None
        return load_zarr_based_sharded_metadata(node, shape_dtype, manifest, manifest_check(node / ZARR_DIR, manifest))

    def verify_integrity(self, checkpoint_dir: Storage) -> IntegrityReport:
        """Every file of ``zarr/`` against ``zarr/checksums.json`` (see `zarr_checksums`)."""
        return verify_zarr(checkpoint_node(checkpoint_dir, _ENGINE))

    def describe_stored_shards(self, checkpoint_dir: Storage) -> Optional[Dict[str, List[StoredShardInfo]]]:
        """Every chunk (a saved shard) or fragment (a saved flattened range), from the metadata."""
        return describe_zarr(checkpoint_node(checkpoint_dir, _ENGINE))

    def remove_sharded_tensors(self, checkpoint_dir: Storage, key_prefix: str) -> None:
        """Delete tensors whose key starts with ``key_prefix``; each key goes whole or not at all
        (on an object store, which cannot rename: its ``zarr.json`` goes first, and from then on
        the key is absent)."""
        node = checkpoint_node(checkpoint_dir, _ENGINE)
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


def register_default_zarr_strategies() -> None:
    """Make the Zarr strategies the defaults for ``("zarr", 1)`` (they already are, lazily)."""
    from dist_ckpt.engine.registry import StrategyAction, register_default_strategy

    register_default_strategy(StrategyAction.SAVE_SHARDED, "zarr", 1, ZarrSaveShardedStrategy, override=True)
    register_default_strategy(StrategyAction.LOAD_SHARDED, "zarr", 1, ZarrLoadShardedStrategy, override=True)
