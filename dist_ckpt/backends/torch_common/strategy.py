"""The common-state strategy (backend ``torch``, version 1).

Layout inside a checkpoint directory:

```text
common.pt                               rank 0's common state (torch.save)
common.unsafe.json                      keys whose values need full pickle (only if any)
objects/<key>/shard_<offset>_<shape>.pt one file per main-replica ShardedObject
objects/<key>/_key.txt                  the full key, when <key> had to be shortened

common.checksums.json                   size and crc32c of common.pt (and common.unsafe.json)
objects/checksums.json                  size and crc32c of every file under objects/
```

Loading uses ``torch.load(weights_only=True)``: a checkpoint cannot run code on load. Besides
tensors and containers it rebuilds plain standard-library data (``io.BytesIO``,
``argparse.Namespace``, dates, paths, ...: see `plain_types`). Values that need full pickle
(other classes, numpy arrays) raise [`UnsafeObjectError`][dist_ckpt.errors.UnsafeObjectError] naming the key and the
opt-ins: ``TorchCommonLoadStrategy(safe_globals=[...])`` for classes you trust, or
``TorchCommonLoadStrategy(allow_pickle=True)`` for checkpoints you trust.

The two checksum manifests (see [`dist_ckpt.integrity.checksums`][dist_ckpt.integrity.checksums]; the second is gathered
from every rank to rank 0) let a load check each file's bytes before unpickling them, and let
``dist-ckpt verify`` check them all. Checkpoints saved before they existed load unverified.

Every file goes through a [`Storage`][dist_ckpt.storage.base.Storage] (a ``LocalStorage`` of the
directory: temporary file, fsync, rename; or an object store), so this strategy works on local
disks and on S3 alike; the files are small and each is written and read whole.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import zipfile
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch

from dist_ckpt.backends.base import LoadCommonStrategy, SaveCommonStrategy
from dist_ckpt.backends.request_checks import object_layout_error
from dist_ckpt.backends.stored_shards import stored_key
from dist_ckpt.collectives.distributed import gather_json, get_rank, run_collectively
from dist_ckpt.errors import (
    UNEXPECTED_KEYS,
    CheckpointingException,
    CorruptCheckpointError,
    KeyMismatchError,
    UnsafeObjectError,
    format_keys,
)
from dist_ckpt.integrity.checksums import (
    FileDigest,
    IntegrityReport,
    bytes_digest,
    check_file,
    file_problem,
    manifest_bytes,
    parse_manifest_bytes,
)
from dist_ckpt.integrity.safe_json import MAX_SMALL_JSON_BYTES, loads
from dist_ckpt.model.dict_utils import dict_list_map_inplace, nested_values
from dist_ckpt.model.plain_types import plain_data_allowed
from dist_ckpt.model.sharded import ShardedObject, ShardedStateDict, StateDict, is_main_replica
from dist_ckpt.record.records import read_recorded
from dist_ckpt.storage import ObjectNotFoundError, Storage, decode_key, encode_key, is_shortened
from dist_ckpt.storage.location import LocationLike, resolve_location

logger = logging.getLogger(__name__)

COMMON_STATE_FNAME = "common.pt"
UNSAFE_KEYS_FNAME = "common.unsafe.json"
OBJECTS_DIR = "objects"
KEY_FNAME = "_key.txt"
COMMON_CHECKSUMS_FNAME = "common.checksums.json"
OBJECTS_CHECKSUMS_FNAME = "checksums.json"  # inside objects/
_SAFE_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_OPT_IN = "common_strategy=TorchCommonLoadStrategy(allow_pickle=True)"
_SAFE_GLOBALS_OPT_IN = "common_strategy=TorchCommonLoadStrategy(safe_globals=[...])"


def _needs_pickle(value: Any) -> Optional[str]:
    """Type name of ``value`` if the loader (``weights_only`` with the plain-data types of
    `plain_types`) cannot restore it, else None."""
    if type(value) in _SAFE_LEAF_TYPES or type(value) in (torch.Tensor, torch.nn.Parameter):
        return None
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    try:
        with plain_data_allowed():
            torch.load(buf, weights_only=True)
    except Exception:  # noqa: BLE001 -- any failure means weights_only cannot load it
        return f"{type(value).__module__}.{type(value).__qualname__}"
    return None


def find_unsafe_values(state: Any, prefix: Tuple[Any, ...] = ()) -> Dict[str, str]:
    """``{"a/b/0": type_name}`` for every leaf of ``state`` that needs full pickle."""
    found: Dict[str, str] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            found.update(find_unsafe_values(v, prefix + (k,)))
    elif isinstance(state, list):
        for i, v in enumerate(state):
            found.update(find_unsafe_values(v, prefix + (i,)))
    else:
        type_name = _needs_pickle(state)
        if type_name is not None:
            found["/".join(map(str, prefix)) or "<root>"] = type_name
    return found


def _object_key(sh_obj: ShardedObject) -> str:
    """The object (file) of a ShardedObject, relative to the checkpoint: ``objects/<key>/<shard>.pt``."""
    shard_name = sh_obj.unique_key.rpartition("/")[2]
    return f"{OBJECTS_DIR}/{encode_key(sh_obj.key)}/{shard_name}.pt"


def _torch_bytes(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _read_manifest(storage: Storage, key: str) -> Optional[Dict[str, FileDigest]]:
    """The manifest at ``key``, or None when the save wrote none (checked against the integrity
    records of ``metadata.json``: a recorded manifest that is gone or changed raises)."""
    raw = read_recorded(storage, key)
    return None if raw is None else parse_manifest_bytes(raw, storage.url_of(key))


class TorchCommonSaveStrategy(SaveCommonStrategy):
    """Saves the common state (rank 0) and ShardedObjects with ``torch.save``, atomically, and
    the checksum manifests of both; on local disks and object stores.

    Args:
        checksums: write the manifests (``common.checksums.json``, ``objects/checksums.json``).
    """

    owned_paths: ClassVar[Tuple[str, ...]] = (
        COMMON_STATE_FNAME,
        UNSAFE_KEYS_FNAME,
        COMMON_CHECKSUMS_FNAME,
        OBJECTS_DIR,
    )
    object_storage: ClassVar[bool] = True
    integrity_records: ClassVar[Tuple[str, ...]] = (COMMON_CHECKSUMS_FNAME, f"{OBJECTS_DIR}/{OBJECTS_CHECKSUMS_FNAME}")
    #: a ShardedObject keyed ``checksums.json`` would be a directory where the manifest lives
    reserved_names: ClassVar[Tuple[str, ...]] = (OBJECTS_CHECKSUMS_FNAME,)

    def __init__(self, backend: str = "torch", version: int = 1, checksums: bool = True) -> None:
        super().__init__(backend, version)
        self.checksums = checksums

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Storage) -> None:
        if get_rank() != 0:
            return
        storage = resolve_location(checkpoint_dir)
        written: Dict[str, FileDigest] = {}
        unsafe = find_unsafe_values(common_state_dict)
        if unsafe:
            logger.warning(
                "common state keys %s hold objects that need full pickle to load (%s); loading this "
                "checkpoint will need %s (classes that only hold data) or %s",
                format_keys(unsafe),
                ", ".join(sorted(set(unsafe.values()))),
                _SAFE_GLOBALS_OPT_IN,
                _OPT_IN,
            )
            data = json.dumps(unsafe, indent=1).encode()
            storage.write(UNSAFE_KEYS_FNAME, data)
            written[UNSAFE_KEYS_FNAME] = bytes_digest(data)
        data = _torch_bytes(common_state_dict)
        storage.write(COMMON_STATE_FNAME, data)
        written[COMMON_STATE_FNAME] = bytes_digest(data)
        if self.checksums:
            storage.write(COMMON_CHECKSUMS_FNAME, manifest_bytes(written))

    def save_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> None:
        """Save this rank's main-replica ShardedObjects; then (collective) rank 0 writes the
        manifest of every rank's object files."""
        storage = resolve_location(checkpoint_dir)
        prefix = f"{OBJECTS_DIR}/"

        def write() -> Dict[str, Any]:
            written: Dict[str, Any] = {}
            for sh_obj in nested_values(sharded_objects_state_dict):
                if not isinstance(sh_obj, ShardedObject) or not is_main_replica(sh_obj.replica_id):
                    continue
                key = _object_key(sh_obj)
                files: Dict[str, bytes] = {}
                directory = key.rpartition("/")[0]
                if is_shortened(directory.rpartition("/")[2]):
                    files[f"{directory}/{KEY_FNAME}"] = sh_obj.key.encode("utf-8")
                files[key] = _torch_bytes(sh_obj.data)
                for name, data in files.items():
                    storage.write(name, data)
                    if self.checksums:
                        written[name[len(prefix) :]] = bytes_digest(data).to_json()
            return written

        local = run_collectively("saving ShardedObjects", write)
        if not self.checksums:
            return
        gathered = gather_json(local)

        def write_manifest_on_rank0() -> None:
            if get_rank() != 0:
                return
            assert gathered is not None
            files = {n: FileDigest(e["size"], int(e["crc32c"], 16)) for part in gathered for n, e in part.items()}
            if files:
                storage.write(f"{OBJECTS_DIR}/{OBJECTS_CHECKSUMS_FNAME}", manifest_bytes(files))

        run_collectively("writing objects/checksums.json", write_manifest_on_rank0)


