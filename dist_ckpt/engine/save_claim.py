"""One save per location: the in-progress record that says which save owns a target.

Before any rank writes, rank 0 of a save creates ``save_in_progress.json`` in the target with a
create-if-absent write (``Storage.put_if_absent``: a hard link on a local disk, ``If-None-Match``
on S3), so of two saves racing for one location exactly one gets it. The record names the save
(its id, the host and process of its rank 0, the top-level entries its strategies write) and is:

* checked before the commit (`check_claim()`): the save still owns the location;
* removed after the commit (`release_claim()`);
* the proof that lets a failed save delete its own files (`abandon_claim()`), and lets a
  later save clear the files of an interrupted one -- but only when that save is provably dead:
  its rank 0 ran on this machine, in this PID namespace, and that process is gone. Anything
  else found in a target is left alone and the save refuses with
  [`SaveConflictError`][dist_ckpt.errors.SaveConflictError], saying what to remove.

Example:

```python
location = LocalStorage("ckpt/iter_10")
claim = claim_location(location, ["safetensors", "common.pt"], new_save_id())
...                                   # every rank writes
check_claim(location, claim); save_config(...); release_claim(location, claim)
```
"""

from __future__ import annotations

import fnmatch
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from dist_ckpt.engine.commit import METADATA_FILENAME
from dist_ckpt.engine.process_identity import ProcessIdentity
from dist_ckpt.errors import CheckpointExistsError, CheckpointingException, SaveConflictError
from dist_ckpt.integrity.safe_json import MAX_SMALL_JSON_BYTES, loads, want_object
from dist_ckpt.storage import ObjectExistsError, ObjectNotFoundError, Storage
from dist_ckpt.storage.files import is_temp_name

__all__ = ["IN_PROGRESS_FILENAME", "SaveClaim", "abandon_claim", "check_claim", "claim_location", "release_claim"]

logger = logging.getLogger(__name__)

IN_PROGRESS_FILENAME = "save_in_progress.json"
_TAKEOVER = "save_takeover.{}.json"
_FORMAT = "dist_ckpt.save_in_progress"


@dataclass(frozen=True)
class SaveClaim:
    """The content of ``save_in_progress.json``: who saves here, and what it writes.

    Attributes:
        save_id: the save's random id (also recorded in ``metadata.json`` at commit).
        owned: the top-level entries the save's strategies write (``safetensors``, ``common.pt``...).
        process: the process of the save's rank 0 (host, kernel boot, PID namespace, PID and
            start time: enough to prove, from the same machine, that it is gone).
        started: when the claim was made (seconds since the epoch).
    """

    save_id: str
    owned: Tuple[str, ...]
    process: ProcessIdentity = field(default_factory=ProcessIdentity.current)
    started: float = field(default_factory=time.time)

    def to_bytes(self) -> bytes:
        doc: Dict[str, Any] = {
            "format": _FORMAT,
            "version": 1,
            "save_id": self.save_id,
            "owned": list(self.owned),
            "started": self.started,
            **self.process.to_json(),
        }
        return json.dumps(doc, indent=1, sort_keys=True).encode("utf-8")

    @classmethod
    def parse(cls, raw: bytes, where: str) -> "SaveClaim":
        """The claim in ``raw`` (read from ``where``); damage raises a CheckpointingException."""
        doc = want_object(loads(raw, where, MAX_SMALL_JSON_BYTES), where)
        process = ProcessIdentity.from_json(doc)
        if doc.get("format") != _FORMAT or not isinstance(doc.get("save_id"), str) or process is None:
            raise SaveConflictError(f"{where} is not a dist_ckpt save record")
        owned = doc.get("owned")
        names = tuple(n for n in owned if isinstance(n, str)) if isinstance(owned, list) else ()
        started = doc.get("started")
        when = float(started) if isinstance(started, (int, float)) and not isinstance(started, bool) else 0.0
        return cls(doc["save_id"], names, process, when)

    def provably_dead(self) -> bool:
        """Whether this claim's save cannot be running: its rank 0 ran on this machine's current
        boot, in this PID namespace, and that process no longer exists."""
        return self.process.running() is False

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)) if self.started else "an unknown time"
        return f"save {self.save_id} (rank 0: pid {self.process.pid} on {self.process.host}, started {when})"


def _present(storage: Storage, names: Sequence[str]) -> List[str]:
    """Which of the top-level ``names`` exist (as files or as directories / prefixes); a name may
    be a glob pattern (``__*.distcp``), which stands for every top-level entry it matches."""
    dirs = set(storage.list_dirs())
    plain = {n for n in names if not _is_pattern(n)}
    found = {n for n in plain if n in dirs or storage.exists(n)}
    patterns = [n for n in names if _is_pattern(n)]
    if patterns:
        top = dirs | {o.key for o in storage.list() if "/" not in o.key}
        found |= {e for e in top if any(fnmatch.fnmatchcase(e, p) for p in patterns)}
    return sorted(found)


