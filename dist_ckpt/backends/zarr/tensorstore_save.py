"""The save side of the TensorStore engine of the zarr backend (``zarr``, version 1).

Each main-replica shard becomes one zarr chunk (one 1-D fragment array if flattened), written
whole by one rank: on local disks the plain chunk files and array metadata directly, in one step
(`dist_ckpt.backends.zarr.local_save`), otherwise through TensorStore, every write of a rank
issued before any is awaited. The save ends with ``zarr/checksums.json`` and the rename of the tree to
``zarr/`` (see [`tensorstore_engine`][dist_ckpt.backends.zarr.tensorstore_engine] for the engine
as a whole).
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Optional, Tuple

import numpy as np

from dist_ckpt.backends.base import main_replica_shards
from dist_ckpt.backends.zarr.checksums import commit_checksums
from dist_ckpt.backends.zarr.layout import (
    ATTR,
    CHUNK_SEPARATOR,
    checkpoint_node,
    chunk_key,
    fragment_chunk_elements,
    fragment_name,
    tensor_dir,
)
from dist_ckpt.backends.zarr.local_save import direct_writes, save_locally
from dist_ckpt.backends.zarr.nodes import (
    array_chunk_shape,
    array_metadata,
    chunked_attributes,
    creates_array,
    creates_flattened_group,
    drop_written,
    flattened_attributes,
    fragment_attributes,
    fsync_written,
    publish_written,
    stored_values,
    write_group,
    writing_root,
)
from dist_ckpt.backends.zarr.strategy_base import ZarrSaveStrategyBase
from dist_ckpt.backends.zarr.tensorstore_arrays import ENGINE, create_array, open_for_write, ts_context, wait_all
from dist_ckpt.collectives.distributed import get_rank, run_collectively
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.integrity.checksums import FileDigest, bytes_digest
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor
from dist_ckpt.storage import Storage
from dist_ckpt.storage.object_path import ObjectPath

if TYPE_CHECKING:
    import tensorstore as ts

__all__ = ["TensorStoreSaveShardedStrategy"]


class TensorStoreSaveShardedStrategy(ZarrSaveStrategyBase):
    """Writes each main-replica shard as one zarr chunk (one fragment array if flattened).

    On a local disk one collective step writes every file and makes it durable (`local_save`);
    on an object store two, each ending with an error exchange: (1) the rank chosen for each
    tensor creates its array (or group), flattened shards create their fragment arrays; (2) every
    rank issues the writes of all its chunks at once and waits for them. Each chunk is written
    once, whole, by one rank.
    """

    engine: ClassVar[str] = ENGINE

    def __init__(self, backend: str = "zarr", version: int = 1, *, concurrency: Optional[int] = None) -> None:
        if (backend, version) != ("zarr", 1):
            raise CheckpointingException(
                f"TensorStoreSaveShardedStrategy writes backend ('zarr', 1) only, got ({backend!r}, {version})"
            )
        super().__init__(backend, version)
        self.concurrency = concurrency

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> None:
        node = checkpoint_node(checkpoint_dir, ENGINE)
        root = writing_root(node)  # renamed to zarr/ once complete (local disks)
        shards = main_replica_shards(sharded_state_dict)
        digests: Dict[ObjectPath, FileDigest] = {}
        local = direct_writes(root)
        documents: Dict[str, str] = {}  # each zarr.json written here, for the root group's index
        if local:  # plain files, in one step (see `local_save`)
            written = run_collectively("writing zarr files", lambda: save_locally(root, shards, digests, documents))
        else:
            context = ts_context(self.concurrency)
            # 1. tensor nodes exist before any rank writes into them
            created = run_collectively(
                "creating zarr arrays (tensorstore)", lambda: self._create_nodes(root, shards, context)
            )

            # 2. every chunk, concurrently, then durable
            def write() -> List[ObjectPath]:
                chunks = self._write_chunks(root, shards, context, digests)
                fsync_written(created + chunks, root)  # a local disk of a big-endian host
                return chunks

            written = created + run_collectively("writing zarr chunks (tensorstore)", write)
        # 3. rank 0 records the checksum of every file written, then gives the tree its name
        commit_checksums(root, written, digests, documents if local else None)
        drop_written(written, root)  # the save is done with them
        run_collectively("publishing the zarr tree", lambda: publish_written(node) if get_rank() == 0 else None)

    @staticmethod
    def _create_nodes(root: ObjectPath, shards: List[ShardedTensor], context: "ts.Context") -> List[ObjectPath]:
        """Create this rank's nodes through TensorStore (where `direct_writes()` is False)."""
        root.mkdir()
        written: List[ObjectPath] = []
        if get_rank() == 0:
            written.append(write_group(root, {}))
        pending: List[Tuple[Tuple[str, ObjectPath], Any]] = []
        for sh in shards:
            path = tensor_dir(root, sh.key)
            if sh.flattened_range is None:
                if creates_array(sh):
                    meta = array_metadata(sh.global_shape, array_chunk_shape(sh), sh.dtype, chunked_attributes(sh))
                    pending.append(((sh.key, path), create_array(path, meta, context)))
                continue
            if creates_flattened_group(sh):
                written.append(write_group(path, {ATTR: flattened_attributes(sh)}))
            length = sh.flattened_range.stop - sh.flattened_range.start
            if length > 0:
                frag = path / fragment_name(sh)
                meta = array_metadata((length,), (fragment_chunk_elements(length),), sh.dtype, fragment_attributes(sh))
                pending.append(((sh.key, frag), create_array(frag, meta, context)))
        failed = wait_all(pending)
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
        """Write every chunk through TensorStore, concurrently (the caller makes them durable). A
        chunk of a tensor saved as a grid is its shard's bytes exactly (uncompressed), so on a
        little-endian host its digest goes into ``digests`` from memory: the manifest then needs
        no second read of the file."""
        targets: List[Tuple[ShardedTensor, ObjectPath, Tuple[slice, ...], np.ndarray, List[ObjectPath]]] = []
        for sh in shards:
            data = stored_values(sh)
            if sh.flattened_range is None:
                if math.prod(sh.local_shape) == 0:
                    continue
                path = tensor_dir(root, sh.key)
                region = tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sh.full_local_shape))
                files = [path / chunk_key(sh.local_chunk_offset_in_global(), CHUNK_SEPARATOR)]
                targets.append((sh, path, region, data.reshape(sh.full_local_shape), files))
                if sys.byteorder == "little":  # the bytes the file will hold
                    digests[files[0]] = bytes_digest(data.reshape(-1).view(np.uint8))
                continue
            length = sh.flattened_range.stop - sh.flattened_range.start
            if length == 0:
                continue
            path = tensor_dir(root, sh.key) / fragment_name(sh)
            chunk = fragment_chunk_elements(length)
            files = [path / chunk_key((i,), CHUNK_SEPARATOR) for i in range(math.ceil(length / chunk))]
            targets.append((sh, path, (slice(0, length),), data, files))
        # open every array concurrently, then issue every write before waiting for any
        opened: Dict[ObjectPath, Any] = {}
        for _, path, _, _, _ in targets:
            if path not in opened:
                opened[path] = open_for_write(path, context)
        pending: List[Tuple[Tuple[str, ObjectPath], Any]] = []
        open_failed = []
        for sh, path, region, data, _ in targets:
            try:
                array = opened[path].result()
            except Exception as e:  # noqa: BLE001 -- reported below with the key
                open_failed.append(((sh.key, path), e))
                continue
            pending.append(((sh.key, path), array[region].write(data)))
        failed = open_failed + wait_all(pending)
        if failed:
            (key, path), error = failed[0]
            raise CheckpointingException(
                f"[rank {get_rank()}] writing tensor {key!r} to {str(path)!r} failed: {error}"
                + (f" ({len(failed) - 1} more writes failed)" if len(failed) > 1 else "")
            ) from error
        return [f for *_, files in targets for f in files]
