"""Flat state dicts of tensors saved and loaded at any world size, and read back whole.

[`Checkpointer`][dist_ckpt.training.checkpointer.Checkpointer] (OLMo-core's name and signatures) saves ``{key: tensor |
DTensor | ShardedTensor}`` collectively, loads in place at another world size, and reads tensors whole
(``unshard``) or their metadata. Its saves may be asynchronous: ``save(..., async_save=True)``
returns after a snapshot and schedules the write on the checkpointer's own queue;
[`Checkpointer.maybe_finalize_async_saves()`][dist_ckpt.training.checkpointer.Checkpointer.maybe_finalize_async_saves]
commits them (see `dist_ckpt.training.async_saves`). The one-call API for a model and its optimizer
([`dist_ckpt.training.model_optim`][dist_ckpt.training.model_optim]) is built on it.

Everything is collective (all ranks call it together) unless ``no_dist=True``; an error on any
rank is raised on every rank. Without a process group the world is one process.

Differences from OLMo-core: saves return the checkpoint's tensor metadata, not the files each
rank wrote -- dist_ckpt backends decide the files; ``Checkpointer.unshard`` has no
``num_threads``; the backend is chosen by ``Checkpointer(save_strategy=..., load_strategy=...)``,
the default being dist_ckpt's.

Example:

```python
ckpt = Checkpointer()
ckpt.save("ckpt/step_100", {"emb": emb_dtensor, "head": head_weight})     # e.g. at 4 ranks
ckpt.load("ckpt/step_100", {"emb": emb_dtensor2, "head": head_weight2})  # e.g. at 2 ranks
full = ckpt.unshard("ckpt/step_100", no_dist=True)                       # {key: tensor}
```
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import torch

from dist_ckpt.asynchronous.queue import AsyncRequest
from dist_ckpt.asynchronous.worker import DEFAULT_WRITER_TIMEOUT_S
from dist_ckpt.backends.registry import (
    DEFAULT_SHARDED_BACKEND,
    Strategy,
    StrategyAction,
    StrategySpec,
    resolve_strategy,
)
from dist_ckpt.collectives.distributed import get_rank, run_collectively
from dist_ckpt.engine.checks.compatibility import verify_checkpoint_and_load_strategy
from dist_ckpt.engine.load import load_with_report
from dist_ckpt.engine.load_parts import load_tensors_metadata
from dist_ckpt.engine.report import ProgressCallback
from dist_ckpt.engine.save import save
from dist_ckpt.engine.watchdog import DEFAULT_WATCHDOG_TIMEOUT_S
from dist_ckpt.errors import (
    ArgumentTypeError,
    CheckpointingException,
    LoadMismatchError,
    ShardingIntegrityError,
    format_keys,
    with_article,
)
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor, StateDict
from dist_ckpt.model.stored_metadata import shaped
from dist_ckpt.record.commit import METADATA_FILENAME, check_is_distributed_checkpoint
from dist_ckpt.storage.host_memory import check_budget, host_memory_budget
from dist_ckpt.storage.location import resolve_location
from dist_ckpt.training.async_saves import PendingSaves
from dist_ckpt.training.dtensor_shards import to_sharded_tensor
from dist_ckpt.training.load_targets import LoadTarget, fill_for_validation, find_holes, finish_targets, make_target

logger = logging.getLogger(__name__)

PathOrStr = Union[str, "os.PathLike[str]"]
T = TypeVar("T")

__all__ = ["CheckpointMetadata", "Checkpointer", "TensorMetadata"]


@dataclass(frozen=True)
class TensorMetadata:
    """Global shape and dtype of one stored tensor."""

    shape: Tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class CheckpointMetadata:
    """The stored tensors of a checkpoint, by key."""

    tensors: Mapping[str, TensorMetadata]


def _metadata_of(sharded: Mapping[str, ShardedTensor]) -> CheckpointMetadata:
    return CheckpointMetadata(
        {k: TensorMetadata(tuple(sh.global_shape), sh.dtype) for k, sh in sorted(sharded.items())}
    )


def _maybe_collective(no_dist: bool, step: str, fn: Callable[[], T]) -> T:
    """``fn()`` alone with ``no_dist``, else on every rank with errors raised everywhere."""
    return fn() if no_dist else run_collectively(step, fn)


def _check_arguments(method: str, dir: Any, state_dict: Any) -> None:
    """Raise [`ArgumentTypeError`][dist_ckpt.errors.ArgumentTypeError] unless ``dir`` is a path and
    ``state_dict`` a mapping: ``Checkpointer`` takes the directory first, the reverse of
    ``dist_ckpt.save(state_dict, checkpoint_dir)``, so swapped arguments are the likely mistake
    (without this check they fail deep inside with an ``AttributeError``)."""
    is_path = isinstance(dir, (str, os.PathLike))
    is_mapping = isinstance(state_dict, Mapping)
    if is_path and is_mapping:
        return
    call = f"Checkpointer.{method}(dir, state_dict)"
    if isinstance(dir, Mapping) and isinstance(state_dict, (str, os.PathLike)):
        raise ArgumentTypeError(
            f"[rank {get_rank()}] {call}: the arguments are swapped -- dir is {with_article(type(dir).__name__)} and "
            f"state_dict is the path {os.fspath(state_dict)!r}. Checkpointer takes the directory first, "
            f"dist_ckpt.save(state_dict, checkpoint_dir) the state dict first: call "
            f"{method}({os.fspath(state_dict)!r}, state_dict) or pass them by keyword, "
            f"{method}(dir=..., state_dict=...)"
        )
    if not is_path:
        raise ArgumentTypeError(
            f"[rank {get_rank()}] {call}: dir must be a path (str or os.PathLike), got {type(dir).__name__}"
        )
    raise ArgumentTypeError(
        f"[rank {get_rank()}] {call} into {os.fspath(dir)!r}: state_dict must be a mapping of key -> tensor, "
        f"got {type(state_dict).__name__}"
    )


class Checkpointer:
    """Saves and loads flat state dicts of tensors, and reads checkpoints whole.

    Values may be plain tensors (taken as replicated: rank 0 writes them), DTensors (each rank
    writes its shard; see `dist_ckpt.training.dtensor_shards`) or
    [`ShardedTensor`][dist_ckpt.model.sharded.ShardedTensor]s. Loads are in place. For a model and its optimizer use
    [`save_model_and_optim_state()`][dist_ckpt.training.model_optim.save_model_and_optim_state].

    Saves may be asynchronous (``save(..., async_save=True)``): they return after a snapshot of
    the tensors, the files are written by one background process per rank (started at the first
    such save), and [`maybe_finalize_async_saves()`][.maybe_finalize_async_saves] -- called by every rank, e.g. every
    step -- commits the saves every rank has written, in order; [`close()`][.close] waits for the rest.
    Until then a checkpoint is not committed (see `dist_ckpt.training.async_saves`).

    Args:
        save_strategy: sharded save strategy for [`save()`][.save] (None: dist_ckpt's default).
        load_strategy: sharded load strategy (None: the one registered for the checkpoint's
            backend). With ``no_dist=True`` it must not communicate (built-in backends don't).
        progress: called with a [`ProgressEvent`][dist_ckpt.engine.report.ProgressEvent] as each step of a save
            or load starts and ends (see [`dist_ckpt.save()`][dist_ckpt.engine.save.save]).
        watchdog_timeout_s: log a WARNING naming the rank and step when a step of a save or load
            lasts longer than this; None disables the watchdog (see
            [`dist_ckpt.engine.watchdog`][dist_ckpt.engine.watchdog]).
        writer_timeout_s: for asynchronous saves, how long a background writer may take to
            start, or go without making progress, before its save fails (see
            [`AsyncCallsQueue`][dist_ckpt.asynchronous.queue.AsyncCallsQueue]).
        host_memory_budget_bytes: the host-memory budget of every save and load of this
            checkpointer (None: the process's; see [`dist_ckpt.storage.host_memory`][dist_ckpt.storage.host_memory]).

    Example:

    ```python
    ckpt = Checkpointer()
    ckpt.save("ckpt", {"w": w, "emb": emb_dtensor})
    ckpt.load("ckpt", {"w": w, "emb": emb_dtensor})
    ckpt.get_metadata("ckpt").tensors["w"].shape

    ckpt.save("ckpt2", {"w": w}, async_save=True)    # returns after a snapshot
    w.add_(1.0)                                      # the checkpoint keeps the old values
    ckpt.maybe_finalize_async_saves(blocking=True)   # ["ckpt2"]: committed on every rank
    ```
    """

    METADATA_FILENAME: ClassVar[str] = METADATA_FILENAME

    def __init__(
        self,
        save_strategy: StrategySpec = None,
        load_strategy: StrategySpec = None,
        *,
        progress: Optional[ProgressCallback] = None,
        watchdog_timeout_s: Optional[float] = DEFAULT_WATCHDOG_TIMEOUT_S,
        writer_timeout_s: float = DEFAULT_WRITER_TIMEOUT_S,
        host_memory_budget_bytes: Optional[int] = None,
    ) -> None:
        self.save_strategy = save_strategy
        self.host_memory_budget_bytes = check_budget(host_memory_budget_bytes)
        self.load_strategy = load_strategy
        self.progress = progress
        self.watchdog_timeout_s = watchdog_timeout_s
        self._pending = PendingSaves(writer_timeout_s)
        # the strategy of asynchronous saves, resolved once: it keeps its snapshot buffer
        self._async_strategy: Optional[Strategy] = None

    # ------------------------------------------------------------------ save

    def save(
        self, dir: PathOrStr, state_dict: Mapping[str, Any], save_overwrite: bool = False, *, async_save: bool = False
    ) -> CheckpointMetadata:
        """Save ``state_dict`` (collective: every rank passes the same keys).

        The directory comes first (OLMo-core's order), unlike ``dist_ckpt.save(state_dict,
        checkpoint_dir)``; keywords work in any order: ``save(state_dict=sd, dir="ckpt")``.

        Args:
            dir: checkpoint directory.
            state_dict: ``{key: tensor | DTensor | ShardedTensor}``.
            save_overwrite: replace a committed checkpoint in ``dir`` (otherwise
                [`CheckpointExistsError`][dist_ckpt.errors.CheckpointExistsError]).
            async_save: return once the tensors are snapshotted; the checkpoint is committed by
                [`maybe_finalize_async_saves()`][..maybe_finalize_async_saves] (see [`save_sharded()`][..save_sharded]).

        Returns:
            The saved tensors' global shapes and dtypes.

        Raises:
            ArgumentTypeError: ``dir`` is not a path or ``state_dict`` not a mapping -- e.g. the
                two swapped -- on every rank, before anything is written.

        Example:

        ```python
        Checkpointer().save("ckpt/emb", {"emb": model.emb.weight})
        ```
        """

        def describe() -> Dict[str, ShardedTensor]:
            _check_arguments("save", dir, state_dict)
            return _flat_sharded(state_dict)

        sharded = run_collectively("describing the tensors to save", describe)
        self._save_sharded(dir, dict(sharded), save_overwrite, async_save)
        return _metadata_of({sh.key: sh for sh in sharded.values()})

    def save_sharded(
        self,
        dir: PathOrStr,
        sharded_state_dict: ShardedStateDict,
        save_overwrite: bool = False,
        *,
        async_save: bool = False,
    ) -> None:
        """Save an already sharded state dict (collective).

        Steps:

        1. With ``async_save``, refuse ``dir`` while an asynchronous save into it is not
           finalized ([`CheckpointExistsError`][dist_ckpt.errors.CheckpointExistsError] on every rank).
        2. With ``save_overwrite``, rank 0 de-commits (``metadata.json`` first) and removes a
           committed checkpoint in ``dir``.
        3. [`dist_ckpt.save()`][dist_ckpt.engine.save.save] with this checkpointer's save strategy; with ``async_save``,
           [`async_save_request()`][..async_save_request] (up to the snapshot of the tensors), and the request --
           write in the background, then commit -- is scheduled on this checkpointer's queue.

        Raises:
            ArgumentTypeError: ``dir`` is not a path or ``sharded_state_dict`` not a mapping (e.g.
                passed in ``dist_ckpt.save``'s order), on every rank, before anything is written.
        """
        run_collectively("checking the arguments", lambda: _check_arguments("save_sharded", dir, sharded_state_dict))
        self._save_sharded(dir, sharded_state_dict, save_overwrite, async_save)

    def _save_sharded(
        self, dir: PathOrStr, sharded_state_dict: ShardedStateDict, save_overwrite: bool, async_save: bool
    ) -> None:
        """[`save_sharded()`][..save_sharded] once its arguments are checked."""
        path = Path(dir)
        if async_save:
            run_collectively("checking the asynchronous saves in flight", lambda: self._pending.check_free(dir))
            self._pending.schedule(self._async_save_request(dir, sharded_state_dict, save_overwrite), dir)
            return
        _maybe_remove_committed(path, save_overwrite)
        save(
            sharded_state_dict,
            path,
            sharded_strategy=self.save_strategy,
            progress=self.progress,
            watchdog_timeout_s=self.watchdog_timeout_s,
            host_memory_budget_bytes=self.host_memory_budget_bytes,
        )

    def async_save_request(
        self, dir: PathOrStr, sharded_state_dict: ShardedStateDict, save_overwrite: bool = False
    ) -> AsyncRequest:
        """Save an already sharded state dict asynchronously, up to the snapshot of its tensors
        (collective), and return the request that writes and commits it, not scheduled.

        It is Megatron-Core's ``save(..., async_sharded_save=True)`` with this checkpointer's
        strategy -- resolved once and reused, so that its snapshot buffer is too -- for a caller
        with its own [`AsyncCallsQueue`][dist_ckpt.asynchronous.queue.AsyncCallsQueue];
        [`save_sharded()`][..save_sharded] with ``async_save=True`` schedules it on this checkpointer's queue.
        With ``save_overwrite``, a committed checkpoint in ``dir`` is removed now.

        Raises:
            IncompatibleStrategyError: the save strategy cannot save asynchronously (the
                default, safetensors, can), on every rank, before anything is written.
            ArgumentTypeError: ``dir`` is not a path or ``sharded_state_dict`` not a mapping, on
                every rank, before anything is written.
        """
        run_collectively(
            "checking the arguments", lambda: _check_arguments("async_save_request", dir, sharded_state_dict)
        )
        return self._async_save_request(dir, sharded_state_dict, save_overwrite)

    def _async_save_request(
        self, dir: PathOrStr, sharded_state_dict: ShardedStateDict, save_overwrite: bool
    ) -> AsyncRequest:
        """[`async_save_request()`][..async_save_request] once its arguments are checked."""
        path = Path(dir)
        _maybe_remove_committed(path, save_overwrite)
        if self._async_strategy is None:
            self._async_strategy = run_collectively(
                "choosing the save strategy",
                lambda: resolve_strategy(self.save_strategy, StrategyAction.SAVE_SHARDED, DEFAULT_SHARDED_BACKEND),
            )
        request = save(
            sharded_state_dict,
            path,
            sharded_strategy=self._async_strategy,
            async_sharded_save=True,
            progress=self.progress,
            watchdog_timeout_s=self.watchdog_timeout_s,
            host_memory_budget_bytes=self.host_memory_budget_bytes,
        )
        if request is None:  # save(async_sharded_save=True) always returns one
            raise CheckpointingException(
                f"[rank {get_rank()}] the asynchronous save of {str(dir)!r} returned no request"
            )
        return request

    # ------------------------------------------------------------------ asynchronous saves

    @property
    def pending_async_saves(self) -> List[str]:
        """The directories of the asynchronous saves not finalized yet, oldest first."""
        return self._pending.directories

    def maybe_finalize_async_saves(self, blocking: bool = False) -> List[str]:
        """Commit the asynchronous saves that every rank's writer finished, oldest first.

        Collective: every rank calls it, equally often (e.g. once per training step); with
        ``blocking``, it waits for every pending save. Each save is committed -- its
        ``metadata.json`` written, so that ``find_latest_checkpoint`` returns it and rotation
        counts it -- only here, once every rank wrote its files.

        Returns:
            The directories committed by this call (as passed to [`save()`][..save]), the same on
            every rank: the place to rotate, record metrics or report.

        Raises:
            AsyncSaveError: a rank's writer failed (an exception, killed, or stuck past
                ``writer_timeout_s``): raised on every rank, naming the rank and the cause; that
                save is not committed.

        Example:

        ```python
        for path in ckpt.maybe_finalize_async_saves():
            if rank == 0:
                maybe_delete_oldest_checkpoint("runs/gpt", max_checkpoints=3)
        ```
        """
        return self._pending.maybe_finalize(blocking)

    def close(self, abort: bool = False) -> List[str]:
        """Commit every pending asynchronous save (collective, waiting for the writers) and stop
        the writer processes; returns the directories committed. With ``abort``, the pending
        saves are dropped uncommitted. A later asynchronous save starts new writers.
        """
        return self._pending.close(abort)

    # ------------------------------------------------------------------ load

    def load(
        self,
        dir: PathOrStr,
        state_dict: Mapping[str, Any],
        no_dist: bool = False,
        metadata: Optional[CheckpointMetadata] = None,
        *,
        validate: bool = False,
    ) -> None:
        """Load ``state_dict``'s tensors in place from ``dir``.

        Args:
            dir: a checkpoint directory.
            state_dict: ``{key: tensor | DTensor | ShardedTensor}``; each tensor (or DTensor's
                local shard, or ShardedTensor's ``data``) is filled in place.
            no_dist: read without any communication (each process alone).
            metadata: the checkpoint's metadata if already known (saves reading it).
            validate: NaN-fill floating-point targets first and raise
                [`ShardingIntegrityError`][dist_ckpt.errors.ShardingIntegrityError] if any element stays unloaded.

        Example:

        ```python
        Checkpointer().load("ckpt/emb", {"emb": model.emb.weight})
        ```
        """
        _maybe_collective(no_dist, "checking the arguments", lambda: _check_arguments("load", dir, state_dict))
        if metadata is None:
            metadata = self.get_metadata(dir, no_dist=no_dist)
        known = metadata.tensors

        def plan() -> List[LoadTarget]:
            targets = []
            for name, value in state_dict.items():
                key = value.key if isinstance(value, ShardedTensor) else name
                if key not in known:
                    raise CheckpointingException(
                        f"[rank {get_rank()}] {key!r} is not in checkpoint {str(dir)!r}; it holds {format_keys(known)}"
                    )
                if isinstance(value, ShardedTensor):
                    if value.data is None:
                        raise CheckpointingException(
                            f"[rank {get_rank()}] ShardedTensor {key!r} has no data to load into"
                        )
                    targets.append(LoadTarget(key, value.data, value, in_place=True))
                elif isinstance(value, torch.Tensor):
                    if tuple(value.shape) != known[key].shape:
                        raise LoadMismatchError(
                            f"[rank {get_rank()}] {key!r} has shape {tuple(value.shape)}, but checkpoint "
                            f"{str(dir)!r} stores shape {known[key].shape} ({known[key].dtype})"
                        )
                    targets.append(make_target(key, value, known[key].dtype))
                else:
                    raise CheckpointingException(
                        f"[rank {get_rank()}] {name!r} is {with_article(type(value).__name__)}; Checkpointer "
                        "loads tensors only"
                    )
            return targets

        targets = _maybe_collective(no_dist, "planning the load", plan)
        self.load_targets(dir, targets, validate=validate, no_dist=no_dist)

    def load_targets(
        self, dir: PathOrStr, targets: Sequence[LoadTarget], validate: bool, no_dist: bool = False
    ) -> None:
        """Fill ``targets`` from ``dir`` (collective unless ``no_dist``).

        Steps:

        1. With ``validate``, fill the destinations with NaN.
        2. Load (``dist_ckpt.load``; with ``no_dist`` the load strategy alone).
        3. Copy values that were not loaded in place into their destinations.
        4. With ``validate``, raise [`ShardingIntegrityError`][dist_ckpt.errors.ShardingIntegrityError] naming every key
           where NaN remains (on every rank).
        """
        location = resolve_location(dir)
        request = {f"t{i}": t.sharded for i, t in enumerate(targets)}
        # 1. sentinel
        if validate:
            fill_for_validation(targets)
        # 2. load
        if no_dist:
            strategy, _ = verify_checkpoint_and_load_strategy(location, self.load_strategy)
            with host_memory_budget(self.host_memory_budget_bytes):
                loaded: StateDict = strategy.load(request, location)
        else:
            loaded = load_with_report(
                request,
                location,
                sharded_strategy=self.load_strategy,
                progress=self.progress,
                watchdog_timeout_s=self.watchdog_timeout_s,
                host_memory_budget_bytes=self.host_memory_budget_bytes,
            ).state_dict

        # 3. copy back, 4. check coverage
        def finish() -> None:
            finish_targets(targets, [loaded[k] for k in request])
            holes = find_holes(targets) if validate else []
            if holes:
                raise ShardingIntegrityError(
                    f"[rank {get_rank()}] loading from {location.url!r} left elements unloaded (still NaN) in "
                    f"{', '.join(holes[:10])}{' ...' if len(holes) > 10 else ''}: the checkpoint does not cover "
                    f"them. If the checkpoint legitimately stores NaN, load with validate=False"
                )

        _maybe_collective(no_dist, "checking the loaded tensors", finish)

    # ------------------------------------------------------------------ read whole

    def unshard(
        self, dir: PathOrStr, device: Optional[torch.device] = None, rank0_only: bool = False, no_dist: bool = False
    ) -> Dict[str, torch.Tensor]:
        """Every stored tensor, whole, keyed by checkpoint key.

        Args:
            dir: a checkpoint directory.
            device: where to put the tensors (default CPU).
            rank0_only: only rank 0 reads; other ranks get ``{}``.
            no_dist: read in this process without any communication (overrides ``rank0_only``).

        Example:

        ```python
        full = Checkpointer().unshard("ckpt", no_dist=True)
        ```
        """
        return self.read_full_tensors(dir, lambda key: True, device, rank0_only, no_dist)

    def read_full_tensors(
        self,
        dir: PathOrStr,
        select: Callable[[str], bool],
        device: Optional[torch.device] = None,
        rank0_only: bool = False,
        no_dist: bool = False,
    ) -> Dict[str, torch.Tensor]:
        """The whole stored tensors whose key ``select`` accepts (see [`unshard()`][..unshard]).

        Only the selected tensors are read (unlike ``dist_ckpt.load_plain_tensors``, which
        reads all of them on every rank), so unsharding a model does not load its optimizer.
        """
        location = resolve_location(dir)

        def read() -> Dict[str, torch.Tensor]:
            if rank0_only and not no_dist and get_rank() != 0:
                return {}
            strategy, _ = verify_checkpoint_and_load_strategy(location, self.load_strategy)
            stored = strategy.load_tensors_metadata(location)
            request = {k: shaped(sh) for k, sh in stored.items() if isinstance(sh, ShardedTensor) and select(k)}
            loaded = strategy.load(request, location) if request else {}
            return {k: v if device is None else v.to(device) for k, v in sorted(loaded.items())}

        return _maybe_collective(no_dist, "reading whole tensors", read)

    def get_metadata(self, dir: PathOrStr, no_dist: bool = False) -> CheckpointMetadata:
        """Key, global shape and dtype of every stored tensor (collective unless ``no_dist``).

        Example:

        ```python
        meta = Checkpointer().get_metadata("ckpt")
        meta.tensors["model.fc.weight"]      # TensorMetadata(shape=(7, 5), dtype=torch.float32)
        ```
        """
        return _maybe_collective(
            no_dist,
            "reading the checkpoint metadata",
            lambda: _metadata_of(load_tensors_metadata(Path(dir), self.load_strategy)),
        )


def _flat_sharded(state_dict: Mapping[str, Any]) -> Dict[str, ShardedTensor]:
    out = {}
    for key, value in state_dict.items():
        if isinstance(value, ShardedTensor):
            out[key] = value
        elif isinstance(value, torch.Tensor):
            out[key] = to_sharded_tensor(key, value)
        else:
            raise CheckpointingException(
                f"[rank {get_rank()}] {key!r} is {with_article(type(value).__name__)}; Checkpointer saves tensors only "
                f"(use dist_ckpt.save for other objects)"
            )
    return out


def _remove_committed(path: Path) -> None:
    """On rank 0: remove a committed checkpoint, de-committing it first (metadata.json)."""
    if get_rank() != 0 or not check_is_distributed_checkpoint(path):
        return
    logger.info("save_overwrite: removing the checkpoint in %s", path)
    (path / METADATA_FILENAME).unlink()
    shutil.rmtree(path)


def _maybe_remove_committed(path: Path, save_overwrite: bool) -> None:
    """With ``save_overwrite``, `_remove_committed()` on rank 0 (collective)."""
    if save_overwrite:
        run_collectively("removing the checkpoint to overwrite", lambda: _remove_committed(path))