def _is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[")


def _delete_entries(storage: Storage, names: Sequence[str]) -> None:
    """Remove the top-level entries ``names`` (glob patterns expanded): their objects, and where
    the storage has local files, what listings hide (temporary files of interrupted atomic
    writes, empty directories; a link is removed, never followed)."""
    for name in sorted(set(_present(storage, names)) | {n for n in names if not _is_pattern(n)}):
        if storage.local_paths:
            _delete_local_entry(storage, name)
        else:
            storage.delete(name)
            storage.delete_prefix(name)


def _delete_local_entry(storage: Storage, name: str) -> None:
    """`_delete_entries()` of one entry on a storage with ``local_paths``."""
    root = storage.local_dir
    path = root / name
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    for temp in root.glob(f".{name}.tmp-*"):
        if is_temp_name(temp.name):
            temp.unlink(missing_ok=True)


def _read_claim(storage: Storage) -> Optional[SaveClaim]:
    try:
        raw = storage.read(IN_PROGRESS_FILENAME)
    except ObjectNotFoundError:
        return None
    return SaveClaim.parse(raw, storage.url_of(IN_PROGRESS_FILENAME))


def claim_location(storage: Storage, owned: Sequence[str], save_id: str) -> SaveClaim:
    """Make this save the owner of the location ``storage`` (rank 0, before anything is written).

    Steps: refuse a committed checkpoint; create the in-progress record (create-if-absent);
    if another save's record is there, take over only when that save is provably dead
    (deleting the entries it recorded), else refuse; finally refuse if entries this save would
    write exist without a record of a dist_ckpt save (they are not ours to delete).

    Raises:
        CheckpointExistsError: ``metadata.json`` is there.
        SaveConflictError: another save owns the location, or it holds entries we did not write.
    """
    storage.make_dir()  # a local checkpoint directory (durably); nothing on an object store
    where = storage.url
    if storage.exists(METADATA_FILENAME):
        raise CheckpointExistsError(
            f"{where!r} already holds a committed checkpoint ({METADATA_FILENAME}); save to a new location or "
            "delete it first"
        )
    claim = SaveClaim(save_id, tuple(sorted(set(owned))))
    try:
        try:
            storage.put_if_absent(IN_PROGRESS_FILENAME, claim.to_bytes())
        except ObjectExistsError:
            _take_over(storage, claim)
        foreign = _present(storage, claim.owned)
        if foreign:
            raise SaveConflictError(
                f"{where!r} holds {foreign}, which this save would write, but no record says dist_ckpt wrote them: "
                "they are left alone. Save to a new location, or remove them if they are not needed"
            )
    except BaseException:
        _remove_if_ours(storage, claim)  # e.g. the record was created, then its fsync failed
        raise
    return claim


def _remove_if_ours(storage: Storage, claim: SaveClaim) -> None:
    """Delete the in-progress record if it is ``claim``'s (never raises)."""
    try:
        found = _read_claim(storage)
        if found is not None and found.save_id == claim.save_id:
            storage.delete(IN_PROGRESS_FILENAME)
    except Exception as e:  # noqa: BLE001 -- the caller's error is what is reported
        logger.warning("could not remove %s of save %s: %s", IN_PROGRESS_FILENAME, claim.save_id, e)


def _take_over(storage: Storage, claim: SaveClaim) -> None:
    """Replace the record of a provably dead save by ``claim``, deleting what it wrote."""
    where = storage.url_of(IN_PROGRESS_FILENAME)
    try:
        other = _read_claim(storage)
    except CheckpointingException as e:
        raise SaveConflictError(
            f"{where} is damaged ({e}): another save may be writing into {storage.url!r}; save to a new "
            f"location, or delete that directory if no save runs there"
        ) from e
    if other is None:  # released between our attempt and this read: the other save committed or failed
        if storage.exists(METADATA_FILENAME):
            raise CheckpointExistsError(f"{storage.url!r} was committed by another save meanwhile")
        raise SaveConflictError(f"another save used {storage.url!r} meanwhile; save to a new location")
    if not other.provably_dead():
        raise SaveConflictError(
            f"{storage.url!r} is being written by {other.describe()}: two saves cannot share a location, "
            f"and this one is refused (nothing was written or deleted). Save to another location; if that save is "
            f"known to be dead (its job ended), delete {where} and the entries it lists ({list(other.owned)})"
        )
    try:
        storage.put_if_absent(_TAKEOVER.format(other.save_id), claim.to_bytes())
    except ObjectExistsError as e:
        raise SaveConflictError(
            f"another save is taking over {storage.url!r} from the interrupted {other.describe()}; "
            "save to a new location"
        ) from e
    logger.warning(
        "%s holds the files of the interrupted %s (its process is gone): deleting %s before saving",
        storage.url,
        other.describe(),
        list(other.owned),
    )
    _delete_entries(storage, other.owned)
    storage.write(IN_PROGRESS_FILENAME, claim.to_bytes())
    storage.delete(_TAKEOVER.format(other.save_id))


def check_claim(storage: Storage, claim: SaveClaim) -> None:
    """Raise [`SaveConflictError`][dist_ckpt.errors.SaveConflictError] unless ``storage`` is still owned by ``claim``
    (rank 0, right before the commit)."""
    found = _read_claim(storage)
    if found is None or found.save_id != claim.save_id:
        holder = "no save" if found is None else found.describe()
        raise SaveConflictError(
            f"{storage.url!r} is no longer owned by this save (save {claim.save_id}; the record names "
            f"{holder}): it is not committed. Save to a new location"
        )


def release_claim(storage: Storage, claim: SaveClaim) -> None:
    """Remove the in-progress record after the commit, if it is still ``claim``'s."""
    _remove_if_ours(storage, claim)


def abandon_claim(storage: Storage, claim: SaveClaim) -> None:
    """After a failed save (every rank stopped writing): delete what the save wrote and its
    record -- only if the record is still ``claim``'s (proof that these files are ours).
    Never raises: the save's own error is what the caller reports."""
    try:
        found = _read_claim(storage)
        if found is None or found.save_id != claim.save_id or storage.exists(METADATA_FILENAME):
            return
        _delete_entries(storage, claim.owned)
        storage.delete(IN_PROGRESS_FILENAME)
    except Exception as e:  # noqa: BLE001 -- cleanup must not hide the save's error
        logger.warning("could not remove the files of the failed save %s in %s: %s", claim.save_id, storage.url, e)
