"""The save side of the zarr-python engine of the zarr backend (``zarr``, version 1).

Each main-replica shard becomes one zarr chunk (one 1-D fragment array if flattened), written
once by one rank: on local disks the plain chunk files and array metadata directly, in one step
(`dist_ckpt.backends.zarr.local_save`), otherwise with zarr-python through the stores of
`zarr_python_stores`, which digest what they write. The save ends with ``zarr/checksums.json``
and the rename of the tree to ``zarr/``. A save can also stream whole tensors one at a time
(`ZarrSaveShardedStrategy.begin_stream()`). See
[`zarr_python`][dist_ckpt.backends.zarr.zarr_python] for the engine as a whole.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Dict, List, Sequence

import torch
import zarr
from zarr.codecs import BytesCodec

from dist_ckpt.backends.base import TensorLayout, TensorStreamWriter, check_stream_entry, main_replica_shards
from dist_ckpt.backends.zarr.checksums import commit_checksums
from dist_ckpt.backends.zarr.layout import (
    ATTR,
    CHUNK_SEPARATOR,
    ZARR_DIR,
    checkpoint_node,
    fragment_chunk_elements,
    fragment_name,
    tensor_dir,
)
from dist_ckpt.backends.zarr.local_save import direct_writes, make_root, plan_node_files, save_locally, write_planned
from dist_ckpt.backends.zarr.nodes import (
    array_chunk_shape,
    as_stored,
    chunked_attributes,
    cpu_contiguous,
    creates_array,
    creates_flattened_group,
    drop_written,
    flattened_attributes,
    fragment_attributes,
    fsync_written,
    in_threads,
    publish_written,
    stored_numpy_dtype,
    stored_values,
    writing_root,
)
from dist_ckpt.backends.zarr.strategy_base import ZarrSaveStrategyBase
from dist_ckpt.backends.zarr.zarr_python_stores import ENGINE, Stores, as_storage_errors
from dist_ckpt.collectives.distributed import get_rank, run_collectively
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.model.dtypes import tensor_to_numpy
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor
from dist_ckpt.storage import Storage
from dist_ckpt.storage.location import require_local, resolve_location
from dist_ckpt.storage.object_path import ObjectPath

__all__ = ["ZarrSaveShardedStrategy"]

_ARRAY_OPTIONS: Dict[str, Any] = {
    "serializer": BytesCodec(),
    "compressors": None,
    "fill_value": 0,
    "chunk_key_encoding": {"name": "default", "separator": CHUNK_SEPARATOR},
}
# zarr skips chunks equal to the fill value by default; every chunk must exist on disk so that a
# missing chunk can be told apart from an all-zero one (zarr reads both as zeros)
_WRITE_EMPTY: Any = {"write_empty_chunks": True}


class ZarrSaveShardedStrategy(ZarrSaveStrategyBase):
    """Writes each main-replica shard as one zarr chunk (or one fragment array if flattened).

    On a local disk, one collective step writes every file (`local_save`); on an object store
    two: (1) the rank chosen for each tensor creates its array (or group) and flattened fragments
    are written; (2) every rank writes its chunks into the arrays. Then the ranks' digests go to
    rank 0, which writes ``zarr/checksums.json``, and the tree gets its name. Each step ends with
    an error exchange, so a failure on one rank raises everywhere.
    """

    can_stream: ClassVar[bool] = True
    engine: ClassVar[str] = ENGINE

    def __init__(self, backend: str = "zarr", version: int = 1) -> None:
        super().__init__(backend, version)  # bfloat16 and float8 are written as raw bits (nodes.stored_numpy_dtype)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> None:
        node = checkpoint_node(checkpoint_dir, ENGINE)
        root = writing_root(node)  # renamed to zarr/ once complete (local disks)
        shards = main_replica_shards(sharded_state_dict)
        stores = Stores(read_only=False)
        local = direct_writes(root)
        documents: Dict[str, str] = {}  # each zarr.json written here, for the root group's index
        if local:  # plain files, in one step (see `local_save`)
            written = run_collectively(
                "writing zarr files", lambda: save_locally(root, shards, stores.digests, documents)
            )
        else:
            with as_storage_errors(root, "writing"):
                created = run_collectively("creating zarr arrays", lambda: self._create_nodes(root, shards, stores))

                def write() -> List[ObjectPath]:
                    chunks = self._write_chunks(root, shards, stores)
                    fsync_written(created + chunks, root)  # a local disk of a big-endian host
                    return chunks

                written = created + run_collectively("writing zarr chunks", write)
        commit_checksums(root, written, stores.digests, documents if local else None)
        drop_written(written, root)  # the save is done with them
        run_collectively("publishing the zarr tree", lambda: publish_written(node) if get_rank() == 0 else None)

    def begin_stream(self, checkpoint_dir: Storage, layout: Sequence[TensorLayout]) -> TensorStreamWriter:
        """Write whole tensors one at a time, each one chunk (one process): the checkpoint a
        one-rank save of whole tensors writes, ``zarr/checksums.json`` included. The tree is
        written as ``.partial-zarr`` and renamed to ``zarr`` by `finish()`, as a save does."""
        storage = resolve_location(checkpoint_dir)
        require_local(storage, "streaming into the zarr backend")
        return _ZarrStreamWriter(self, ObjectPath(storage), layout)

    def _create_nodes(
        self, root: ObjectPath, shards: List[ShardedTensor], stores: Stores, create_root: bool = True
    ) -> List[ObjectPath]:
        """Create this rank's arrays and groups through zarr-python (where `direct_writes()` is
        False: an object store); flattened shards are written whole as their fragment arrays."""
        root.mkdir()
        written: List[ObjectPath] = []
        if get_rank() == 0 and create_root:
            store, at = stores.at(root)
            zarr.create_group(store=store, path=at or None, overwrite=False)
            written.append(root / "zarr.json")

        def create_array(sh: ShardedTensor) -> ObjectPath:
            path = tensor_dir(root, sh.key)
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
        return written

    @staticmethod
    def _write_fragment(path: ObjectPath, sh: ShardedTensor, stores: Stores) -> List[ObjectPath]:
        assert sh.flattened_range is not None
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
        arr[:] = stored_values(sh)
        chunk_files = [path / arr.metadata.encode_chunk_key((i,)) for i in range(math.ceil(length / chunk))]
        return [path / "zarr.json"] + chunk_files

    def _write_chunks(self, root: ObjectPath, shards: List[ShardedTensor], stores: Stores) -> List[ObjectPath]:
        """Write every chunk of this rank through zarr-python (where `direct_writes()` is False),
        several at a time (`IO_THREADS`); the caller makes them durable."""
        by_key: Dict[str, List[ShardedTensor]] = {}
        for sh in shards:
            if sh.flattened_range is None and math.prod(sh.local_shape) > 0:
                assert sh.data is not None, f"{sh.key!r} has no data to save"
                by_key.setdefault(sh.key, []).append(sh)

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
        if direct_writes(root):
            make_root(root)
        else:
            root.mkdir()
        self._stores = Stores(read_only=False)
        self.written: List[ObjectPath] = []
        self._write([], root_group=True)
        self._added = 0

    def _write(self, shards: List[ShardedTensor], root_group: bool) -> None:
        if direct_writes(self.root):
            self.written += write_planned(self.root, plan_node_files(shards, root_group), self._stores.digests)
            return
        self.written += self.strategy._create_nodes(self.root, shards, self._stores, create_root=root_group)
        self.written += self.strategy._write_chunks(self.root, shards, self._stores)

    def add(self, key: str, tensor: torch.Tensor) -> None:
        check_stream_entry(self.layout, self._added, key, tensor)
        self._added += 1
        self._write([ShardedTensor.from_rank_offsets(key, tensor.detach())], root_group=False)

    def finish(self) -> None:
        if self._added != len(self.layout):
            raise CheckpointingException(
                f"the stream into {self.root} finished after {self._added} of its {len(self.layout)} tensors"
            )
        fsync_written(self.written, self.root)  # every tensor's files at once
        commit_checksums(self.root, self.written, self._stores.digests)
        drop_written(self.written, self.root)
        publish_written(self.checkpoint)  # .partial-zarr -> zarr
