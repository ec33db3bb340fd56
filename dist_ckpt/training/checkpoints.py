"""Checkpoint directories over time: the latest complete one, rotation, best, metrics.

A training run writes its checkpoints into one directory, ``model_dir``:

```text
model_dir/
  checkpoint-1000/     complete dist_ckpt checkpoint (its metadata.json is committed)
  checkpoint-2000/     complete HuggingFace-format checkpoint (model.safetensors)
  checkpoint-3000/     a save in progress or a crashed one (no commit marker): not complete
  model.safetensors -> checkpoint-2000/model.safetensors    (create_pretrained_symlinks)
```

The functions here are single-process utilities: call them from one process (e.g. rank 0),
never from every rank at once, and not while another process rotates the same ``model_dir``.

**Names.** The name of a checkpoint directory carries its step. Recognised names
(`CHECKPOINT_NAME_PATTERNS`, ``N`` = decimal digits, leading zeros allowed):
``checkpoint-N`` (HuggingFace Trainer; what
[`next_checkpoint_path()`][dist_ckpt.training.checkpoints.next_checkpoint_path] creates), ``checkpoint_N``, ``iter_N``
(Megatron, ``iter_0001000``), ``step-N``, ``step_N`` and ``global_stepN`` (DeepSpeed). Any other entry of ``model_dir``
(files, ``runs/``, ``final/``, hidden names) is not managed: never returned as the latest checkpoint, never counted or
deleted by rotation. Unlike the reference, checkpoints live directly in ``model_dir`` (Megatron's
layout), not in a ``checkpoints/`` subdirectory.

**Order.** Checkpoints are ordered by ``(step, name)``: by step, never by modification time
(copies, restores and coarse clocks reorder mtimes); two names with the same step
(``checkpoint-1000`` and ``iter_0001000``) are ordered by their names as strings.

**Completeness.** Completeness is decided by each format's commit marker, nothing else. A
directory is a *complete* checkpoint iff

* it is a committed dist_ckpt checkpoint: its ``metadata.json`` is valid
  ([`dist_ckpt.engine.commit.maybe_load_config()`][dist_ckpt.engine.commit.maybe_load_config]), or
* it holds HuggingFace weights, looked for in this order: ``model.safetensors.index.json``,
  ``model.safetensors``, ``pytorch_model.bin.index.json``, ``pytorch_model.bin`` (the first
  one present decides). An index must hold a non-empty ``weight_map`` whose every shard file
  exists in the directory and is whole; a safetensors file is whole when its size is exactly
  what its header says (a truncated copy is not); a torch zip file is whole when its central
  directory can be found.

A directory that holds dist_ckpt files (``metadata.json``, even a corrupt one, or
``common.pt``) is judged as dist_ckpt only: HF-named files in it never make it complete, so an
uncommitted dist_ckpt save of HF-style files cannot pass for a finished HF checkpoint. Anything
else (no marker, a corrupt ``metadata.json``, an index with a missing shard) is *partial*:
ignored by [`find_latest_checkpoint()`][dist_ckpt.training.checkpoints.find_latest_checkpoint], never counted as
complete.

**Deletion.** No crash leaves a half-deleted directory that looks complete: on a local disk
it is (1) renamed to a hidden trash name (``.dist_ckpt-trash-...``) no pattern recognises, (2)
``model_dir`` is fsynced, (3) its commit markers go, (4) the rest; the next rotation removes
trash left by a crash. An object store cannot rename: the markers (``metadata.json``, the HF
names) are deleted *first*, so a crash leaves a partial directory, skipped and later removed.

**Any storage.** ``model_dir`` and checkpoint paths may be paths, ``s3://`` URLs or a
[`Storage`][dist_ckpt.storage.base.Storage]; one implementation works through the storage (a
run's checkpoints are the directories directly under it: ``list_dirs``, one request on S3) and
returns paths named as the run was. Where the storage has ``local_paths`` it also uses what only
a local directory has: the trash rename and symlinks
([`create_pretrained_symlinks()`][dist_ckpt.training.checkpoints.create_pretrained_symlinks]).

The structural checks of HF weight files live in `dist_ckpt.training.hf_weights`, the metrics
file in [`dist_ckpt.training.metrics`][dist_ckpt.training.metrics] (its functions are re-exported here).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Set, Tuple, Union

from dist_ckpt.backends.torch_common.strategy import COMMON_STATE_FNAME
from dist_ckpt.engine.commit import HF_WEIGHT_FILES, METADATA_FILENAME, CheckpointingConfig, maybe_load_config
from dist_ckpt.errors import (
    CheckpointingException,
    CheckpointManagementError,
    NotACheckpointError,
    SymlinkConflictError,
)
from dist_ckpt.storage import Storage, StorageError, fsync_dir
from dist_ckpt.storage.location import LocationLike, resolve_location
from dist_ckpt.training.hf_weights import index_shards, weights_file_whole
from dist_ckpt.training.metrics import METRICS_FILENAME, load_checkpoint_metrics, save_checkpoint_metrics

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_NAME_PATTERNS",
    "METRICS_FILENAME",
    "CheckpointFormat",
    "CheckpointMeta",
    "create_pretrained_symlinks",
    "find_latest_checkpoint",
    "get_checkpoint_metadata",
    "load_checkpoint_metrics",
    "maybe_delete_oldest_checkpoint",
    "next_checkpoint_path",
    "parse_checkpoint_step",
    "save_checkpoint_metrics",
    "validate_checkpoint",
]

#: Regular expressions (matched against the whole directory name) whose group is the step.
CHECKPOINT_NAME_PATTERNS: Tuple[str, ...] = (
    r"checkpoint-([0-9]+)",
    r"checkpoint_([0-9]+)",
    r"iter_([0-9]+)",
    r"step-([0-9]+)",
    r"step_([0-9]+)",
    r"global_step([0-9]+)",
)
_NAME_RES = tuple(re.compile(p) for p in CHECKPOINT_NAME_PATTERNS)

# symlinks that create_pretrained_symlinks may have made (and so may replace or remove)
_HF_LINK_RE = re.compile(
    r"model(-[0-9]+-of-[0-9]+)?\.safetensors(\.index\.json)?|pytorch_model(-[0-9]+-of-[0-9]+)?\.bin(\.index\.json)?"
)
_TRASH_PREFIX = ".dist_ckpt-trash-"
#: what makes a directory a complete checkpoint: deleted first, so a half-deleted one is partial
_MARKERS = (METADATA_FILENAME, *(file_name for file_name, _, _ in HF_WEIGHT_FILES))


class CheckpointFormat(str, Enum):
    """On-disk format of a checkpoint directory (compares equal to its string value)."""

    DIST_CKPT = "dist_ckpt"
    HF = "hf"


@dataclass(frozen=True)
class CheckpointMeta:
    """What [`get_checkpoint_metadata()`][dist_ckpt.training.checkpoints.get_checkpoint_metadata] found in a directory.

    Attributes:
        file_name: HF: the index file if there is one, else the weights file; dist_ckpt:
            ``"metadata.json"``.
        is_index: ``file_name`` is an HF index of shard files (always False for dist_ckpt).
        safetensors: the HF weights are safetensors, else torch pickles (False for dist_ckpt).
        format: ``CheckpointFormat.DIST_CKPT`` or ``CheckpointFormat.HF``.
        complete: the checkpoint is committed (see the module docstring); False for a corrupt
            ``metadata.json`` or an index whose shards are missing or truncated.
        step: the step parsed from the directory name, or None if the name carries none.
        backend / backend_version: the sharded backend recorded in ``metadata.json`` (dist_ckpt).
        config: the whole record of ``metadata.json`` (complete dist_ckpt checkpoints only).
    """

    file_name: str
    is_index: bool
    safetensors: bool
    format: CheckpointFormat
    complete: bool
    step: Optional[int] = None
    backend: Optional[str] = None
    backend_version: Optional[int] = None
    config: Optional[CheckpointingConfig] = None


# --------------------------------------------------------------------------- names


def parse_checkpoint_step(name: str) -> Optional[int]:
    """The step a checkpoint directory name carries, or None if it matches no pattern.

    Example:

    ```python
    parse_checkpoint_step("iter_0001000")   # 1000
    parse_checkpoint_step("final")          # None
    ```
    """
    for pattern in _NAME_RES:
        match = pattern.fullmatch(name)
        if match:
            return int(match.group(1))
    return None


def next_checkpoint_path(model_dir: LocationLike, checkpoint_id: Union[int, str]) -> str:
    """The directory to save the checkpoint of a step (or of a given name) into.

    Creates nothing. An int (or a string of digits) gives ``model_dir/checkpoint-<step>``; any
    other string must be a recognised checkpoint name and is used as it is.

    Example:

    ```python
    path = next_checkpoint_path("runs/gpt", 1000)        # "runs/gpt/checkpoint-1000"
    dist_ckpt.save(sharded_state_dict, path)
    next_checkpoint_path("runs/gpt", "iter_0001000")     # "runs/gpt/iter_0001000"
    ```

    Raises:
        CheckpointManagementError: a negative step, or a name that carries no step (it would
            be invisible to find_latest_checkpoint and rotation).
    """
    if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, (int, str)):
        raise CheckpointManagementError(
            f"checkpoint_id must be a step (int) or a checkpoint name (str), got {checkpoint_id!r}"
        )
    if isinstance(checkpoint_id, str) and checkpoint_id.isascii() and checkpoint_id.isdigit():
        checkpoint_id = int(checkpoint_id)
    if isinstance(checkpoint_id, int):
        if checkpoint_id < 0:
            raise CheckpointManagementError(f"checkpoint step must be >= 0, got {checkpoint_id}")
        name = f"checkpoint-{checkpoint_id}"
    elif parse_checkpoint_step(checkpoint_id) is not None:
        name = checkpoint_id
    else:
        raise CheckpointManagementError(
            f"checkpoint name {checkpoint_id!r} carries no step: use a step or a name matching one of "
            f"{', '.join(CHECKPOINT_NAME_PATTERNS)} (other names are not managed checkpoints)"
        )
    return resolve_location(model_dir).url_of(name)


def checkpoint_names(storage: Storage) -> List[Tuple[int, str]]:
    """``(step, name)`` of the directories directly under ``storage`` whose names carry a step,
    oldest first (one listing of one level).

    Example:

    ```python
    checkpoint_names(open_storage("runs/gpt"))   # [(1000, "checkpoint-1000"), (2000, "iter_0002000")]
    ```
    """
    entries = []
    for name in storage.list_dirs():
        step = parse_checkpoint_step(name)
        if step is not None:
            entries.append((step, name))
    return sorted(entries)


# --------------------------------------------------------------------------- completeness


def _hf_meta(storage: Storage, step: Optional[int]) -> Optional[CheckpointMeta]:
    for file_name, is_index, safetensors in HF_WEIGHT_FILES:
        if not storage.exists(file_name):
            continue
        if is_index:
            shards = index_shards(storage, file_name)
            complete = shards is not None and all(weights_file_whole(storage, s) for s in shards)
        else:
            complete = weights_file_whole(storage, file_name)
        return CheckpointMeta(file_name, is_index, safetensors, CheckpointFormat.HF, complete, step)
    return None


def _dir_name(storage: Storage) -> str:
    """The last component of the storage's location (of the absolute path, for a local one)."""
    return storage.local_dir.name if storage.local_paths else storage.url.rstrip("/").rsplit("/", 1)[-1]


