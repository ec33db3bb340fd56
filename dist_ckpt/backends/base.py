"""The strategy interfaces every backend implements, and helpers they share.

A *strategy* saves or loads one part of a checkpoint: the sharded tensors (a *sharded backend*
such as safetensors or Zarr) or the common, non-sharded state. Strategies are found through
[`dist_ckpt.backends.registry`][dist_ckpt.backends.registry] by ``(action, backend, version)``, where ``backend`` is the
on-disk format name recorded in ``metadata.json``.

Call order (all methods are collective unless noted: every rank calls them together):

* save: ``SaveCommonStrategy.save_common`` (acts on rank 0 only),
  ``SaveCommonStrategy.save_sharded_objects``, then ``SaveShardedStrategy.save``. Each returns
  after this rank's files are durable; ``dist_ckpt.save`` then commits ``metadata.json``. An
  asynchronous save calls ``AsyncSaveShardedStrategy.async_save`` instead (local: it snapshots
  and returns an ``AsyncRequest``); the request's finalize functions, run on every rank once
  every rank's background write finished, are collective and end with the commit.
* verify (``dist-ckpt verify``, one process): ``LoadStrategyBase.verify_integrity``.
* streaming save (``dist-ckpt convert``, one process, no collective): a strategy whose
  ``can_stream`` is True returns a [`TensorStreamWriter`][dist_ckpt.backends.base.TensorStreamWriter] from
  ``begin_stream``; the caller ``add`` s whole tensors one at a time (then, for a strategy that keeps ShardedObjects
  with its tensors, ``add_object`` s them), calls ``finish``, then commits ``metadata.json``.
* describe (``dist-ckpt inspect``, one process): ``LoadShardedStrategy.describe_stored_shards``.
* load: ``LoadStrategyBase.check_backend_compatibility`` / ``check_version_compatibility``
  (local), ``LoadCommonStrategy.load_common``, ``load_sharded_objects``, then
  ``LoadShardedStrategy.load``. The ``*_metadata`` methods are local and need no process group.

Where: every method receives ``checkpoint_dir``, a [`Storage`][dist_ckpt.storage.base.Storage]
(`dist_ckpt.storage.location`): a ``LocalStorage`` for a local directory, an ``S3Storage``
for an object store. A strategy that works through the Storage methods runs on both and
declares ``object_storage = True``; its local fast paths branch on the storage's capabilities
(``local_paths``, ``positional_reads``). A strategy written for directories leaves
``object_storage`` False: it is refused on object stores before any byte moves, and on a local
disk it gets the directory as ``checkpoint_dir.local_dir`` -- or simply ``Path(checkpoint_dir)``,
since a ``LocalStorage`` is ``os.PathLike``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch

from dist_ckpt.backends.stored_shards import StoredShardInfo
from dist_ckpt.errors import IncompatibleStrategyError
from dist_ckpt.integrity.checksums import IntegrityReport
from dist_ckpt.model.dict_utils import nested_values
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from dist_ckpt.storage.base import Storage

if TYPE_CHECKING:
    from dist_ckpt.asynchronous.queue import AsyncRequest


class SaveStrategyBase(ABC):
    """Base of save strategies: they write ``backend`` format version ``version``."""

    #: top-level entries of a checkpoint directory this strategy writes; save() refuses a
    #: directory that already holds any of them (the leftovers of an interrupted save)
    owned_paths: ClassVar[Tuple[str, ...]] = ()
    #: whether the strategy works through the Storage methods, and so can write to an object
    #: store; False: written for local directories (see the module docstring, :func:`check_location`)
    object_storage: ClassVar[bool] = False
    #: files (relative keys) this strategy writes that vouch for other files' bytes: checksum
    #: manifests, indexes with checksums. Those present at commit are digested into
    #: ``metadata.json``, so that deleting or downgrading one is corruption (see
    #: :mod:`dist_ckpt.record.records`); loaders read them with ``read_recorded``
    integrity_records: ClassVar[Tuple[str, ...]] = ()
    #: file names a key cannot be stored under because the strategy's own records use them
    #: (compared with the key's encoded name, :func:`dist_ckpt.storage.encode_key`); ``save``
    #: refuses such keys before writing anything
    reserved_names: ClassVar[Tuple[str, ...]] = ()

    def __init__(self, backend: str, version: int) -> None:
        self.backend = backend
        self.version = version

    def check_location(self, checkpoint_dir: Storage) -> None:
        """Raise [`IncompatibleStrategyError`][dist_ckpt.errors.IncompatibleStrategyError] if this strategy cannot write
        to ``checkpoint_dir`` (by default: an object store unless ``object_storage``). Called on every rank before a
        save writes anything."""
        _check_location(self, self.object_storage, checkpoint_dir, "write to")

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether [`SaveShardedStrategy.save()`][dist_ckpt.backends.base.SaveShardedStrategy.save] also saves
        ShardedObjects."""
        return False

    def __str__(self) -> str:
        return f"{self.__class__.__name__}({self.backend!r}, {self.version})"


