"""What the strategies of the two zarr engines (zarr-python and TensorStore) share.

Both engines read and write one layout (`dist_ckpt.backends.zarr.layout`), so everything but the
array library is the same: where a checkpoint may live, what a save records, how a load is
checked and planned before its first read, the metadata of the stored tensors, the integrity
check and the description of the stored shards. An engine's strategy subclasses one of the two
bases here and keeps only what differs: its ``engine`` name (for error messages), its reads and
writes, and (loaders) how it opens an array to learn its shape and dtype (`_shape_dtype()`).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Dict, List, Optional, Tuple, Union

import numpy as np

from dist_ckpt.backends.base import LoadShardedStrategy, SaveShardedStrategy
from dist_ckpt.backends.stored_shards import StoredShardInfo
from dist_ckpt.backends.zarr.checksums import MANIFEST_KEY, manifest_check, read_checksums, verify_zarr
from dist_ckpt.backends.zarr.layout import PARTIAL_ZARR_DIR, ZARR_DIR, checkpoint_node
from dist_ckpt.backends.zarr.megatron import load_zarr_based_sharded_metadata
from dist_ckpt.backends.zarr.metadata import describe_zarr
from dist_ckpt.backends.zarr.metadata_index import read_index
from dist_ckpt.backends.zarr.read_plan import ReadPlan, plan_request
from dist_ckpt.integrity.checksums import FileDigest, IntegrityReport
from dist_ckpt.model.dict_utils import nested_values
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor
from dist_ckpt.storage import Storage
from dist_ckpt.storage.object_path import ObjectPath

__all__ = ["PlannedLoad", "ShapeDtype", "ZarrLoadStrategyBase", "ZarrSaveStrategyBase"]

#: ``(shape, numpy dtype)`` of the zarr array at a path (a ``str`` for a local array, the
#: `ObjectPath` for one on S3), read the engine's way
ShapeDtype = Callable[[Union[str, ObjectPath]], Tuple[Tuple[int, ...], np.dtype]]


@dataclass(frozen=True)
class PlannedLoad:
    """A load after every check and before its first read (`ZarrLoadStrategyBase._plan_load()`).

    Attributes:
        node: the checkpoint directory as a node (the root of its storage).
        requested: the ShardedTensors of the request, in the order of the state dict.
        manifest: ``zarr/checksums.json`` when checksums are verified and the checkpoint has one.
        plans: the reads of each requested shard, by ``id``.
    """

    node: ObjectPath
    requested: List[ShardedTensor]
    manifest: Optional[Dict[str, FileDigest]]
    plans: Dict[int, ReadPlan]


class ZarrSaveStrategyBase(SaveShardedStrategy):
    """A zarr engine's save: the location it accepts and the records it owns.

    Subclasses set ``engine`` and implement ``save``.
    """

    owned_paths: ClassVar[Tuple[str, ...]] = (ZARR_DIR, PARTIAL_ZARR_DIR)
    object_storage: ClassVar[bool] = True
    integrity_records: ClassVar[Tuple[str, ...]] = (MANIFEST_KEY,)
    #: how errors name the engine (e.g. "the TensorStore engine")
    engine: ClassVar[str]

    def check_location(self, checkpoint_dir: Storage) -> None:
        """Local directories and S3 (through the engine's own S3 client: zarr-python's ObjectStore or
        TensorStore's s3 driver); other object stores are refused."""
        checkpoint_node(checkpoint_dir, self.engine)


class ZarrLoadStrategyBase(LoadShardedStrategy):
    """A zarr engine's load: the checks and plan before the first read, and every part of the
    loader interface that reads metadata only (tensor metadata, integrity, stored shards).

    Subclasses set ``engine`` and the ``verify_checksums`` and ``allow_dtype_cast`` options, and
    implement ``load`` (usually on `_plan_load()`), ``with_dtype_cast`` and `_shape_dtype()`.
    """

    supported_backends: ClassVar[Tuple[str, ...]] = ("zarr",)
    supported_versions: ClassVar[Tuple[int, ...]] = (1,)
    #: how errors name the engine (e.g. "the TensorStore engine")
    engine: ClassVar[str]
    verify_checksums: bool
    allow_dtype_cast: bool

    def check_location(self, checkpoint_dir: Storage) -> None:
        """Local directories and S3 (through the engine's own S3 client: zarr-python's ObjectStore or
        TensorStore's s3 driver); other object stores are refused."""
        checkpoint_node(checkpoint_dir, self.engine)

    def _plan_load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> PlannedLoad:
        """Check the request against the checkpoint (keys, dtypes, shapes, coverage, and with
        ``verify_checksums`` every ``zarr.json`` read) and plan its reads, before any tensor byte
        is read (`read_plan.plan_request()`)."""
        node = checkpoint_node(checkpoint_dir, self.engine)
        requested = [s for s in nested_values(sharded_state_dict) if isinstance(s, ShardedTensor)]
        manifest = read_checksums(node) if self.verify_checksums and requested else None
        check = manifest_check(node / ZARR_DIR, manifest)
        index = read_index(node / ZARR_DIR, manifest, check)  # every zarr.json in one read
        plans = plan_request(requested, node, self.allow_dtype_cast, check, index)
        return PlannedLoad(node, requested, manifest, plans)

    @abstractmethod
    def _shape_dtype(self, node: ObjectPath) -> ShapeDtype:
        """How this engine reads the shape and dtype of an array of the checkpoint at ``node``."""

    def load_tensors_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        node = checkpoint_node(checkpoint_dir, self.engine)
        manifest = read_checksums(node) if self.verify_checksums else None
        check = manifest_check(node / ZARR_DIR, manifest)
        return load_zarr_based_sharded_metadata(node, self._shape_dtype(node), manifest, check)

    def verify_integrity(self, checkpoint_dir: Storage) -> IntegrityReport:
        """Every file of ``zarr/`` against ``zarr/checksums.json`` (see `zarr_checksums`)."""
        return verify_zarr(checkpoint_node(checkpoint_dir, self.engine))

    def describe_stored_shards(self, checkpoint_dir: Storage) -> Optional[Dict[str, List[StoredShardInfo]]]:
        """Every chunk (a saved shard) or fragment (a saved flattened range), from the metadata."""
        return describe_zarr(checkpoint_node(checkpoint_dir, self.engine))