def get_checkpoint_metadata(path: LocationLike) -> Optional[CheckpointMeta]:
    """Detect the format of a checkpoint directory and whether it is complete.

    A ``metadata.json`` makes a dist_ckpt checkpoint (complete if it is valid); otherwise HF
    weight files are looked for (see the module docstring). A directory with neither is no
    checkpoint (None), and so is a dist_ckpt save that has not committed yet (``common.pt`` but
    no ``metadata.json``).

    Example:

    ```python
    meta = get_checkpoint_metadata("runs/gpt/checkpoint-1000")
    if meta is not None and meta.complete and meta.format == "hf":
        print(meta.file_name, meta.is_index, meta.safetensors)
    get_checkpoint_metadata("s3://bucket/runs/gpt/checkpoint-1000")   # the same on S3
    ```

    Returns:
        A [`CheckpointMeta`][dist_ckpt.training.checkpoints.CheckpointMeta] (``complete=False`` for a corrupt
            ``metadata.json`` or an HF
        folder with missing or truncated weights), or None for a missing directory or one that
        is no checkpoint.

    Raises:
        StorageError: an object store refused a request (credentials, missing bucket, retries
            exhausted): never taken for "no checkpoint".
    """
    storage = resolve_location(path)
    step = parse_checkpoint_step(_dir_name(storage))
    try:
        config = maybe_load_config(storage)
    except StorageError:
        raise
    except CheckpointingException as e:
        logger.debug("%s is not committed: %s", storage.url, e)
        return CheckpointMeta(METADATA_FILENAME, False, False, CheckpointFormat.DIST_CKPT, False, step)
    if config is not None:
        return CheckpointMeta(
            METADATA_FILENAME,
            False,
            False,
            CheckpointFormat.DIST_CKPT,
            True,
            step,
            config.sharded_backend,
            config.sharded_backend_version,
            config,
        )
    if storage.exists(COMMON_STATE_FNAME):
        return None  # a dist_ckpt save that has not committed: no checkpoint yet
    return _hf_meta(storage, step)


