"""The common-state strategy (backend ``torch``, version 1).

Layout inside a checkpoint directory::

    common.pt                               rank 0's common state (torch.save)
    common.unsafe.json                      keys whose values need full pickle (only if any)
    objects/<key>/shard_<offset>_<shape>.pt one file per main-replica ShardedObject
    objects/<key>/_key.txt                  the full key, when <key> had to be shortened

    common.checksums.json                   size and crc32c of common.pt (and common.unsafe.json)
    objects/checksums.json                  size and crc32c of every file under objects/

Loading uses ``torch.load(weights_only=True)``: a checkpoint cannot run code on load. Values that
need full pickle (arbitrary classes, numpy arrays) raise :class:`UnsafeObjectError` naming the key
and the opt-in, ``TorchCommonLoadStrategy(allow_pickle=True)``, for checkpoints you trust.

The two checksum manifests (see :mod:`dist_ckpt.checksums`; the second is gathered from every
rank to rank 0) let a load check each file's bytes before unpickling them, and let
``dist-ckpt verify`` check them all. Checkpoints saved before they existed load unverified.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import zipfile
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch

from ..checksums import (
    FileDigest,
    IntegrityReport,
    check_file,
    file_digest,
    file_problem,
    read_manifest,
    relative,
    write_manifest,
)
from ..dict_utils import dict_list_map_inplace, nested_values
from ..distributed import gather_json, get_rank, run_collectively
from ..errors import CheckpointingException, CorruptCheckpointError, KeyMismatchError, UnsafeObjectError, format_keys
from ..mapping import ShardedObject, ShardedStateDict, StateDict, is_main_replica
from ..storage import atomic_write, decode_key, encode_key, is_shortened, write_bytes_atomic
from .base import LoadCommonStrategy, SaveCommonStrategy

logger = logging.getLogger(__name__)

COMMON_STATE_FNAME = "common.pt"
UNSAFE_KEYS_FNAME = "common.unsafe.json"
OBJECTS_DIR = "objects"
KEY_FNAME = "_key.txt"
COMMON_CHECKSUMS_FNAME = "common.checksums.json"
OBJECTS_CHECKSUMS_FNAME = "checksums.json"  # inside objects/
_SAFE_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_OPT_IN = "common_strategy=TorchCommonLoadStrategy(allow_pickle=True)"


def _needs_pickle(value: Any) -> Optional[str]:
    """Type name of ``value`` if ``torch.load(weights_only=True)`` cannot restore it, else None."""
    if type(value) in _SAFE_LEAF_TYPES or type(value) in (torch.Tensor, torch.nn.Parameter):
        return None
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    try:
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


def _object_path(checkpoint_dir: Path, sh_obj: ShardedObject) -> Path:
    shard_name = sh_obj.unique_key.rpartition("/")[2]
    return checkpoint_dir / OBJECTS_DIR / encode_key(sh_obj.key) / f"{shard_name}.pt"


class TorchCommonSaveStrategy(SaveCommonStrategy):
    """Saves the common state (rank 0) and ShardedObjects with ``torch.save``, atomically, and
    the checksum manifests of both.

    Args:
        checksums: write the manifests (``common.checksums.json``, ``objects/checksums.json``).
    """

    owned_paths: ClassVar[Tuple[str, ...]] = (COMMON_STATE_FNAME, UNSAFE_KEYS_FNAME, COMMON_CHECKSUMS_FNAME, OBJECTS_DIR)

    def __init__(self, backend: str = "torch", version: int = 1, checksums: bool = True) -> None:
        super().__init__(backend, version)
        self.checksums = checksums

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Path) -> None:
        if get_rank() != 0:
            return
        checkpoint_dir = Path(checkpoint_dir)
        unsafe = find_unsafe_values(common_state_dict)
        if unsafe:
            logger.warning(
                "common state keys %s hold objects that need full pickle to load (%s); loading this "
                "checkpoint will need %s",
                format_keys(unsafe),
                ", ".join(sorted(set(unsafe.values()))),
                _OPT_IN,
            )
            write_bytes_atomic(checkpoint_dir / UNSAFE_KEYS_FNAME, json.dumps(unsafe, indent=1).encode())
        with atomic_write(checkpoint_dir / COMMON_STATE_FNAME) as f:
            torch.save(common_state_dict, f)
        if self.checksums:
            written = [COMMON_STATE_FNAME] + ([UNSAFE_KEYS_FNAME] if unsafe else [])
            write_manifest(checkpoint_dir / COMMON_CHECKSUMS_FNAME, {n: file_digest(checkpoint_dir / n) for n in written})

    def save_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        """Save this rank's main-replica ShardedObjects; then (collective) rank 0 writes the
        manifest of every rank's object files."""
        root = Path(checkpoint_dir) / OBJECTS_DIR

        def write() -> Dict[str, Any]:
            written: Dict[str, Any] = {}
            for sh_obj in nested_values(sharded_objects_state_dict):
                if not isinstance(sh_obj, ShardedObject) or not is_main_replica(sh_obj.replica_id):
                    continue
                path = _object_path(Path(checkpoint_dir), sh_obj)
                path.parent.mkdir(parents=True, exist_ok=True)
                files = [path]
                if is_shortened(path.parent.name):
                    write_bytes_atomic(path.parent / KEY_FNAME, sh_obj.key.encode("utf-8"))
                    files.append(path.parent / KEY_FNAME)
                with atomic_write(path) as f:
                    torch.save(sh_obj.data, f)
                if self.checksums:
                    written.update({relative(p, root): file_digest(p).to_json() for p in files})
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
                write_manifest(root / OBJECTS_CHECKSUMS_FNAME, files)

        run_collectively("writing objects/checksums.json", write_manifest_on_rank0)


