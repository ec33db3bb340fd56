"""Symlinks in a run's directory to the HF weights of its latest complete checkpoint, for ``from_pretrained``.

A local directory only (an object store has no symlinks); part of the contract in
[`dist_ckpt.training.checkpoints`][dist_ckpt.training.checkpoints], which re-exports
[`create_pretrained_symlinks()`][dist_ckpt.training.checkpoints.create_pretrained_symlinks].
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from pathlib import Path
from typing import List, Set

from dist_ckpt.errors import CheckpointManagementError, NotACheckpointError, SymlinkConflictError
from dist_ckpt.storage import fsync_dir
from dist_ckpt.storage.location import LocationLike, resolve_location
from dist_ckpt.training.checkpoint_dirs import (
    CheckpointFormat,
    find_latest_checkpoint,
    get_checkpoint_metadata,
    parse_checkpoint_step,
)
from dist_ckpt.training.hf_weights import index_shards

logger = logging.getLogger(__name__)

__all__ = ["create_pretrained_symlinks"]

# symlinks that create_pretrained_symlinks may have made (and so may replace or remove)
_HF_LINK_RE = re.compile(
    r"model(-[0-9]+-of-[0-9]+)?\.safetensors(\.index\.json)?|pytorch_model(-[0-9]+-of-[0-9]+)?\.bin(\.index\.json)?"
)


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
