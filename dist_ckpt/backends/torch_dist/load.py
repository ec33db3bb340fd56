"""The ``torch_dist`` load strategy: Megatron-Core and plain DCP checkpoints, resharded by DCP.

Reads what Megatron-Core's ``torch_dist`` backend (and dist_ckpt's) writes, in any layout the
request describes: TP/PP/DP resharding, flattened ranges -- requested, or stored in Megatron-Core's
reformulated layout --, ``allow_shape_mismatch``, dtype casting, ShardedObjects. Steps:

1. read ``.metadata`` with the restricted unpickler (`metadata`: nothing from the file is
   run) and, when the checkpoint has one, the checksum manifest;
2. check every request against it before reading a byte: absent keys raise
   [`KeyMismatchError`][dist_ckpt.errors.KeyMismatchError], global shapes that differ raise
   [`LoadMismatchError`][dist_ckpt.errors.LoadMismatchError] (unless ``allow_shape_mismatch``), dtypes that differ
   are cast (logged at INFO) unless ``allow_dtype_cast=False``;
3. plan the reads (`read_plan`: DCP's own resharding helper), in the order of the bytes in
   the files (DCP reads in plan order: a cold read is then sequential), and run them with DCP's
   ``load`` on this rank alone (``no_dist=True``: no collective, so it also works without a process
   group), through DCP's ``FileSystemReader``, which ``copy_`` s each stored item into the result
   -- in place when the request's ``data`` is allocated;
4. when the manifest records checksums, each item's bytes are checked against their crc32c as
   DCP reads them (`verified_read`: no second read, no copy), before DCP uses its values; ShardedObjects are
   unpickled with ``torch.load(weights_only=True)`` (with
   `PLAIN_DATA_TYPES` allowed), never with
   full pickle unless ``allow_pickle``.

Plain DCP directories (``torch.distributed.checkpoint.save`` of torchtitan, OLMo-core, ...: no
``metadata.json``) are read by the same code; their bytes entries are not ShardedObjects but the
state dict's other values, which [`DCPCommonLoadStrategy`][dist_ckpt.backends.torch_dist.plain.DCPCommonLoadStrategy]
returns as the common state.

Example:

```python
dc.load(sharded_state_dict, "megatron_ckpt/iter_0001000")      # metadata.json says torch_dist
dc.load(sd, ckpt, sharded_strategy=TorchDistLoadShardedStrategy(allow_pickle=True))  # trusted
```
"""

from __future__ import annotations

import copy
import io
import logging
import os
import pickle
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ClassVar, Dict, Generator, List, Optional, Sequence, Tuple, Union, cast

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.futures import Future

from dist_ckpt.backends.base import LoadShardedStrategy
from dist_ckpt.backends.request_checks import check_requested_tensors, object_layout_error
from dist_ckpt.backends.stored_shards import StoredShardInfo
from dist_ckpt.backends.torch_dist.checksums import (
    CHECKSUMS_FILENAME,
    FileSpans,
    Span,
    check_bytes,
    item_spans,
    parse_manifest,
    require_manifest,
)
from dist_ckpt.backends.torch_dist.layout import (
    TorchDistLayout,
    describe_layout,
    parse_layout,
    sharded_metadata,
    tensors_metadata,
)
from dist_ckpt.backends.torch_dist.metadata import DCP_METADATA_FILENAME, unpickle_metadata
from dist_ckpt.backends.torch_dist.read_plan import ReadPlanner, object_read_item, plan_tensor_reads
from dist_ckpt.backends.torch_dist.remove import remove_tensors
from dist_ckpt.backends.torch_dist.verified_read import CheckedView, ItemCheck
from dist_ckpt.backends.torch_dist.verify import short_files
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import (
    CheckpointingException,
    CorruptCheckpointError,
    KeyMismatchError,
    NotACheckpointError,
    UnsafeObjectError,
    format_keys,
)
from dist_ckpt.integrity.checksums import IntegrityReport
from dist_ckpt.model.dict_utils import dict_list_map_inplace, nested_values
from dist_ckpt.model.plain_types import plain_data_allowed
from dist_ckpt.model.sharded import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from dist_ckpt.record.records import read_recorded
from dist_ckpt.storage import Storage, open_regular
from dist_ckpt.storage.errors import ObjectNotFoundError
from dist_ckpt.storage.location import LocationLike, require_local, resolve_location