class TorchCommonLoadStrategy(LoadCommonStrategy):
    """Loads what :class:`TorchCommonSaveStrategy` wrote, without executing pickled code.

    Args:
        allow_pickle: load values that need full pickle (runs code from the checkpoint: only
            for checkpoints you trust).
        verify_checksums: check each file against its manifest before unpickling it (when the
            checkpoint has manifests).
    """

    supported_backends: ClassVar[Tuple[str, ...]] = ("torch",)
    supported_versions: ClassVar[Tuple[int, ...]] = (1,)

    def __init__(self, allow_pickle: bool = False, verify_checksums: bool = True) -> None:
        self.allow_pickle = allow_pickle
        self.verify_checksums = verify_checksums

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def _manifest(self, path: Path) -> Dict[str, FileDigest]:
        """The manifest at ``path`` if checksums are to be verified and it exists, else {}."""
        return (read_manifest(path) or {}) if self.verify_checksums else {}

    def _load(self, path: Path, what: str, keys_hint: str, expected: Optional[FileDigest] = None) -> Any:
        try:
            source: Any = path
            if expected is not None:
                data = path.read_bytes()
                check_file(path, expected, what, data)
                source = io.BytesIO(data)
            return torch.load(source, map_location="cpu", weights_only=not self.allow_pickle)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"{path} is missing ({what})") from e
        except pickle.UnpicklingError as e:
            unsafe = self._unsafe_globals(path)
            if unsafe:
                raise UnsafeObjectError(
                    f"{what} in {path} needs full pickle to load ({', '.join(unsafe)}){keys_hint}. "
                    f"Loading it would run code from the checkpoint; if you trust it, pass {_OPT_IN}"
                ) from e
            raise CorruptCheckpointError(f"{path} cannot be unpickled ({what}): {e}") from e
        except Exception as e:  # noqa: BLE001 -- torch.load fails in many ways on damaged bytes
            # (RuntimeError, EOFError, BadZipFile, IndexError, KeyError, ... depending on where)
            raise CorruptCheckpointError(f"{path} is truncated or corrupt ({what}): {type(e).__name__}: {e}") from e

    @staticmethod
    def _unsafe_globals(path: Path) -> List[str]:
        try:
            return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        except Exception:  # noqa: BLE001 -- a corrupt file is reported by the caller
            return []

    def load_common(self, checkpoint_dir: Path) -> StateDict:
        checkpoint_dir = Path(checkpoint_dir)
        hint = ""
        unsafe_file = checkpoint_dir / UNSAFE_KEYS_FNAME
        if unsafe_file.is_file():
            try:
                hint = f" at keys {format_keys(json.loads(unsafe_file.read_text()))}"
            except (ValueError, OSError):
                hint = ""
        expected = self._manifest(checkpoint_dir / COMMON_CHECKSUMS_FNAME).get(COMMON_STATE_FNAME)
        state = self._load(checkpoint_dir / COMMON_STATE_FNAME, "the common state", hint, expected)
        if not isinstance(state, dict):
            raise CorruptCheckpointError(
                f"{checkpoint_dir / COMMON_STATE_FNAME} holds a {type(state).__name__}, expected a dict"
            )
        return state

    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        checkpoint_dir = Path(checkpoint_dir)
        requested = [o for o in nested_values(sharded_objects_state_dict) if isinstance(o, ShardedObject)]
        absent = sorted({o.key for o in requested if not (checkpoint_dir / OBJECTS_DIR / encode_key(o.key)).is_dir()})
        if absent:
            raise KeyMismatchError(
                f"[rank {get_rank()}] ShardedObjects requested by load but absent from checkpoint "
                f"{str(checkpoint_dir)!r}: {format_keys(absent)}",
                unexpected_keys=absent,
            )

        manifest = self._manifest(checkpoint_dir / OBJECTS_DIR / OBJECTS_CHECKSUMS_FNAME) if requested else {}

        def load_one(x: Any) -> Any:
            if not isinstance(x, ShardedObject):
                return x
            path = _object_path(checkpoint_dir, x)
            if not path.is_file():
                stored = sorted(p.stem for p in path.parent.glob("shard_*.pt"))
                raise CorruptCheckpointError(
                    f"[rank {get_rank()}] shard {x.unique_key!r} of ShardedObject {x.key!r} is missing: no file "
                    f"{str(path)!r}; stored shards: {stored}"
                )
            expected = manifest.get(relative(path, checkpoint_dir / OBJECTS_DIR))
            return self._load(path, f"ShardedObject {x.unique_key!r}", f" (key {x.key!r})", expected)

        return dict_list_map_inplace(load_one, sharded_objects_state_dict)  # type: ignore[no-any-return]

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        root = Path(checkpoint_dir) / OBJECTS_DIR
        found: ShardedStateDict = {}
        if not root.is_dir():
            return found
        for key_dir in sorted(p for p in root.iterdir() if p.is_dir()):
            key = decode_key(key_dir.name)
            if key is None:
                key = (key_dir / KEY_FNAME).read_text(encoding="utf-8")
            for shard in sorted(key_dir.glob("shard_*.pt")):
                sh_obj = ShardedObject.empty_from_unique_key(f"{key}/{shard.stem}")
                found[sh_obj.unique_key] = sh_obj
        return found

    def verify_integrity(self, checkpoint_dir: Path) -> IntegrityReport:
        """Check ``common.pt`` and every ShardedObject file against the manifests; without
        manifests (older checkpoints), check that each file is a readable zip archive whose
        members have their CRC-32 (torch.save writes zip archives)."""
        return verify_common(Path(checkpoint_dir))