class LoadStrategyBase(ABC):
    """Base of load strategies.

    Subclasses declare the formats they read in ``supported_backends`` and
    ``supported_versions``; the compatibility checks below compare the checkpoint's
    ``metadata.json`` against them before any tensor is touched.
    """

    supported_backends: ClassVar[Tuple[str, ...]] = ()
    supported_versions: ClassVar[Tuple[int, ...]] = ()
    #: whether the strategy can read from an object store (see the module docstring)
    object_storage: ClassVar[bool] = False

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether [`LoadShardedStrategy.load()`][dist_ckpt.backends.base.LoadShardedStrategy.load] also loads
        ShardedObjects."""
        return False

    def check_location(self, checkpoint_dir: Storage) -> None:
        """Raise [`IncompatibleStrategyError`][dist_ckpt.errors.IncompatibleStrategyError] if this strategy cannot read
        ``checkpoint_dir`` (by default: an object store unless ``object_storage``). Called before a load reads
        anything."""
        _check_location(self, self.object_storage, checkpoint_dir, "read from")

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raise [`IncompatibleStrategyError`][dist_ckpt.errors.IncompatibleStrategyError] if this strategy cannot read
        ``loaded_backend``."""
        if loaded_backend not in self.supported_backends:
            raise IncompatibleStrategyError(
                f"{self.__class__.__name__} reads backends {list(self.supported_backends)}, "
                f"but the checkpoint was written with backend {loaded_backend!r}"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raise [`IncompatibleStrategyError`][dist_ckpt.errors.IncompatibleStrategyError] if this strategy cannot read
        ``loaded_version``."""
        if loaded_version not in self.supported_versions:
            raise IncompatibleStrategyError(
                f"{self.__class__.__name__} reads format versions {list(self.supported_versions)}, "
                f"but the checkpoint has version {loaded_version}; upgrade dist_ckpt or use a "
                f"strategy that supports it"
            )

    def verify_integrity(self, checkpoint_dir: Storage) -> IntegrityReport:
        """Check every file of this strategy's part of a checkpoint against what was recorded at
        save time (local, one process; for ``dist-ckpt verify``). Never raises for damage: each
        problem is a line of the report. The default checks nothing and says so."""
        return IntegrityReport(notes=[f"{self} cannot verify its files; they were not checked"])

    def __str__(self) -> str:
        return self.__class__.__name__


def _check_location(strategy: object, supported: bool, checkpoint_dir: Storage, verb: str) -> None:
    if checkpoint_dir.local_paths or supported:
        return
    raise IncompatibleStrategyError(
        f"{strategy} cannot {verb} object storage ({checkpoint_dir.url}): it works on local directories only. "
        "Use a backend that supports object stores (the default safetensors backend, or zarr), or a local path"
    )


class SaveCommonStrategy(SaveStrategyBase):
    """Saves the common (non-sharded) state and, usually, ShardedObjects."""

    @abstractmethod
    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Storage) -> None:
        """Save the common state; only rank 0's call writes anything."""

    def save_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> None:
        """Save this rank's main-replica ShardedObjects."""
        raise IncompatibleStrategyError(f"{self} cannot save ShardedObjects; use a common strategy that can")


#: ``(key, dtype, global shape)`` of a tensor a :class:`TensorStreamWriter` will be given
TensorLayout = Tuple[str, torch.dtype, Tuple[int, ...]]


class TensorStreamWriter(ABC):
    """Writes whole tensors, one at a time, as the sharded part of a new checkpoint.

    For conversions (``dist-ckpt convert``): memory for one tensor suffices, whatever the size
    of the checkpoint. One process writes; no collective is called.

    Call order: ``SaveShardedStrategy.begin_stream(checkpoint_dir, layout)`` returns the writer;
    then [`add()`][.add] once per entry of the layout, in the layout's order; then [`finish()`][.finish],
    which makes every file durable and writes the backend's own index or manifest. The caller
    commits ``metadata.json`` after it, as ``dist_ckpt.save`` does. A writer that is not
    finished leaves no committed checkpoint.

    Example:

    ```python
    writer = strategy.begin_stream(LocalStorage("out"), [("w", torch.float32, (4, 4))])
    writer.add("w", torch.zeros(4, 4))
    writer.finish()
    ```
    """

    @abstractmethod
    def add(self, key: str, tensor: torch.Tensor) -> None:
        """Write the whole tensor ``key``: the next entry of the layout, with its dtype and shape."""

    def add_object(self, unique_key: str, value: Any) -> None:
        """Write one ShardedObject (its unique key and value), for writers of strategies that keep
        ShardedObjects with the tensors (``can_handle_sharded_objects``, e.g. torch_dist): after
        the last [`add()`][..add], before [`finish()`][..finish]. The default raises: the others' objects are
        written by the common strategy."""
        raise IncompatibleStrategyError(f"{type(self).__name__} does not store ShardedObjects ({unique_key!r})")

    @abstractmethod
    def finish(self) -> None:
        """Make everything written durable and write the index; call once, after the last ``add``."""

    def abort(self) -> None:
        """Give up: release what an unfinished write holds (e.g. an open multipart upload).

        The caller removes the files already written; a writer holding nothing keeps this default.
        """


def check_stream_entry(layout: Sequence[TensorLayout], position: int, key: str, tensor: torch.Tensor) -> None:
    """Raise unless ``(key, tensor)`` is entry ``position`` of ``layout`` (for stream writers).

    Example:

    ```python
    check_stream_entry([("w", torch.float32, (2,))], 0, "w", torch.zeros(2))   # passes
    ```
    """
    from dist_ckpt.errors import CheckpointingException

    if position >= len(layout):
        raise CheckpointingException(f"tensor {key!r} added after the {len(layout)} tensors of the stream's layout")
    expected_key, dtype, shape = layout[position]
    if key != expected_key or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
        raise CheckpointingException(
            f"stream entry {position}: expected tensor {expected_key!r} {dtype} {tuple(shape)}, "
            f"got {key!r} {tensor.dtype} {tuple(tensor.shape)}; add the tensors of the layout, in its order"
        )


def main_replica_shards(sharded_state_dict: ShardedStateDict) -> List[ShardedTensor]:
    """The ShardedTensors of ``sharded_state_dict`` this rank writes: its main replicas (the
    other replicas hold the same bytes, written by another rank)."""
    return [
        s for s in nested_values(sharded_state_dict) if isinstance(s, ShardedTensor) and is_main_replica(s.replica_id)
    ]


def loaded_shape(sh: ShardedTensor) -> Tuple[int, ...]:
    """The shape a load returns for ``sh``: its local shape, or 1-D for a flattened range."""
    if sh.flattened_range is None:
        return tuple(sh.local_shape)
    return (sh.flattened_range.stop - sh.flattened_range.start,)


def load_destination(sh: ShardedTensor) -> torch.Tensor:
    """The tensor a loader fills for ``sh``: ``sh.data`` when it is real memory (any device) of
    the loaded shape, so the load is in place, else a new CPU tensor."""
    shape = loaded_shape(sh)
    data = sh.data
    if data is not None and data.device.type != "meta" and tuple(data.shape) == shape:
        return data
    return torch.empty(shape, dtype=sh.dtype)


class SaveShardedStrategy(SaveStrategyBase):
    """Saves sharded tensors (the sharded backend)."""

    #: whether :meth:`begin_stream` is available (saving whole tensors one at a time)
    can_stream: ClassVar[bool] = False

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> None:
        """Save this rank's main-replica shards; return once they are durable on every rank."""

    def begin_stream(self, checkpoint_dir: Storage, layout: Sequence[TensorLayout]) -> TensorStreamWriter:
        """A writer of the whole tensors of ``layout``, one at a time, into ``checkpoint_dir``
        (one process; see [`TensorStreamWriter`][dist_ckpt.backends.base.TensorStreamWriter]). Optional: available when
        `can_stream` is True; the default raises
        [`IncompatibleStrategyError`][dist_ckpt.errors.IncompatibleStrategyError]."""
        raise IncompatibleStrategyError(
            f"{self} cannot save tensor by tensor (can_stream is False); convert to a backend that can, "
            f"e.g. safetensors or zarr"
        )


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A sharded save strategy that can write in the background."""

    @abstractmethod
    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> "AsyncRequest":
        """Prepare the save and return the request that performs it; the caller schedules it."""

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> None:
        """Every async strategy can be used synchronously."""
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()


class LoadCommonStrategy(LoadStrategyBase):
    """Loads the common state and ShardedObjects."""

    @abstractmethod
    def load_common(self, checkpoint_dir: Storage) -> StateDict:
        """Load the common state dict."""

    @abstractmethod
    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> StateDict:
        """Return ``sharded_objects_state_dict`` with every ShardedObject replaced by its value."""

    def load_sharded_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        """Metadata of the stored ShardedObjects, keyed by their unique keys."""
        raise IncompatibleStrategyError(f"{self} cannot list ShardedObjects")


class LoadShardedStrategy(LoadStrategyBase):
    """Loads sharded tensors (the sharded backend)."""

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> StateDict:
        """Return ``sharded_state_dict`` with every ShardedTensor replaced by its loaded tensor."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        """``{key: ShardedTensor}`` for every stored tensor, unsharded and without data, described
        as it was saved (`dist_ckpt.model.stored_metadata.stored_tensor_metadata()`: a tensor
        saved as flattened ranges as one flattened range covering all of it)."""

    def load_sharded_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        """Metadata of stored ShardedTensors (and ShardedObjects, if this strategy handles them)."""
        if self.can_handle_sharded_objects:
            raise IncompatibleStrategyError(f"{self} handles ShardedObjects and must override load_sharded_metadata")
        return self.load_tensors_metadata(checkpoint_dir)

    def with_dtype_cast(self, allow: bool) -> "LoadShardedStrategy":
        """This strategy, configured to convert (``allow``) or to refuse requested dtypes that
        differ from the stored ones (see `dist_ckpt.model.dtype_cast`): what
        ``dist_ckpt.load(..., allow_dtype_cast=...)`` uses. Local; the caller's strategy is not
        changed (a configured copy is returned when the setting differs).

        The built-in loaders take the setting as an option (casting is their default) and
        wrappers pass it to the strategy they wrap. The default raises
        [`IncompatibleStrategyError`][dist_ckpt.errors.IncompatibleStrategyError]: a strategy that does not know the
        setting could not honour it.

        Example:

        ```python
        strict = SafetensorsLoadShardedStrategy().with_dtype_cast(False)
        ```
        """
        raise IncompatibleStrategyError(
            f"{self} does not implement with_dtype_cast, so it cannot be told whether to cast dtypes on load; "
            "leave load's allow_dtype_cast unset (the strategy decides) or configure the strategy itself"
        )

    def remove_sharded_tensors(self, checkpoint_dir: Storage, key_prefix: str) -> None:
        """Delete every stored tensor whose key starts with ``key_prefix``."""
        raise IncompatibleStrategyError(f"{self} cannot remove tensors from a checkpoint")

    def describe_stored_shards(self, checkpoint_dir: Storage) -> Optional[Dict[str, List[StoredShardInfo]]]:
        """How each stored tensor is laid out: its pieces (box or flattened range), their files
        and sizes, read from the metadata alone (local, one process; for ``dist-ckpt inspect``).

        Optional: the default returns None, meaning the backend does not describe its layout
        (inspect then shows shapes and dtypes only).

        Example:

        ```python
        shards = strategy.describe_stored_shards(LocalStorage("ckpt/iter_1000"))
        len(shards["decoder.w"])   # number of stored pieces of that tensor
        ```
        """
        return None
