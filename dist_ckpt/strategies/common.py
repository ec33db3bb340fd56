"""The common-state strategy (backend ``torch``, version 1).

Layout inside a checkpoint directory::

    common.pt                               rank 0's common state (torch.save)
    common.unsafe.json                      keys whose values need full pickle (only if any)
    objects/<key>/shard_<offset>_<shape>.pt one file per main-replica ShardedObject
    objects/<key>/_key.txt                  the full key, when <key> had to be shortened

Loading uses ``torch.load(weights_only=True)``: a checkpoint cannot run code on load. Values that
need full pickle (arbitrary classes, numpy arrays) raise :class:`UnsafeObjectError` naming the key
and the opt-in, ``TorchCommonLoadStrategy(allow_pickle=True)``, for checkpoints you trust.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch

from ..dict_utils import dict_list_map_inplace, nested_values
from ..distributed import get_rank
from ..errors import CorruptCheckpointError, KeyMismatchError, UnsafeObjectError, format_keys
from ..mapping import ShardedObject, ShardedStateDict, StateDict, is_main_replica
from ..storage import atomic_write, decode_key, encode_key, is_shortened, write_bytes_atomic
from .base import LoadCommonStrategy, SaveCommonStrategy

logger = logging.getLogger(__name__)

COMMON_STATE_FNAME = "common.pt"
UNSAFE_KEYS_FNAME = "common.unsafe.json"
OBJECTS_DIR = "objects"
KEY_FNAME = "_key.txt"
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
    """Saves the common state (rank 0) and ShardedObjects with ``torch.save``, atomically."""

    owned_paths: ClassVar[Tuple[str, ...]] = (COMMON_STATE_FNAME, UNSAFE_KEYS_FNAME, OBJECTS_DIR)

    def __init__(self, backend: str = "torch", version: int = 1) -> None:
        super().__init__(backend, version)

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

    def save_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        for sh_obj in nested_values(sharded_objects_state_dict):
            if not isinstance(sh_obj, ShardedObject) or not is_main_replica(sh_obj.replica_id):
                continue
            path = _object_path(Path(checkpoint_dir), sh_obj)
            path.parent.mkdir(parents=True, exist_ok=True)
            if is_shortened(path.parent.name):
                write_bytes_atomic(path.parent / KEY_FNAME, sh_obj.key.encode("utf-8"))
            with atomic_write(path) as f:
                torch.save(sh_obj.data, f)


class TorchCommonLoadStrategy(LoadCommonStrategy):
    """Loads what :class:`TorchCommonSaveStrategy` wrote, without executing pickled code.

    Args:
        allow_pickle: load values that need full pickle (runs code from the checkpoint: only
            for checkpoints you trust).
    """

    supported_backends: ClassVar[Tuple[str, ...]] = ("torch",)
    supported_versions: ClassVar[Tuple[int, ...]] = (1,)

    def __init__(self, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def _load(self, path: Path, what: str, keys_hint: str) -> Any:
        try:
            return torch.load(path, map_location="cpu", weights_only=not self.allow_pickle)
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
        state = self._load(checkpoint_dir / COMMON_STATE_FNAME, "the common state", hint)
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

        def load_one(x: Any) -> Any:
            if not isinstance(x, ShardedObject):
                return x
            path = _object_path(checkpoint_dir, x)
            if not path.is_file():
                stored = sorted(p.stem for p in path.parent.glob("shard_*.pt"))
                raise CorruptCheckpointError(
                    f"[rank {get_rank()}] shard {x.unique_key!r} of ShardedObject {x.key!r} is missing "
                    f"from {str(path.parent)!r}; stored shards: {stored}"
                )
            return self._load(path, f"ShardedObject {x.unique_key!r}", f" (key {x.key!r})")

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