def verify_common(checkpoint_dir: Path) -> IntegrityReport:
    """The integrity report of the common part of a checkpoint (never raises for damage).

    Example::

        for problem in verify_common(Path("ckpt/iter_1000")).problems: print(problem)
    """
    report = IntegrityReport()
    for manifest_name, base, expected_files in (
        (COMMON_CHECKSUMS_FNAME, checkpoint_dir, [checkpoint_dir / COMMON_STATE_FNAME]),
        (f"{OBJECTS_DIR}/{OBJECTS_CHECKSUMS_FNAME}", checkpoint_dir / OBJECTS_DIR, sorted((checkpoint_dir / OBJECTS_DIR).rglob("*.pt"))),
    ):
        try:
            manifest = read_manifest(checkpoint_dir / manifest_name)
        except CheckpointingException as e:
            report.add(manifest_name, str(e))
            continue
        if manifest is None:
            if expected_files:
                report.notes.append(f"{manifest_name} is absent (saved without checksums): files were checked as zip archives")
            for path in expected_files:
                _check_zip(path, checkpoint_dir, report)
            continue
        report.files_checked += 1
        listed = {base / name for name in manifest}
        for path in expected_files:
            if path not in listed:
                report.add(relative(path, checkpoint_dir), f"not listed in {manifest_name} (written after the save?)")
        for name, digest in sorted(manifest.items()):
            path = base / name
            report.files_checked += 1
            report.bytes_checked += digest.size
            found = file_problem(path, digest)
            if found is not None:
                report.add(relative(path, checkpoint_dir), found[0])
    return report


def _check_zip(path: Path, checkpoint_dir: Path, report: IntegrityReport) -> None:
    rel = relative(path, checkpoint_dir)
    report.files_checked += 1
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
        report.bytes_checked += path.stat().st_size
    except FileNotFoundError:
        report.add(rel, "missing")
        return
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        report.add(rel, f"not a readable torch.save archive: {e}")
        return
    if bad is not None:
        report.add(rel, f"member {bad!r} fails its CRC-32 check (the file is corrupt)")
