"""Rotation of a run's checkpoints: keep the newest few, delete the rest so no crash leaves one looking complete.

How a deletion stays crash-safe (a trash rename on a local disk, commit markers first on an
object store) is part of the contract in [`dist_ckpt.training.checkpoints`][dist_ckpt.training.checkpoints],
which re-exports [`maybe_delete_oldest_checkpoint()`][dist_ckpt.training.checkpoints.maybe_delete_oldest_checkpoint].
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Set

from dist_ckpt.errors import CheckpointManagementError
from dist_ckpt.record.commit import HF_WEIGHT_FILES, METADATA_FILENAME
from dist_ckpt.storage import Storage, fsync_dir
from dist_ckpt.storage.location import LocationLike, resolve_location
from dist_ckpt.training.checkpoint_dirs import checkpoint_names, validate_checkpoint

logger = logging.getLogger(__name__)

__all__ = ["maybe_delete_oldest_checkpoint"]

_TRASH_PREFIX = ".dist_ckpt-trash-"
#: what makes a directory a complete checkpoint: deleted first, so a half-deleted one is partial
_MARKERS = (METADATA_FILENAME, *(file_name for file_name, _, _ in HF_WEIGHT_FILES))


def _remove_tree(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        if os.path.lexists(path):
            raise


def _delete_checkpoint(storage: Storage, name: str) -> None:
    """Delete checkpoint ``name`` of the run so that no crash leaves it looking complete (the
    contract in dist_ckpt.training.checkpoints): on a local disk renamed into the trash first,
    elsewhere its markers first."""
    if not storage.local_paths:
        checkpoint = storage.child(name)
        for marker in _MARKERS:
            checkpoint.delete(marker)
        removed = checkpoint.delete_prefix("")
        logger.debug("deleted %d objects under %s", removed, checkpoint.url)
        return
    root = storage.local_dir
    trash = root / f"{_TRASH_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
    os.rename(root / name, trash)
    fsync_dir(root)
    for marker in _MARKERS:
        try:
            (trash / marker).unlink()
        except FileNotFoundError:
            pass
    _remove_tree(trash)


def _remove_trash(root: Path) -> None:
    with os.scandir(root) as it:
        leftovers = [e.path for e in it if e.name.startswith(_TRASH_PREFIX) and e.is_dir(follow_symlinks=False)]
    for leftover in leftovers:
        logger.info("removing %s, left by an interrupted checkpoint deletion", leftover)
        _remove_tree(Path(leftover))


def _designated(storage: Storage, names: Sequence[str], wanted: Iterable[LocationLike]) -> Set[str]:
    """Names among ``names`` that ``wanted`` designates: a bare name, the path of a checkpoint
    of a local run (compared by real path), or the URL of one on an object store."""
    known = set(names)
    if storage.local_paths:
        root = storage.local_dir
        by_place = {os.path.realpath(root / n): n for n in known}

        def place(text: str) -> str:
            return os.path.realpath(root / text if os.sep not in text and "/" not in text else Path(text))

    else:
        by_place = {storage.url_of(n).rstrip("/"): n for n in known}

        def place(text: str) -> str:
            return text.rstrip("/")

    found = set()
    for item in wanted:
        text = item.url if isinstance(item, Storage) else os.fspath(item)
        name = text if text in known else by_place.get(place(text))
        if name is None:
            logger.warning("preserved checkpoint %s is not a checkpoint directory of %s", text, storage.url)
        else:
            found.add(name)
    return found


def _linked_names(root: Path, names: Sequence[str]) -> Set[str]:
    """Names of ``names`` that a symlink directly in ``root`` points into (e.g. our HF links)."""
    by_real = {os.path.realpath(root / n): n for n in names}
    found = set()
    with os.scandir(root) as it:
        links = [e.path for e in it if e.is_symlink()]
    for link in links:
        target = os.path.realpath(link)
        for real, name in by_real.items():
            if target == real or target.startswith(real + os.sep):
                found.add(name)
    return found


def maybe_delete_oldest_checkpoint(
    model_dir: LocationLike,
    max_checkpoints: int,
    best_checkpoint: Optional[LocationLike] = None,
    preserved_checkpoints: Optional[Sequence[LocationLike]] = None,
    *,
    delete_partial: bool = True,
) -> None:
    """Keep at most ``max_checkpoints`` complete checkpoints in ``model_dir``, deleting the oldest.

    Complete checkpoints are deleted oldest step first, never one of these: the newest complete
    checkpoint (so the only complete one survives too), ``best_checkpoint``, any of
    ``preserved_checkpoints``, a checkpoint that a symlink directly in ``model_dir`` points into
    (e.g. the links of [`create_pretrained_symlinks()`][dist_ckpt.training.checkpoints.create_pretrained_symlinks],
    which would dangle). Kept checkpoints count towards ``max_checkpoints``, so fewer others may remain.

    With ``delete_partial``, partial directories with a step *below* the newest complete one are
    removed as leftovers of crashed saves; a partial directory with the same or a higher step is
    never removed (it may be a save in progress). Pass ``delete_partial=False`` when a run was
    rolled back and is saving again at steps below an existing checkpoint. Symlinked checkpoint
    directories are neither counted nor deleted. Deletion is crash-safe (see
    [`dist_ckpt.training.checkpoints`][dist_ckpt.training.checkpoints]).

    Example:

    ```python
    dist_ckpt.save(sharded_state_dict, next_checkpoint_path("runs/gpt", step))
    maybe_delete_oldest_checkpoint("runs/gpt", max_checkpoints=3,
                                   best_checkpoint="runs/gpt/checkpoint-2000")
    ```

    Args:
        model_dir: the run's directory of checkpoints.
        max_checkpoints: how many complete checkpoints to keep, >= 1.
        best_checkpoint: path (or bare name in ``model_dir``) of a checkpoint to keep.
        preserved_checkpoints: paths (or bare names) of more checkpoints to keep.
        delete_partial: also remove partial directories older than the newest complete one.

    Raises:
        CheckpointManagementError: ``max_checkpoints`` is not an int >= 1.
    """
    if isinstance(max_checkpoints, bool) or not isinstance(max_checkpoints, int) or max_checkpoints < 1:
        raise CheckpointManagementError(
            f"max_checkpoints must be an int >= 1 (the newest complete checkpoint is always kept), "
            f"got {max_checkpoints!r}"
        )
    if isinstance(preserved_checkpoints, (str, os.PathLike, Storage)):
        preserved_checkpoints = [preserved_checkpoints]  # a single path, not a sequence of characters
    wanted: List[LocationLike] = list(preserved_checkpoints or [])
    if best_checkpoint is not None:
        wanted.append(best_checkpoint)
    storage = resolve_location(model_dir)
    entries = checkpoint_names(storage)
    if storage.local_paths:
        if not storage.dir_exists():
            logger.debug("no checkpoint directory %s; nothing to delete", storage.url)
            return
        _remove_trash(storage.local_dir)
        # a symlinked checkpoint directory lives elsewhere: neither counted nor deleted here
        entries = [(step, name) for step, name in entries if not os.path.islink(storage.local_dir / name)]
    complete = [(step, name) for step, name in entries if validate_checkpoint(storage.child(name))]
    if not complete:
        logger.debug("no complete checkpoint in %s; deleting nothing", storage.url)
        return
    newest_step, newest = complete[-1]
    names = [name for _, name in entries]
    kept = _designated(storage, names, wanted) | {newest}
    if storage.local_paths:
        kept |= _linked_names(storage.local_dir, names)
    excess = len(complete) - max_checkpoints
    doomed = [e for e in complete if e[1] not in kept][: max(excess, 0)]
    if delete_partial:
        complete_names = {name for _, name in complete}
        doomed += [e for e in entries if e[1] not in complete_names and e[1] not in kept and e[0] < newest_step]
    for step, name in doomed:
        state = "complete" if (step, name) in complete else "partial (leftover of a crashed save)"
        logger.info("deleting %s checkpoint %s (step %d); kept: %s", state, storage.url_of(name), step, sorted(kept))
        _delete_checkpoint(storage, name)