class TorchCommonLoadStrategy(LoadCommonStrategy):
    """Loads what `TorchCommonSaveStrategy` wrote, without executing pickled code.

    Tensors, containers and plain standard-library data (`plain_types.PLAIN_DATA_TYPES`:
    ``io.BytesIO``, ``argparse.Namespace``, dates, paths, ...) load by default; their
    reconstruction runs no code from the file.

    Args:
        allow_pickle: load values that need full pickle (runs code from the checkpoint: only
            for checkpoints you trust).
        verify_checksums: check each file against its manifest before unpickling it (when the
            checkpoint has manifests).
        safe_globals: further classes (or functions) to rebuild without full pickle, e.g. your
            own ``Enum`` types; allowed for this strategy's loads only (torch's
            ``add_safe_globals`` allows them process-wide, and is honoured too).

    Example:

    ```python
    dc.load(sd, "ckpt", common_strategy=TorchCommonLoadStrategy(safe_globals=[AttnBackend]))
    ```
    """

    supported_backends: ClassVar[Tuple[str, ...]] = ("torch",)
    supported_versions: ClassVar[Tuple[int, ...]] = (1,)
    object_storage: ClassVar[bool] = True

    def __init__(
        self, allow_pickle: bool = False, verify_checksums: bool = True, safe_globals: Sequence[Any] = ()
    ) -> None:
        self.allow_pickle = allow_pickle
        self.verify_checksums = verify_checksums
        self.safe_globals = tuple(safe_globals)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def _manifest(self, storage: Storage, key: str) -> Dict[str, FileDigest]:
        """The manifest at ``key`` if checksums are to be verified and it exists, else {}."""
        return (_read_manifest(storage, key) or {}) if self.verify_checksums else {}

    def _load(
        self, storage: Storage, key: str, what: str, keys_hint: str, expected: Optional[FileDigest] = None
    ) -> Any:
        where = storage.url_of(key)
        try:
            data = storage.read(key)
        except ObjectNotFoundError as e:
            raise CorruptCheckpointError(f"{where} is missing ({what})") from e
        if expected is not None:
            check_file(where, expected, what, data)
        try:
            with plain_data_allowed(self.safe_globals):
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=not self.allow_pickle)
        except pickle.UnpicklingError as e:
            unsafe = self._unsafe_globals(data)
            if unsafe:
                raise UnsafeObjectError(
                    f"{what} in {where} needs full pickle to load ({', '.join(sorted(unsafe))}){keys_hint}. "
                    f"Loading it would run code from the checkpoint. If these classes only hold data, "
                    f"allow them with {_SAFE_GLOBALS_OPT_IN}; if you trust the checkpoint, pass {_OPT_IN}"
                ) from e
            raise CorruptCheckpointError(f"{where} cannot be unpickled ({what}): {e}") from e
        except Exception as e:  # noqa: BLE001 -- torch.load fails in many ways on damaged bytes
            # (RuntimeError, EOFError, BadZipFile, IndexError, KeyError, ... depending on where)
            raise CorruptCheckpointError(f"{where} is truncated or corrupt ({what}): {type(e).__name__}: {e}") from e

    def _unsafe_globals(self, data: bytes) -> List[str]:
        try:
            with plain_data_allowed(self.safe_globals):
                return list(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
        except Exception:  # noqa: BLE001 -- a corrupt file is reported by the caller
            return []

    def load_common(self, checkpoint_dir: Storage) -> StateDict:
        storage = resolve_location(checkpoint_dir)
        hint = ""
        try:
            unsafe = loads(storage.read(UNSAFE_KEYS_FNAME), storage.url_of(UNSAFE_KEYS_FNAME), MAX_SMALL_JSON_BYTES)
            hint = f" at keys {format_keys(map(str, unsafe))}" if isinstance(unsafe, (dict, list)) else ""
        except (OSError, CheckpointingException):  # only a hint for the error message below
            hint = ""
        expected = self._manifest(storage, COMMON_CHECKSUMS_FNAME).get(COMMON_STATE_FNAME)
        state = self._load(storage, COMMON_STATE_FNAME, "the common state", hint, expected)
        if not isinstance(state, dict):
            raise CorruptCheckpointError(
                f"{storage.url_of(COMMON_STATE_FNAME)} holds a {type(state).__name__}, expected a dict"
            )
        return state

    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> StateDict:
        storage = resolve_location(checkpoint_dir)
        requested = [o for o in nested_values(sharded_objects_state_dict) if isinstance(o, ShardedObject)]
        stored = {o.key for o in storage.list(OBJECTS_DIR)} if requested else set()
        manifest = self._manifest(storage, f"{OBJECTS_DIR}/{OBJECTS_CHECKSUMS_FNAME}") if requested else {}
        # a key was saved if any of its files is stored or listed in the manifest (or its
        # directory exists, empty): then a missing shard is damage, not a key mismatch
        saved = {k.rpartition("/")[0] for k in stored} | {f"{OBJECTS_DIR}/{n.rpartition('/')[0]}" for n in manifest}

        def was_saved(directory: str) -> bool:
            return directory in saved or storage.dir_exists(directory)

        absent = sorted({o.key for o in requested if not was_saved(f"{OBJECTS_DIR}/{encode_key(o.key)}")})
        if absent:
            raise KeyMismatchError(
                f"[rank {get_rank()}] {UNEXPECTED_KEYS} (ShardedObjects requested by load but absent from checkpoint "
                f"{storage.url!r}): {format_keys(absent)}",
                unexpected_keys=absent,
            )

        def load_one(x: Any) -> Any:
            if not isinstance(x, ShardedObject):
                return x
            key = _object_key(x)
            if key not in stored:
                directory = key.rpartition("/")[0]
                shards = sorted(
                    k[len(directory) + 1 : -3]
                    for k in stored
                    if k.startswith(f"{directory}/shard_") and k.endswith(".pt")
                )
                layout_error = object_layout_error(x, shards, repr(storage.url))
                if layout_error is not None:  # saved at another layout: not damage
                    raise layout_error
                raise CorruptCheckpointError(
                    f"[rank {get_rank()}] shard {x.unique_key!r} of ShardedObject {x.key!r} is missing: no file "
                    f"{storage.url_of(key)!r}; stored shards: {shards}"
                )
            expected = manifest.get(key[len(OBJECTS_DIR) + 1 :])
            return self._load(storage, key, f"ShardedObject {x.unique_key!r}", f" (key {x.key!r})", expected)

        return dict_list_map_inplace(load_one, sharded_objects_state_dict)  # type: ignore[no-any-return]

    def load_sharded_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        storage = resolve_location(checkpoint_dir)
        found: ShardedStateDict = {}
        by_dir: Dict[str, List[str]] = {}
        for info in storage.list(OBJECTS_DIR):
            parts = info.key.split("/")
            if len(parts) == 3:
                by_dir.setdefault(parts[1], []).append(parts[2])
        for dir_name in sorted(by_dir):
            key = decode_key(dir_name)
            where = storage.url_of(f"{OBJECTS_DIR}/{dir_name}")
            if key is None:
                raw = storage.read(f"{OBJECTS_DIR}/{dir_name}/{KEY_FNAME}")
                where = storage.url_of(f"{OBJECTS_DIR}/{dir_name}/{KEY_FNAME}")
                try:
                    key = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise CorruptCheckpointError(f"{where} is not UTF-8 text: it is damaged") from e
            stored_key(key, where)
            for name in sorted(by_dir[dir_name]):
                if name.startswith("shard_") and name.endswith(".pt"):
                    sh_obj = ShardedObject.empty_from_unique_key(f"{key}/{name[:-3]}")
                    found[sh_obj.unique_key] = sh_obj
        return found

    def verify_integrity(self, checkpoint_dir: Storage) -> IntegrityReport:
        """Check ``common.pt`` and every ShardedObject file against the manifests; without
        manifests (older checkpoints), check that each file is a readable zip archive whose
        members have their CRC-32 (torch.save writes zip archives)."""
        return verify_common(checkpoint_dir)


def verify_common(checkpoint_dir: LocationLike) -> IntegrityReport:
    """The integrity report of the common part of a checkpoint (never raises for damage).

    Example:

    ```python
    for problem in verify_common("ckpt/iter_1000").problems: print(problem)
    ```
    """
    storage = resolve_location(checkpoint_dir)
    report = IntegrityReport()
    object_files = sorted(o.key for o in storage.list(OBJECTS_DIR) if o.key.endswith(".pt"))
    for manifest_name, base, expected_files in (
        (COMMON_CHECKSUMS_FNAME, "", [COMMON_STATE_FNAME]),
        (f"{OBJECTS_DIR}/{OBJECTS_CHECKSUMS_FNAME}", f"{OBJECTS_DIR}/", object_files),
    ):
        try:
            manifest = _read_manifest(storage, manifest_name)
        except CheckpointingException as e:
            report.add(manifest_name, str(e))
            continue
        if manifest is None:
            if expected_files:
                report.notes.append(
                    f"{manifest_name} is absent (saved without checksums): files were checked as zip archives"
                )
            for key in expected_files:
                _check_zip(storage, key, report)
            continue
        report.files_checked += 1
        listed = {base + name for name in manifest}
        for key in expected_files:
            if key not in listed:
                report.add(key, f"not listed in {manifest_name} (written after the save?)")
        for name, digest in sorted(manifest.items()):
            key = base + name
            report.files_checked += 1
            report.bytes_checked += digest.size
            try:
                data = storage.read(key)
            except ObjectNotFoundError:
                report.add(key, "missing")
                continue
            except CheckpointingException as e:  # e.g. a link out of the checkpoint
                report.add(key, str(e))
                continue
            found = file_problem(storage.url_of(key), digest, data)
            if found is not None:
                report.add(key, found[0])
    return report


def _check_zip(storage: Storage, key: str, report: IntegrityReport) -> None:
    report.files_checked += 1
    try:
        data = storage.read(key)
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            bad = archive.testzip()
        report.bytes_checked += len(data)
    except ObjectNotFoundError:
        report.add(key, "missing")
        return
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        report.add(key, f"not a readable torch.save archive: {e}")
        return
    if bad is not None:
        report.add(key, f"member {bad!r} fails its CRC-32 check (the file is corrupt)")
