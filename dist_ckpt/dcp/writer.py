"""`StorageWriter`: ``torch.distributed.checkpoint.save`` writing through dist_ckpt.

DCP keeps its planning (``DefaultSavePlanner``: flattening, deduplication, the global metadata);
this writer does the I/O: each rank's items go to ``thread_count`` files written concurrently
through a dist_ckpt `Storage` (a local directory or ``s3://``), crc32c recorded for every item
(see `items`), and the checkpoint becomes visible only when the coordinator's ``finish`` writes
``.metadata`` -- after the manifest, after every rank's files are complete (DCP calls ``finish``
once every rank's ``write_data`` has returned). The call sequence (DCP's, with who calls what):

1. (every rank) ``set_up_storage_writer``: opens the storage and makes the directory;
2. (every rank) ``prepare_local_plan``: the plan as is;
3. (coordinator) ``prepare_global_plan``: removes the ``.metadata`` (and manifest) of a checkpoint
   already at the location, so that its files, overwritten below, never pass for it, and gives
   rank ``r`` its file prefix ``__r_``;
4. (every rank) ``write_data``: this rank's files, one thread per file;
5. (coordinator) ``finish``: the manifest, then ``.metadata`` (DCP's pickled ``Metadata``,
   marked as checksummed, with plain ``_StorageInfo`` locations): the commit.

A save that raises or is killed before step 5 leaves data files but no ``.metadata``: not a
checkpoint to any DCP reader.

Example:

```python
import torch.distributed.checkpoint as dcp
import dist_ckpt.dcp

dcp.save(state_dict, storage_writer=dist_ckpt.dcp.StorageWriter("ckpt/step_100"))
```
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter as DCPStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from dist_ckpt.backends.torch_dist.checksums import CHECKSUMS_FILENAME, mark_checksummed
from dist_ckpt.backends.torch_dist.metadata import DCP_METADATA_FILENAME
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.dcp.items import DATA_SUFFIX, gathered_files, manifest, split_items, write_file
from dist_ckpt.dcp.location import CheckpointLocation
from dist_ckpt.errors import CheckpointExistsError, CheckpointingException
from dist_ckpt.storage.base import StorageOptions
from dist_ckpt.storage.location import LocationLike

__all__ = ["StorageWriter"]

logger = logging.getLogger(__name__)


class StorageWriter(CheckpointLocation, DCPStorageWriter):
    """A ``torch.distributed.checkpoint`` storage writer over dist_ckpt's storage and checksums.

    Pass it to ``dcp.save`` or ``dcp.async_save`` as ``storage_writer``; the checkpoint it
    writes is a DCP checkpoint (``.metadata`` and ``__<rank>_<n>.distcp`` files) that DCP's
    ``FileSystemReader`` loads as well as [`StorageReader`][dist_ckpt.dcp.StorageReader], plus
    the crc32c manifest ``torch_dist.checksums.json`` that the latter checks.

    Args:
        path: the checkpoint's directory, ``s3://bucket/prefix``, or an opened `Storage`
            (``checkpoint_id`` given to ``dcp.save`` replaces it).
        thread_count: files (and writer threads) per rank, as ``FileSystemWriter(thread_count=...)``.
        storage_options: ``LocalStorageOptions`` / ``S3StorageOptions`` for `open_storage`
            (e.g. ``LocalStorageOptions(fsync=False)`` for scratch checkpoints).
        overwrite: replace a checkpoint already at ``path`` (DCP's default); False refuses it.

    Example:

    ```python
    writer = dist_ckpt.dcp.StorageWriter("s3://bucket/run/step_100", thread_count=4)
    future = dcp.async_save(state_dict, storage_writer=writer)
    ```
    """

    def __init__(
        self,
        path: LocationLike,
        *,
        thread_count: int = 2,
        storage_options: Optional[StorageOptions] = None,
        overwrite: bool = True,
    ) -> None:
        if not isinstance(thread_count, int) or isinstance(thread_count, bool) or thread_count < 1:
            raise CheckpointingException(f"StorageWriter: thread_count must be an int >= 1, got {thread_count!r}")
        super().__init__(path, storage_options)
        self.thread_count = thread_count
        self.overwrite = overwrite
        self._rank = 0

    def __getstate__(self) -> Any:  # a storage carries its location, not its connection
        state = dict(self.__dict__)
        state["_storage"] = None
        return state

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        rank = kwargs.get("rank")
        self._rank = rank if isinstance(rank, int) else get_rank()
        if kwargs.get("use_collectives", True) is False:
            raise CheckpointingException(
                f"[rank {self._rank}] dist_ckpt.dcp.StorageWriter commits one .metadata for all ranks at "
                f"{self.storage.url}: save with use_collectives=True (DCP's default)"
            )
        self.storage.make_dir()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        """Coordinator: retire a checkpoint already at the location, then name each rank's files."""
        storage = self.storage
        if storage.exists(DCP_METADATA_FILENAME):
            if not self.overwrite:
                raise CheckpointExistsError(
                    f"[rank {self._rank}] {storage.url_of(DCP_METADATA_FILENAME)} exists: a checkpoint is already "
                    f"there and StorageWriter(overwrite=False) keeps it; save to a new location"
                )
            storage.delete(DCP_METADATA_FILENAME)  # first: the old files are about to be overwritten
            storage.delete(CHECKSUMS_FILENAME)
        return [dataclasses.replace(plan, storage_data=f"__{i}_") for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[List[WriteResult]]":
        """This rank's items into ``thread_count`` files, written concurrently."""
        prefix = plan.storage_data
        if not isinstance(prefix, str):
            raise CheckpointingException(
                f"[rank {self._rank}] the save plan's storage_data is {prefix!r}, not this writer's file prefix: "
                f"was prepare_global_plan of another writer used?"
            )
        groups = split_items(plan.items, self.thread_count) if plan.items else []
        names = [f"{prefix}{n}{DATA_SUFFIX}" for n in range(len(groups))]
        results: List[WriteResult] = []
        if groups:
            storage = self.storage
            with ThreadPoolExecutor(len(groups), thread_name_prefix="dist_ckpt_dcp_write") as pool:
                futures = [
                    pool.submit(write_file, storage, name, group, planner, self._rank)
                    for name, group in zip(names, groups)
                ]
                for future in futures:  # every file finishes (or fails) before the first error is raised
                    future.exception()
                for future in futures:
                    results.extend(future.result())
        logger.debug("dcp writer rank %d: %d items in %d files", self._rank, len(plan.items), len(names))
        done: "Future[List[WriteResult]]" = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """Coordinator: the manifest, then ``.metadata`` -- the commit."""
        version = _dcp_version()
        if version is not None:
            metadata.version = version
        locations, files = gathered_files(results)
        metadata.storage_data = locations
        metadata.storage_meta = self.storage_meta()
        mark_checksummed(metadata)
        metadata_bytes = pickle.dumps(metadata)
        storage = self.storage
        storage.write(CHECKSUMS_FILENAME, manifest(files, metadata_bytes))
        storage.write(DCP_METADATA_FILENAME, metadata_bytes)
        logger.debug("dcp writer: committed %s (%d items)", storage.url, len(locations))

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.storage.url)


def _dcp_version() -> Optional[str]:
    """The format version DCP's own writer records in ``.metadata`` (torch >= 2.6 has one)."""
    from torch.distributed.checkpoint import filesystem

    version = getattr(filesystem, "CURRENT_DCP_VERSION", None)
    return version if isinstance(version, str) else None