def validate_checkpoint(checkpoint_path: LocationLike) -> bool:
    """Whether ``checkpoint_path`` is a complete (committed) checkpoint directory.

    Example:

    ```python
    if not validate_checkpoint("runs/gpt/checkpoint-1000"):
        raise SystemExit("that save did not finish")
    ```
    """
    meta = get_checkpoint_metadata(checkpoint_path)
    return meta is not None and meta.complete


def find_latest_checkpoint(model_dir: LocationLike) -> Optional[str]:
    """The complete checkpoint of ``model_dir`` with the highest step, or None.

    Partial directories (a save in progress or a crashed one) are skipped, whatever their step
    or modification time; ties on the step go to the greater name (module docstring).

    Example:

    ```python
    latest = find_latest_checkpoint("runs/gpt")
    if latest is not None:
        state = dist_ckpt.load(sharded_state_dict, latest)
    ```
    """
    storage = resolve_location(model_dir)
    for step, name in reversed(checkpoint_names(storage)):
        if validate_checkpoint(storage.child(name)):
            logger.debug("latest complete checkpoint in %s: %s (step %d)", storage.url, name, step)
            return storage.url_of(name)
        logger.info("skipping %s: not a complete checkpoint (no valid commit marker)", storage.url_of(name))
    return None


# --------------------------------------------------------------------------- rotation