__all__ = [
    "OpenedCheckpoint",
    "TorchDistLoadShardedStrategy",
    "local_storage",
    "open_checkpoint",
    "run_dcp_load",
    "unpickle_item",
]

logger = logging.getLogger(__name__)

_OPT_IN = "sharded_strategy=TorchDistLoadShardedStrategy(allow_pickle=True)"


#: what needs the checkpoint's files on a local disk (the ``local_paths`` capability)
_LOCAL_ONLY = "the torch_dist backend (torch.distributed.checkpoint's file reader and writer)"


@dataclass(frozen=True)
class OpenedCheckpoint:
    """A DCP checkpoint's layout and, when recorded, the checksum spans of its files.

    Attributes:
        storage: where the checkpoint is.
        layout: what ``.metadata`` describes.
        manifest: the checksum spans of each file, by name (None: none recorded).
    """

    storage: Storage
    layout: TorchDistLayout
    manifest: Optional[Dict[str, FileSpans]]

    @property
    def directory(self) -> Path:
        """The checkpoint's directory, for DCP's file reader (storages with ``local_paths``).

        Raises:
            IncompatibleStrategyError: the checkpoint is on an object store.
        """
        return require_local(self.storage, _LOCAL_ONLY)


def local_storage(checkpoint_dir: LocationLike) -> Storage:
    """The storage of ``checkpoint_dir``, which must have local files (DCP reads and writes them).

    Raises:
        IncompatibleStrategyError: an object store.
    """
    storage = resolve_location(checkpoint_dir)
    require_local(storage, _LOCAL_ONLY)
    return storage


def open_checkpoint(
    checkpoint_dir: LocationLike, allow_pickle: bool = False, verify_checksums: bool = True
) -> OpenedCheckpoint:
    """Read ``.metadata`` (restricted unpickler) and the checksum manifest, if any, from the
    checkpoint's storage.

    With ``verify_checksums``, ``.metadata`` itself is checked against the manifest first, and a
    ``.metadata`` that records a manifest (see `checksums`) refuses to open without it. Every
    file the metadata names must exist and hold its items (one size per file).

    Raises:
        NotACheckpointError: no ``.metadata``.
        UnsafeObjectError, CorruptCheckpointError, ChecksumMismatchError: see `metadata`.
        CorruptCheckpointError: a file the metadata names is missing or too short.
    """
    storage = resolve_location(checkpoint_dir)
    where = storage.url_of(DCP_METADATA_FILENAME)
    try:
        raw = storage.read(DCP_METADATA_FILENAME)
    except ObjectNotFoundError:
        raise NotACheckpointError(
            f"{storage.url!r} holds no {DCP_METADATA_FILENAME}: not a torch.distributed.checkpoint checkpoint, "
            f"or its save did not finish"
        ) from None
    manifest = None
    manifest_raw = read_recorded(storage, CHECKSUMS_FILENAME)  # fails closed: a recorded manifest must be there
    if manifest_raw is not None:
        manifest = parse_manifest(manifest_raw, storage.url_of(CHECKSUMS_FILENAME))
        recorded = manifest.get(DCP_METADATA_FILENAME)
        if verify_checksums and recorded is not None:
            if len(raw) != recorded.size:
                raise CorruptCheckpointError(
                    f"{where} has {len(raw)} bytes, {recorded.size} were recorded at save time (truncated or replaced)"
                )
            check_bytes(raw, 0, recorded.spans, where, "the DCP metadata")
    metadata = unpickle_metadata(raw, where, allow_pickle)
    if verify_checksums:  # a marked checkpoint without its manifest would load unverified: refused
        require_manifest(metadata, manifest is not None, storage)
    layout = parse_layout(metadata, storage.url)
    for name, problem, key in short_files(storage, layout)[:1]:  # before a size is trusted to allocate a tensor
        raise CorruptCheckpointError(f"{storage.url_of(name)} {problem}: the DCP metadata places {key!r} beyond it")
    return OpenedCheckpoint(storage, layout, manifest)


