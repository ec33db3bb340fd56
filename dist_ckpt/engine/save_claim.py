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

A record is a file anyone can edit, so a taking-over save trusts only its own strategies: of the
entries the interrupted save's record lists, it deletes exact top-level names that its own
strategies write (or, for a pattern its strategies declare, such as torch_dist's ``__*.distcp``,
the plain files it matches) and refuses, before deleting anything, a record that lists any other
entry present there, a glob, a path or a link. A save taking over leaves
``save_takeover.<id>.json`` while it deletes (so that of two saves taking over one dead save,
one does); if it dies there, that record is recovered like a claim: its process is provably gone.

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
import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from dist_ckpt.collectives.process_identity import ProcessIdentity
from dist_ckpt.errors import CheckpointExistsError, CheckpointingException, SaveConflictError
from dist_ckpt.integrity.safe_json import MAX_SMALL_JSON_BYTES, loads, want_object
from dist_ckpt.record.commit import METADATA_FILENAME
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
        owned: the top-level entries the save's strategies write (``safetensors``, ``common.pt``...;
            a pattern a strategy declares, such as ``__*.distcp``). Read from a record, it is
            trusted only as far as the reading save's own strategies write the same names.
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
        found |= {e for e in _top_level(storage) if any(fnmatch.fnmatchcase(e, p) for p in patterns)}
    return sorted(found)