def _remove_tree(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        if os.path.lexists(path):
            raise


def _delete_checkpoint(storage: Storage, name: str) -> None:
    """Delete checkpoint ``name`` of the run so that no crash leaves it looking complete (module
    docstring): on a local disk renamed into the trash first, elsewhere its markers first."""
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
    directories are neither counted nor deleted. Deletion is crash-safe (module docstring).

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


# --------------------------------------------------------------------------- HF symlinks


def _symlink_replace(target: str, link: Path) -> None:
    """Point ``link`` at ``target``, replacing what is there in one atomic rename."""
    tmp = link.with_name(f".{link.name}.tmp-link-{uuid.uuid4().hex[:8]}")
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink()
        raise


def _stale_links(root: Path, keep: Set[str]) -> List[Path]:
    """Symlinks named like HF weight files, not in ``keep``, that point into a checkpoint of ``root``."""
    stale = []
    with os.scandir(root) as it:
        links = [Path(e.path) for e in it if e.is_symlink() and _HF_LINK_RE.fullmatch(e.name) and e.name not in keep]
    for link in links:
        target = os.readlink(link)
        parts = Path(os.path.normpath(target)).parts
        if not os.path.isabs(target) and len(parts) >= 2 and parse_checkpoint_step(parts[0]) is not None:
            stale.append(link)
    return sorted(stale)


def create_pretrained_symlinks(
    model_dir: LocationLike, force_overwrite: bool = False, dry_run: bool = False
) -> List[str]:
    """Link the weights of the latest complete checkpoint into ``model_dir`` for ``from_pretrained``.

    Creates relative symlinks ``model_dir/<file> -> <checkpoint>/<file>`` for the HF weights
    file, or for the index and every shard it lists, replacing each existing symlink atomically.
    Our older links that the new set does not include (e.g. the shards of a sharded checkpoint
    when the latest one is a single file) are removed, so ``from_pretrained`` cannot pick stale
    weights. Conflicts are checked before anything changes.

    Example:

    ```python
    links = create_pretrained_symlinks("runs/gpt")
    model = AutoModelForCausalLM.from_pretrained("runs/gpt")   # config.json is in runs/gpt
    ```

    Args:
        model_dir: the run's directory of checkpoints.
        force_overwrite: replace regular files in the way (directories are never replaced).
        dry_run: change nothing; log what would be done.

    Returns:
        The link paths that point (or, with ``dry_run``, would point) to the latest weights.

    Raises:
        NotACheckpointError: ``model_dir`` holds no complete checkpoint.
        CheckpointManagementError: ``model_dir`` is on an object store (no symlinks there), or the latest
            complete checkpoint is not in HF format (a dist_ckpt checkpoint has no weight files
            ``from_pretrained`` can read).
        SymlinkConflictError: a regular file (without ``force_overwrite``) or a directory is in
            the way of a link.
    """
    storage = resolve_location(model_dir)
    if not storage.local_paths:
        raise CheckpointManagementError(
            f"cannot link pretrained weights in {storage.url}: object stores have no symlinks; load the latest "
            f"checkpoint from its URL (find_latest_checkpoint) or download its HF files into a local directory"
        )
    root = Path(storage.url)  # as it was named (links are relative to it)
    latest = find_latest_checkpoint(storage)
    if latest is None:
        raise NotACheckpointError(f"no complete checkpoint in {str(root)!r}; nothing to link")
    meta = get_checkpoint_metadata(latest)
    if meta is None or meta.format is not CheckpointFormat.HF:
        raise CheckpointManagementError(
            f"the latest complete checkpoint {latest!r} is a dist_ckpt checkpoint, not HuggingFace weights; "
            f"from_pretrained cannot read it (save an HF copy of the model to link it)"
        )
    names = [meta.file_name]
    if meta.is_index:
        names += index_shards(storage.child(Path(latest).name), meta.file_name) or []
    plan = [(root / name, os.path.relpath(os.path.join(latest, name), root)) for name in names]

    conflicts = []
    for link, _ in plan:
        if link.is_symlink() or not os.path.lexists(link):
            continue
        if link.is_dir():
            conflicts.append(f"{link} (a directory)")
        elif not force_overwrite:
            conflicts.append(f"{link} (a regular file)")
    if conflicts:
        raise SymlinkConflictError(
            f"cannot link the weights of {latest!r}: {', '.join(conflicts)} in the way; pass force_overwrite=True "
            f"to replace regular files (directories are never replaced)"
        )
    stale = _stale_links(root, set(names))
    prefix = "DRY RUN: would " if dry_run else ""
    for link, target in plan:
        action = "replace regular file" if os.path.lexists(link) and not link.is_symlink() else "link"
        logger.info("%s%s %s -> %s", prefix, action, link, target)
        if not dry_run:
            _symlink_replace(target, link)
    for link in stale:
        logger.info("%sremove stale link %s -> %s", prefix, link, os.readlink(link))
        if not dry_run:
            link.unlink()
    if not dry_run:
        fsync_dir(root)
    return [str(link) for link, _ in plan]