def unpickle_item(data: bytes, where: str, what: str, allow_pickle: bool, opt_in: str = _OPT_IN) -> Any:
    """A bytes entry's value, unpickled without running code from the file (unless ``allow_pickle``).

    Raises:
        UnsafeObjectError: the value needs classes ``weights_only`` refuses (names them, ``what``,
            the file and the opt-in).
        CorruptCheckpointError: not a ``torch.save`` archive.
    """
    try:
        with plain_data_allowed():
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=not allow_pickle)
    except pickle.UnpicklingError as e:
        try:
            unsafe = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
        except Exception:  # noqa: BLE001 -- damaged bytes: reported below
            unsafe = []
        if unsafe:
            raise UnsafeObjectError(
                f"{what} in {where} needs full pickle to load ({', '.join(unsafe)}): loading it would run code from "
                f"the checkpoint. If you trust it, pass {opt_in}"
            ) from e
        raise CorruptCheckpointError(f"{what} in {where} cannot be unpickled: {e}") from e
    except Exception as e:  # noqa: BLE001 -- torch.load fails in many ways on damaged bytes
        raise CorruptCheckpointError(f"{what} in {where} is truncated or corrupt: {type(e).__name__}: {e}") from e


class _CheckpointFiles(FileSystem):
    """DCP's local file system, opening only the checkpoint's own files for DCP's reader: each is
    found through the checkpoint's storage (`local_path()`, the one link policy: a link out of the
    checkpoint raises [`UnsafeLinkError`][dist_ckpt.errors.UnsafeLinkError]) and opened as a regular file
    (`open_regular()`: a FIFO raises instead of blocking the load forever).

    Args:
        storage: the checkpoint.
        directory: its local directory, the one DCP's reader joins the files' names to.
    """

    def __init__(self, storage: Storage, directory: Path) -> None:
        super().__init__()
        self._storage = storage
        self._directory = directory

    def open_file(self, name: str) -> IO[bytes]:
        """The checkpoint's file ``name`` (a name from ``.metadata``), open for reading."""
        return open(open_regular(self._storage.local_path(name), self._storage.url_of(name)), "rb")

    @contextmanager
    def create_stream(self, path: Union[str, "os.PathLike[str]"], mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            raise CheckpointingException(f"the torch_dist loader opens {path} for reading only, not {mode!r}")
        name = os.path.relpath(path, self._directory)
        with self.open_file(name) as stream:
            yield cast(io.IOBase, stream)


class _Reader(FileSystemReader):
    """DCP's file reader, given the metadata already read safely, checking each item's bytes
    against the recorded crc32c (when there is a manifest) as DCP reads them.

    Each item's view is a `CheckedView`; `finish_item()` completes and compares the item's
    check (see `verified_read`). It runs before DCP uses the item's values (the planner's
    ``before_item``), when the next item is opened, and when a read fails (a damaged byte then
    raises [`ChecksumMismatchError`][dist_ckpt.errors.ChecksumMismatchError] rather than whatever
    ``torch.load`` made of it).

    DCP opens the files through `_CheckpointFiles`: the link policy of every other read holds.
    """

    def __init__(self, opened: OpenedCheckpoint, verify: bool) -> None:
        super().__init__(opened.directory)
        self._opened = opened
        self.fs = self._files = _CheckpointFiles(opened.storage, opened.directory)
        self._spans: Dict[str, Tuple[List[int], Tuple[Span, ...]]] = {}
        self._pending: Optional[Tuple[ItemCheck, Any, str]] = None
        if verify and opened.manifest is not None:
            for name, spans in opened.manifest.items():
                self._spans[name] = ([s[0] for s in spans.spans], spans.spans)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._opened.layout.metadata
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        assert metadata.storage_meta is not None
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        self.finish_item()
        view = super()._slice_file(file, sinfo)
        found = self._spans.get(sinfo.relative_path)
        if found is None or not sinfo.length:
            return view
        inside = item_spans(found[0], found[1], sinfo.offset, sinfo.length)
        if inside is None:  # a span crosses the item's ends: it cannot be checked alone
            return view
        where = self._opened.storage.url_of(sinfo.relative_path)
        check = ItemCheck(inside, where, f"[rank {get_rank()}] item at byte {sinfo.offset}")
        self._pending = (check, file, sinfo.relative_path)
        return cast(IO[bytes], CheckedView(view, sinfo.offset, check))

    def finish_item(self) -> None:
        """Complete and compare the check of the item read last, if not done yet.

        Raises:
            ChecksumMismatchError, CorruptCheckpointError: see `ItemCheck.finish()`.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        check, file, name = pending
        if not file.closed:
            check.finish(file.fileno())
            return
        with self._files.open_file(name) as reopened:  # DCP closed the file when the read failed
            check.finish(reopened.fileno())

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read loop (each file once, its items in plan order), with each tensor item's
        values handed to `ReadPlanner.load_tensor()`, which refuses an item stored in another
        dtype than ``.metadata`` declares; DCP's own loop casts it silently. No stream transforms
        are applied: `parse_layout()` refuses items written with them."""
        assert isinstance(planner, ReadPlanner)
        by_file: Dict[str, List[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as stream:
                for item in items:
                    view: IO[bytes] = self._slice_file(stream, self.storage_data[item.storage_index])
                    if item.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(item, io.BytesIO(view.read(-1)))
                        continue
                    if not view.seekable():  # torch.load seeks
                        view = io.BytesIO(view.read(-1))
                    stored = torch.load(view, map_location="cpu", weights_only=True)
                    planner.load_tensor(item, stored, self._opened.storage.url_of(name))
        done: Future[None] = Future()
        done.set_result(None)
        return done


def run_dcp_load(opened: OpenedCheckpoint, planner: ReadPlanner, verify: bool) -> None:
    """Run DCP's ``load`` with ``planner`` on this rank alone (no collective) and turn DCP's
    ``CheckpointException`` (a BaseException) back into the error that caused it -- a failed
    checksum first, when the item being read has one."""
    reader = _Reader(opened, verify)
    planner.before_item = reader.finish_item
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load({}, storage_reader=reader, planner=planner, no_dist=True)
        reader.finish_item()
    except CheckpointException as e:
        reader.finish_item()  # damaged bytes explain the failure better than torch.load's error
        for error, _ in e.failures.values():
            if isinstance(error, CheckpointingException):
                raise error from None
            raise CorruptCheckpointError(
                f"[rank {get_rank()}] reading {opened.storage.url} failed: {type(error).__name__}: {error}"
            ) from error
        raise CorruptCheckpointError(f"[rank {get_rank()}] reading {opened.storage.url} failed: {e}") from e


def _position(layout: TorchDistLayout, item: ReadItem) -> Tuple[str, int]:
    """Where a ReadItem's stored bytes are: reading in this order reads each file sequentially."""
    info = layout.metadata.storage_data[item.storage_index]
    return info.relative_path, info.offset


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Loads ``torch_dist`` checkpoints (Megatron-Core's, and dist_ckpt's) into any sharding.

    Needs no process group (no collective is called). Keeps the last checkpoint's parsed
    metadata, so loading tensor by tensor (unshard, convert) reads ``.metadata`` once.

    Args:
        allow_pickle: unpickle ``.metadata`` and ShardedObjects with full pickle (runs code from
            the checkpoint: only for checkpoints you trust).
        verify_checksums: check each item read against the crc32c recorded at save time (when
            the checkpoint has ``torch_dist.checksums.json``).
        allow_dtype_cast: load a tensor stored in another dtype into the requested one (as
            Megatron-Core and DCP do); False raises [`LoadMismatchError`][dist_ckpt.errors.LoadMismatchError].

    Example:

    ```python
    dc.load(sd, "ckpt", sharded_strategy=TorchDistLoadShardedStrategy(verify_checksums=False))
    ```
    """

    supported_backends: ClassVar[Tuple[str, ...]] = ("torch_dist",)
    supported_versions: ClassVar[Tuple[int, ...]] = (1,)
    #: bytes entries are Megatron-Core ShardedObjects (``torch.save`` of a list of values)
    megatron_objects: ClassVar[bool] = True

    def __init__(
        self, allow_pickle: bool = False, verify_checksums: bool = True, allow_dtype_cast: bool = True
    ) -> None:
        self.allow_pickle = allow_pickle
        self.verify_checksums = verify_checksums
        self.allow_dtype_cast = allow_dtype_cast
        self._cached: Optional[Tuple[Tuple[str, int, int], OpenedCheckpoint]] = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def remove_sharded_tensors(self, checkpoint_dir: Storage, key_prefix: str) -> None:
        """Delete every stored key that starts with ``key_prefix`` (one process; see `remove`).

        Raises:
            IncompatibleStrategyError: the checkpoint is on an object store.
            NotACheckpointError, CorruptCheckpointError: it cannot be opened, checksums verified.
        """
        remove_tensors(open_checkpoint(local_storage(checkpoint_dir)), key_prefix)
        self._cached = None

    def open(self, checkpoint_dir: LocationLike) -> OpenedCheckpoint:
        """The checkpoint's layout (cached while ``.metadata`` is unchanged).

        Raises:
            IncompatibleStrategyError: the checkpoint is on an object store (local files only).
        """
        storage = local_storage(checkpoint_dir)
        try:
            stat = storage.local_path(DCP_METADATA_FILENAME).stat()
            key: Optional[Tuple[str, int, int]] = (str(storage.local_dir.resolve()), stat.st_mtime_ns, stat.st_size)
        except FileNotFoundError:
            key = None
        if key is not None and self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        opened = open_checkpoint(storage, self.allow_pickle, self.verify_checksums)
        if key is not None:
            self._cached = (key, opened)
        return opened

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> StateDict:
        opened = self.open(checkpoint_dir)
        layout = opened.layout
        tensors = [x for x in nested_values(sharded_state_dict) if isinstance(x, ShardedTensor)]
        objects = [x for x in nested_values(sharded_state_dict) if isinstance(x, ShardedObject)]
        # 2. check everything before reading
        self._check_tensors(tensors, layout)
        self._check_objects(objects, layout)
        # 3. plan and read
        results, items, targets = plan_tensor_reads(tensors, layout)
        requesters: Dict[str, List[ShardedObject]] = {}
        for obj in objects:
            requesters.setdefault(obj.unique_key, []).append(obj)
        items += [object_read_item(key) for key in requesters]
        items.sort(key=lambda item: _position(layout, item))  # DCP reads in plan order: make it the files' order
        loaded: Dict[str, Any] = {}

        def on_bytes(key: str, data: bytes) -> None:
            loaded[key] = self._object_values(key, data, len(requesters[key]), opened)

        if items:
            run_dcp_load(opened, ReadPlanner(items, targets, on_bytes), self.verify_checksums)
        served: Dict[int, Any] = {}
        for key, group in requesters.items():
            for obj, value in zip(group, loaded[key]):
                served[id(obj)] = value

        def result(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                return results[id(x)]
            if isinstance(x, ShardedObject):
                return served[id(x)]
            return x

        return dict_list_map_inplace(result, sharded_state_dict)  # type: ignore[no-any-return]

    def _check_tensors(self, tensors: Sequence[ShardedTensor], layout: TorchDistLayout) -> None:
        """Absent keys, global shapes and dtypes against ``.metadata``, as every loader checks them
        (`check_requested_tensors()`)."""

        def lookup(key: str) -> Optional[Tuple[torch.dtype, Tuple[int, ...]]]:
            stored = layout.tensors.get(key)
            return None if stored is None else (stored.dtype, stored.shape)

        check_requested_tensors(tensors, lookup, repr(layout.where), self.allow_dtype_cast)

    def with_dtype_cast(self, allow: bool) -> "TorchDistLoadShardedStrategy":
        """This loader, converting (``allow``) or refusing requested dtypes that differ from the
        stored ones (see `dist_ckpt.model.dtype_cast`); a copy when the setting differs."""
        if self.allow_dtype_cast == allow:
            return self
        clone = copy.copy(self)
        clone.allow_dtype_cast = allow
        return clone

    def _check_objects(self, objects: Sequence[ShardedObject], layout: TorchDistLayout) -> None:
        missing = sorted({o.unique_key for o in objects if o.unique_key not in layout.byte_items})
        if not missing:
            return
        rank = get_rank()
        damaged = [
            k for k in missing if any(s.startswith(k.rpartition("/shard_")[0] + "/shard_") for s in layout.byte_items)
        ]
        for o in objects:
            if o.unique_key in damaged:
                stored = [s for s in layout.byte_items if s.startswith(f"{o.key}/shard_")]
                layout_error = object_layout_error(o, stored, repr(layout.where))
                if layout_error is not None:  # saved at another layout: not damage
                    raise layout_error
        if damaged:
            raise CorruptCheckpointError(
                f"[rank {rank}] ShardedObject shards {format_keys(damaged)} are not in checkpoint {layout.where!r}, "
                f"though other shards of their keys are (the checkpoint is incomplete)"
            )
        absent = sorted({k.rpartition("/shard_")[0] for k in missing})
        raise KeyMismatchError(
            f"[rank {rank}] ShardedObjects requested by load but absent from checkpoint {layout.where!r}: "
            f"{format_keys(absent)}",
            unexpected_keys=absent,
        )

    def _object_values(self, key: str, data: bytes, count: int, opened: OpenedCheckpoint) -> List[Any]:
        """The values for the ``count`` requesters of bytes entry ``key`` on this rank."""
        item = opened.layout.byte_items[key]
        where = opened.storage.url_of(item.file)
        value = unpickle_item(data, where, f"ShardedObject {key!r}", self.allow_pickle)
        if not self.megatron_objects:
            return [value] * count
        if not isinstance(value, list) or len(value) not in (1, count):
            raise CorruptCheckpointError(
                f"[rank {get_rank()}] ShardedObject {key!r} in {where}: Megatron-Core stores a list with one value "
                f"per saved replica, found {type(value).__name__}"
                + (f" of {len(value)}" if isinstance(value, list) else "")
                + f" for {count} requesting ShardedObjects"
            )
        return value * count if len(value) == 1 else value

    def load_tensors_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        return tensors_metadata(self.open(checkpoint_dir).layout)

    def load_sharded_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        return sharded_metadata(self.open(checkpoint_dir).layout, with_objects=self.megatron_objects)

    def describe_stored_shards(self, checkpoint_dir: Storage) -> Optional[Dict[str, List[StoredShardInfo]]]:
        """Every stored chunk: box (or flattened range of a block), file, byte count."""
        return describe_layout(self.open(checkpoint_dir).layout)

    def verify_integrity(self, checkpoint_dir: Storage) -> IntegrityReport:
        """Every item of every DCP file against the recorded crc32c; without a manifest (written
        by another tool) every item is checked as a ``torch.save`` archive (its zip CRC-32s)."""
        from dist_ckpt.backends.torch_dist.verify import verify_torch_dist

        return verify_torch_dist(checkpoint_dir, self.allow_pickle)
