"""Check a whole checkpoint directory: which files are missing, damaged or uncommitted.

[`verify_checkpoint()`][dist_ckpt.tools.verify.verify_checkpoint] is what ``dist-ckpt verify DIR`` runs, on a local
directory or an ``s3://bucket/prefix`` (reading every object once). One process, no process group:

1. read ``metadata.json``: missing means the save never committed (a partial checkpoint that
   ``load`` refuses); unreadable means the commit record is damaged;
2. pick the load strategies of the recorded backends -- or, without a usable ``metadata.json``,
   those of the backend whose files are present (``safetensors/``, ``zarr/``, DCP's files), so that
   a partial checkpoint's files are checked too; a plain torch.distributed.checkpoint directory
   (``.metadata`` and ``.distcp`` files only) is committed by its ``.metadata`` and checked as
   such (``dcp:1``);
3. check every integrity record ``metadata.json`` lists (checksum manifests, the safetensors
   index) against its recorded size, crc32c and version: a deleted or downgraded record is a
   problem, never "saved without checksums" (see `dist_ckpt.record.records`);
4. let each strategy check its files against the checksums recorded at save time
   (``LoadStrategyBase.verify_integrity``): every safetensors block, every zarr file, common.pt
   and every ShardedObject file.

Every problem is one [`IntegrityProblem`][dist_ckpt.integrity.checksums.IntegrityProblem] (file, key, what is wrong);
nothing raises for a damaged checkpoint.

Example:

```python
report = verify_checkpoint("ckpt/iter_1000")
if not report.ok:
    for problem in report.problems:
        print(problem)          # "safetensors/rank00001_0.safetensors (key 'w'): bytes ..."
```
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from dist_ckpt.backends.base import LoadStrategyBase
from dist_ckpt.backends.registry import StrategyAction, get_default_strategy
from dist_ckpt.engine.report import Operation, ProgressCallback, ProgressEvent
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.integrity.checksums import IntegrityProblem, IntegrityReport
from dist_ckpt.record.commit import (
    DCP_CONFIG,
    DCP_METADATA_FILENAME,
    METADATA_FILENAME,
    CheckpointingConfig,
    is_plain_dcp_directory,
    maybe_load_config,
    read_integrity_records,
)
from dist_ckpt.record.records import read_recorded
from dist_ckpt.storage import Storage
from dist_ckpt.storage.errors import StorageError
from dist_ckpt.storage.location import LocationLike, resolve_location

__all__ = ["VerifyReport", "verify_checkpoint"]

logger = logging.getLogger(__name__)

#: directory of each built-in sharded backend, to check the files of an uncommitted checkpoint
_BACKEND_DIRS: Tuple[Tuple[str, str, int], ...] = (("safetensors", "safetensors", 1), ("zarr", "zarr", 1))


@dataclass
class VerifyReport:
    """The outcome of [`verify_checkpoint()`][dist_ckpt.tools.verify.verify_checkpoint].

    Attributes:
        checkpoint_dir: the directory (or ``s3://`` URL) checked.
        committed: whether it holds a valid ``metadata.json``.
        backends: the ``backend:version`` of each part checked.
        problems: every problem found; empty means healthy.
        files_checked: files checked.
        bytes_checked: bytes whose checksums were recomputed.
        notes: remarks that are not problems (e.g. parts saved without checksums).
        found: False when the location holds neither ``metadata.json`` nor any file a save
            writes (not a checkpoint at all, e.g. a run directory): then nothing was checked.
    """

    checkpoint_dir: str
    committed: bool = False
    backends: List[str] = field(default_factory=list)
    problems: List[IntegrityProblem] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0
    notes: List[str] = field(default_factory=list)
    found: bool = True

    @property
    def ok(self) -> bool:
        """A committed checkpoint with no problem."""
        return self.committed and not self.problems

    def to_json(self) -> Dict[str, Any]:
        """The report as a JSON-serializable dict (``dist-ckpt verify --json``)."""
        return {
            "checkpoint": self.checkpoint_dir,
            "ok": self.ok,
            "found": self.found,
            "committed": self.committed,
            "backends": self.backends,
            "problems": [p.to_json() for p in self.problems],
            "files_checked": self.files_checked,
            "bytes_checked": self.bytes_checked,
            "notes": self.notes,
        }


def verify_checkpoint(checkpoint_dir: LocationLike, progress: Optional[ProgressCallback] = None) -> VerifyReport:
    """Check every file of the checkpoint at ``checkpoint_dir`` (see the module docstring).

    ``progress`` is called with a [`ProgressEvent`][dist_ckpt.engine.report.ProgressEvent] as the check of each
    part (the commit record, then each backend's files) starts and ends.

    The checks run in the order of the module docstring's list, in one function so that each
    early verdict (no directory, no checkpoint, never committed) can return the report at once.

    Example:

    ```python
    report = verify_checkpoint("ckpt/iter_1000")
    assert report.ok, "\\n".join(map(str, report.problems))
    ```

    Raises:
        StorageError: an object store refused the requests (wrong credentials, a missing
            bucket, retries exhausted) -- a problem of access, not of the checkpoint.
        StorageConfigError: a malformed location (an unknown scheme, an invalid bucket name).
    """
    directory = resolve_location(checkpoint_dir)
    report = VerifyReport(directory.url)
    if directory.local_paths and not directory.dir_exists():
        report.problems.append(IntegrityProblem(".", "the checkpoint directory does not exist"))
        return report
    started = time.perf_counter()

    def notify(phase: str, index: int, total: int, done: bool) -> None:
        if progress is not None:
            progress(
                ProgressEvent(
                    Operation.VERIFY, report.checkpoint_dir, phase, index, total, done, time.perf_counter() - started
                )
            )

    notify(f"checking {METADATA_FILENAME}", 1, 1, False)  # the parts to check are known after it
    # 1. the commit record
    config: Optional[CheckpointingConfig] = None
    try:
        config = maybe_load_config(directory)
    except StorageError:
        raise  # refused credentials, a missing bucket: not a property of the checkpoint
    except CheckpointingException as e:
        report.problems.append(IntegrityProblem(METADATA_FILENAME, f"unreadable: {e}"))
    if config is None and not report.problems and is_plain_dcp_directory(directory):
        config = DCP_CONFIG  # DCP's .metadata, written last by its save, is its commit record
        report.notes.append(
            f"no {METADATA_FILENAME}: a plain torch.distributed.checkpoint directory, committed by its "
            f"{DCP_METADATA_FILENAME}"
        )
    if config is None and not report.problems and not _holds_save_files(directory) and not _has_dcp_files(directory):
        report.found = False
        report.problems.append(
            IntegrityProblem(
                METADATA_FILENAME,
                "missing, and so is every file a save writes: no checkpoint here (or a save that "
                "had not started writing)",
            )
        )
        return report
    if config is None and not report.problems:
        report.problems.append(
            IntegrityProblem(
                METADATA_FILENAME,
                "missing: the save never committed (interrupted, or still running); load refuses this directory",
            )
        )
    report.committed = config is not None
    # 2. the strategies
    strategies = _strategies(directory, config, report)
    # 3. the integrity records
    committed_by_us = config is not None and config != DCP_CONFIG  # a plain DCP directory has no records
    damaged_records = _check_records(directory, report) if committed_by_us else set()
    notify(f"checking {METADATA_FILENAME}", 1, 1 + len(strategies), True)
    # 4. every part's files
    for i, (name, strategy) in enumerate(strategies, start=2):
        notify(f"checking the {name} files", i, 1 + len(strategies), False)
        try:
            part = strategy.verify_integrity(directory)
        except CheckpointingException as e:  # a strategy that could not even start
            part = IntegrityReport()
            part.add(".", f"{name}: {e}")
        report.backends.append(name)
        report.problems.extend(p for p in part.problems if p.path not in damaged_records)  # said once
        report.files_checked += part.files_checked
        report.bytes_checked += part.bytes_checked
        report.notes.extend(part.notes)
        notify(f"checking the {name} files", i, 1 + len(strategies), True)
    _note_leftovers(directory, report)
    logger.info("verified %s: %d problems, %d files", directory.url, len(report.problems), report.files_checked)
    return report


def _check_records(directory: Storage, report: VerifyReport) -> Set[str]:
    """Check every integrity record ``metadata.json`` lists; return the damaged ones' paths."""
    try:
        records = read_integrity_records(directory)
    except CheckpointingException as e:
        report.problems.append(IntegrityProblem(METADATA_FILENAME, f"unreadable integrity records: {e}"))
        return set()
    if records is None:
        report.notes.append(
            f"{METADATA_FILENAME} lists no integrity records (saved by an older dist_ckpt): a deleted or replaced "
            "checksum manifest cannot be told from one that was never written"
        )
        return set()
    damaged: Set[str] = set()
    for key in sorted(records):
        report.files_checked += 1
        report.bytes_checked += records[key].size
        try:
            read_recorded(directory, key)
        except StorageError:
            raise
        except CheckpointingException as e:
            report.problems.append(IntegrityProblem(key, str(e)))
            damaged.add(key)
    return damaged


def _strategies(
    directory: Storage, config: Optional[CheckpointingConfig], report: VerifyReport
) -> List[Tuple[str, LoadStrategyBase]]:
    if config is not None:
        wanted = [
            (StrategyAction.LOAD_SHARDED, config.sharded_backend, config.sharded_backend_version),
            (StrategyAction.LOAD_COMMON, config.common_backend, config.common_backend_version),
        ]
    else:  # uncommitted: check the files that are there
        present = _top_level_names(directory)
        wanted = [(StrategyAction.LOAD_SHARDED, b, v) for d, b, v in _BACKEND_DIRS if d in present]
        if _has_dcp_files(directory):
            wanted.append((StrategyAction.LOAD_SHARDED, "torch_dist", 1))
        wanted.append((StrategyAction.LOAD_COMMON, "torch", 1))
    out: List[Tuple[str, LoadStrategyBase]] = []
    for action, backend, version in wanted:
        try:
            strategy = get_default_strategy(action, backend, version)
        except CheckpointingException as e:
            report.problems.append(IntegrityProblem(METADATA_FILENAME, f"cannot check the {backend!r} part: {e}"))
            continue
        assert isinstance(strategy, LoadStrategyBase)
        try:
            strategy.check_location(directory)
        except CheckpointingException as e:
            report.problems.append(IntegrityProblem(".", f"cannot check the {backend!r} part: {e}"))
            continue
        out.append((f"{backend}:{version}", strategy))
    return out


def _has_dcp_files(directory: Storage) -> bool:
    """Whether an uncommitted checkpoint holds torch.distributed.checkpoint files (a torch_dist save)."""
    return any(
        o.key == DCP_METADATA_FILENAME or o.key.endswith(".distcp") for o in directory.list() if "/" not in o.key
    )


def _holds_save_files(directory: Storage) -> bool:
    """Whether anything a save writes is at the top of ``directory``: a backend's directory or a
    name the common-state strategy owns (``common.pt``, ``objects/``, ...)."""
    common = get_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1)
    names = {d for d, _, _ in _BACKEND_DIRS} | set(getattr(common, "owned_paths", ()))
    return bool(names & set(directory.list_dirs())) or any(directory.exists(name) for name in names)


def _top_level_names(directory: Storage) -> List[str]:
    """Names of the directories directly in the checkpoint."""
    return directory.list_dirs()


def _note_leftovers(directory: Storage, report: VerifyReport) -> None:
    """Temporary files of interrupted atomic writes are harmless; say they can go (only a local
    disk has them: an interrupted upload never becomes an object)."""
    if not directory.local_paths:
        return
    root = directory.local_dir
    leftovers = sorted(str(p.relative_to(root)) for p in root.rglob(".*.tmp-*"))
    if leftovers:
        shown = ", ".join(leftovers[:5]) + (f" and {len(leftovers) - 5} more" if len(leftovers) > 5 else "")
        report.notes.append(f"temporary files of an interrupted write can be deleted: {shown}")