def _is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[")


def _top_level(storage: Storage) -> Set[str]:
    """The names of the entries directly in ``storage`` (files and directories; on a local disk
    links too, never followed), without the temporary files of atomic writes."""
    if storage.local_paths:
        return {n for n in os.listdir(storage.local_dir) if not is_temp_name(n)}
    return set(storage.list_dirs()) | {o.key for o in storage.list() if "/" not in o.key}


def _is_plain_name(name: str) -> bool:
    """Whether ``name`` is one exact top-level entry: no glob, separator, ``.`` or ``..``."""
    return bool(name) and name not in (".", "..") and not _is_pattern(name) and not any(c in name for c in "/\\\0")


def _entry_kind(storage: Storage, name: str) -> Optional[str]:
    """``"file"``, ``"dir"`` or ``"link"`` (local disks only; not followed) for the top-level
    entry ``name`` (a plain name), None if there is none."""
    if storage.local_paths:
        try:
            mode = os.lstat(storage.local_dir / name).st_mode
        except FileNotFoundError:
            return None
        return "link" if stat.S_ISLNK(mode) else "dir" if stat.S_ISDIR(mode) else "file"
    if storage.exists(name):
        return "file"
    return "dir" if name in storage.list_dirs() else None


def _deletable_entries(storage: Storage, other: SaveClaim, allowed: Sequence[str]) -> List[str]:
    """The top-level entries of the interrupted save ``other`` that this save, whose strategies
    write ``allowed``, may delete: the names its record lists that are exact names in
    ``allowed`` (not links), and the plain files matching a pattern of ``allowed`` that the record
    lists as it is. A listed name this save does not write and that is absent is ignored
    (nothing to delete).

    Raises:
        SaveConflictError: the record lists anything else (a glob, a path, ``..``, a link, an
            entry this save does not write, a non-file matching a pattern); nothing was deleted.
    """
    patterns = {n for n in allowed if _is_pattern(n)}
    entries: Set[str] = set()
    refused: List[str] = []
    for name in other.owned:
        if name in patterns:
            matches = sorted(e for e in _top_level(storage) if fnmatch.fnmatchcase(e, name))
            entries.update(m for m in matches if _entry_kind(storage, m) == "file")
            refused += [m for m in matches if m not in entries]
        elif not _is_plain_name(name):
            refused.append(name)
        else:
            kind = _entry_kind(storage, name)
            if kind is not None and (kind == "link" or name not in allowed):
                refused.append(name)
            elif kind is not None:
                entries.add(name)
    if refused:
        raise SaveConflictError(
            f"{storage.url!r}: the record of the interrupted {other.describe()} lists {refused}, which are not "
            f"entries this save writes (exact names or their plain files: {sorted(allowed)}), so no record says "
            f"dist_ckpt wrote them: they are left alone and nothing was deleted. Save to a new location, or remove "
            f"{storage.url_of(IN_PROGRESS_FILENAME)} and those entries if they are not needed"
        )
    return sorted(entries)


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


def claim_location(
    storage: Storage, owned: Sequence[str], save_id: str, clearable: Callable[[], Sequence[str]] = lambda: ()
) -> SaveClaim:
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
            _take_over(storage, claim, clearable)
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
        found = _read_record(storage, IN_PROGRESS_FILENAME)
        if found is not None and found.save_id == claim.save_id:
            storage.delete(IN_PROGRESS_FILENAME)
    except Exception as e:  # noqa: BLE001 -- the caller's error is what is reported
        logger.warning("could not remove %s of save %s: %s", IN_PROGRESS_FILENAME, claim.save_id, e)


def _take_over(storage: Storage, claim: SaveClaim, clearable: Callable[[], Sequence[str]]) -> None:
    """Replace the record of a provably dead save by ``claim``, deleting what it wrote (the entries
    `_deletable_entries()` allows, checked before anything is deleted): names this save writes, and
    ``clearable()`` -- the names dist_ckpt's other built-in strategies write, so that a save may
    follow one of another backend that died there."""
    where = storage.url_of(IN_PROGRESS_FILENAME)
    other = _read_record(storage, IN_PROGRESS_FILENAME)
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
    entries = _deletable_entries(storage, other, sorted(set(claim.owned) | set(clearable())))
    # takeover records are named after the save they take over: the dead save's, then each dead taker's
    records = [_TAKEOVER.format(c.save_id) for c in (other, *_take_over_record(storage, claim, other))]
    try:
        current = _read_record(storage, IN_PROGRESS_FILENAME)
        if current is None or current.save_id != other.save_id:  # another save finished a takeover meanwhile
            raise SaveConflictError(f"another save took over {storage.url!r} meanwhile; save to a new location")
        logger.warning(
            "%s holds the files of the interrupted %s (its process is gone): deleting %s before saving",
            storage.url,
            other.describe(),
            entries,
        )
        _delete_entries(storage, entries)
        storage.write(IN_PROGRESS_FILENAME, claim.to_bytes())
    finally:
        storage.delete(records[-1])  # ours
    for name in records[:-1]:  # those of saves that died taking over: recovered
        storage.delete(name)


def _take_over_record(storage: Storage, claim: SaveClaim, other: SaveClaim) -> List[SaveClaim]:
    """Create this save's takeover record for the dead save ``other`` (create-if-absent, so that
    of several saves taking over, one does). A takeover record already there whose process is
    provably gone (a save that died while taking over) is taken over the same way, by a record
    named after that save; returns those dead takeover records, oldest first.

    Raises:
        SaveConflictError: a live (or unprovably dead) save is taking over, or a takeover
            record is damaged.
    """
    dead_takers: List[SaveClaim] = []
    victim = other
    while True:
        name = _TAKEOVER.format(victim.save_id)
        try:
            storage.put_if_absent(name, claim.to_bytes())
            return dead_takers
        except ObjectExistsError:
            pass
        taker = _read_record(storage, name)
        if taker is None:  # the other taker finished meanwhile
            raise SaveConflictError(f"another save took over {storage.url!r} meanwhile; save to a new location")
        if not taker.provably_dead():
            raise SaveConflictError(
                f"another save is taking over {storage.url!r} from the interrupted {victim.describe()} "
                f"({taker.describe()}, {storage.url_of(name)}); save to a new location"
            )
        if taker.save_id in {other.save_id, *(t.save_id for t in dead_takers)}:
            raise SaveConflictError(
                f"{storage.url_of(name)} is damaged (it names a save of the chain it takes over, "
                f"{taker.save_id}): save to a new location, or delete that directory if no save runs there"
            )
        dead_takers.append(taker)
        victim = taker


def _read_record(storage: Storage, name: str) -> Optional[SaveClaim]:
    """The claim or takeover record ``name`` (None if absent); damage raises SaveConflictError."""
    where = storage.url_of(name)
    try:
        raw = storage.read(name)
        return SaveClaim.parse(raw, where)
    except ObjectNotFoundError:
        return None
    except CheckpointingException as e:
        raise SaveConflictError(
            f"{where} is damaged ({e}): another save may be writing into {storage.url!r}; save to a new "
            f"location, or delete that directory if no save runs there"
        ) from e


def check_claim(storage: Storage, claim: SaveClaim) -> None:
    """Raise [`SaveConflictError`][dist_ckpt.errors.SaveConflictError] unless ``storage`` is still owned by ``claim``
    (rank 0, right before the commit)."""
    found = _read_record(storage, IN_PROGRESS_FILENAME)
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
        found = _read_record(storage, IN_PROGRESS_FILENAME)
        if found is None or found.save_id != claim.save_id or storage.exists(METADATA_FILENAME):
            return
        _delete_entries(storage, claim.owned)
        storage.delete(IN_PROGRESS_FILENAME)
    except Exception as e:  # noqa: BLE001 -- cleanup must not hide the save's error
        logger.warning("could not remove the files of the failed save %s in %s: %s", claim.save_id, storage.url, e)
