"""Model and optimizer checkpoints in one call, with OLMo-core's names and signatures.

* :func:`save_model_and_optim_state` / :func:`load_model_and_optim_state` -- a module (plain,
  or sharded with DTensor / FSDP2 ``fully_shard``) and its ``torch.optim`` optimizer, saved at
  one world size and loaded in place at another. Keys are parameter names (see
  :mod:`dist_ckpt.training.model_state`), so the optimizer continues exactly where it stopped.
* :func:`unshard_model_state` / :func:`unshard_optim_state` -- whole tensors in one process.
* :class:`Checkpointer` -- the same for a flat ``{key: tensor}`` dict, plus metadata.

Everything is collective (all ranks call it together) unless ``no_dist=True``; an error on any
rank is raised on every rank. Without a process group the world is one process.

Differences from OLMo-core: saves return the checkpoint's tensor metadata (or None), not the
files each rank wrote -- dist_ckpt backends decide the files; ``Checkpointer.unshard`` has no
``num_threads``; the backend is chosen by ``Checkpointer(save_strategy=..., load_strategy=...)``
(or the ``*_strategy`` keyword of the functions), the default being dist_ckpt's.

Example::

    save_model_and_optim_state("ckpt/step_100", model, optim)          # e.g. at 4 ranks
    load_model_and_optim_state("ckpt/step_100", model2, optim2)        # e.g. at 2 ranks
    full = unshard_model_state("ckpt/step_100", no_dist=True)          # {fqn: tensor}
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import torch

from dist_ckpt.engine.checks.compatibility import verify_checkpoint_and_load_strategy
from dist_ckpt.engine.commit import METADATA_FILENAME, check_is_distributed_checkpoint
from dist_ckpt.engine.distributed import get_rank, run_collectively
from dist_ckpt.engine.load import load_with_report
from dist_ckpt.engine.load_parts import load_common_state_dict, load_tensors_metadata
from dist_ckpt.engine.registry import StrategySpec
from dist_ckpt.engine.report import ProgressCallback
from dist_ckpt.engine.save import save
from dist_ckpt.engine.watchdog import DEFAULT_WATCHDOG_TIMEOUT_S
from dist_ckpt.errors import CheckpointingException, LoadMismatchError, ShardingIntegrityError, format_keys
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor, StateDict
from dist_ckpt.storage.location import resolve_location
from dist_ckpt.training.dtensor_shards import to_sharded_tensor
from dist_ckpt.training.load_targets import LoadTarget, fill_for_validation, find_holes, finish_targets, make_target
from dist_ckpt.training.model_state import (
    MODEL_PREFIX,
    OPTIM_STATE_PREFIX,
    OptimStateDict,
    model_optim_state_dict,
    plan_model_load,
    plan_optim_load,
    unsharded_optim_state,
)

logger = logging.getLogger(__name__)

PathOrStr = Union[str, "os.PathLike[str]"]
T = TypeVar("T")

__all__ = [
    "CheckpointMetadata",
    "Checkpointer",
    "TensorMetadata",
    "load_model_and_optim_state",
    "save_model_and_optim_state",
    "unshard_model_state",
    "unshard_optim_state",
]


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


class Checkpointer:
    """Saves and loads flat state dicts of tensors, and reads checkpoints whole.

    Values may be plain tensors (taken as replicated: rank 0 writes them), DTensors (each rank
    writes its shard; see :mod:`dist_ckpt.training.dtensor_shards`) or :class:`ShardedTensor`\\ s.
    Loads are in place. For a model and its optimizer use :func:`save_model_and_optim_state`.

    Args:
        save_strategy: sharded save strategy for :meth:`save` (None: dist_ckpt's default).
        load_strategy: sharded load strategy (None: the one registered for the checkpoint's
            backend). With ``no_dist=True`` it must not communicate (built-in backends don't).
        progress: called with a :class:`~dist_ckpt.engine.report.ProgressEvent` as each step of a save
            or load starts and ends (see :func:`dist_ckpt.save`).
        watchdog_timeout_s: log a WARNING naming the rank and step when a step of a save or load
            lasts longer than this; None disables the watchdog (see :mod:`dist_ckpt.engine.watchdog`).

    Example::

        ckpt = Checkpointer()
        ckpt.save("ckpt", {"w": w, "emb": emb_dtensor})
        ckpt.load("ckpt", {"w": w, "emb": emb_dtensor})
        ckpt.get_metadata("ckpt").tensors["w"].shape
    """

    METADATA_FILENAME: ClassVar[str] = METADATA_FILENAME

    def __init__(
        self,
        save_strategy: StrategySpec = None,
        load_strategy: StrategySpec = None,
        *,
        progress: Optional[ProgressCallback] = None,
        watchdog_timeout_s: Optional[float] = DEFAULT_WATCHDOG_TIMEOUT_S,
    ) -> None:
        self.save_strategy = save_strategy
        self.load_strategy = load_strategy
        self.progress = progress
        self.watchdog_timeout_s = watchdog_timeout_s

    # ------------------------------------------------------------------ save

    def save(self, dir: PathOrStr, state_dict: Mapping[str, Any], save_overwrite: bool = False) -> CheckpointMetadata:
        """Save ``state_dict`` (collective: every rank passes the same keys).

        Args:
            dir: checkpoint directory.
            state_dict: ``{key: tensor | DTensor | ShardedTensor}``.
            save_overwrite: replace a committed checkpoint in ``dir`` (otherwise
                :class:`~dist_ckpt.errors.CheckpointExistsError`).

        Returns:
            The saved tensors' global shapes and dtypes.

        Example::

            Checkpointer().save("ckpt/emb", {"emb": model.emb.weight})
        """
        sharded = run_collectively("describing the tensors to save", lambda: _flat_sharded(state_dict))
        self.save_sharded(dir, dict(sharded), save_overwrite)
        return _metadata_of({sh.key: sh for sh in sharded.values()})

    def save_sharded(self, dir: PathOrStr, sharded_state_dict: ShardedStateDict, save_overwrite: bool = False) -> None:
        """Save an already sharded state dict (collective).

        Steps:

        1. With ``save_overwrite``, rank 0 de-commits (``metadata.json`` first) and removes a
           committed checkpoint in ``dir``.
        2. :func:`dist_ckpt.save` with this checkpointer's save strategy.
        """
        path = Path(dir)
        # 1. overwrite
        if save_overwrite:
            run_collectively("removing the checkpoint to overwrite", lambda: _remove_committed(path))
        # 2. save
        save(
            sharded_state_dict,
            path,
            sharded_strategy=self.save_strategy,
            progress=self.progress,
            watchdog_timeout_s=self.watchdog_timeout_s,
        )

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
                :class:`~dist_ckpt.errors.ShardingIntegrityError` if any element stays unloaded.

        Example::

            Checkpointer().load("ckpt/emb", {"emb": model.emb.weight})
        """
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
                        f"[rank {get_rank()}] {name!r} is a {type(value).__name__}; Checkpointer loads tensors only"
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
        4. With ``validate``, raise :class:`ShardingIntegrityError` naming every key where NaN
           remains (on every rank).
        """
        location = resolve_location(dir)
        request = {f"t{i}": t.sharded for i, t in enumerate(targets)}
        # 1. sentinel
        if validate:
            fill_for_validation(targets)
        # 2. load
        if no_dist:
            strategy, _ = verify_checkpoint_and_load_strategy(location, self.load_strategy)
            loaded: StateDict = strategy.load(request, location)
        else:
            loaded = load_with_report(
                request,
                location,
                sharded_strategy=self.load_strategy,
                progress=self.progress,
                watchdog_timeout_s=self.watchdog_timeout_s,
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

        Example::

            full = Checkpointer().unshard("ckpt", no_dist=True)
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
        """The whole stored tensors whose key ``select`` accepts (see :meth:`unshard`).

        Only the selected tensors are read (unlike ``dist_ckpt.load_plain_tensors``, which
        reads all of them on every rank), so unsharding a model does not load its optimizer.
        """
        location = resolve_location(dir)

        def read() -> Dict[str, torch.Tensor]:
            if rank0_only and not no_dist and get_rank() != 0:
                return {}
            strategy, _ = verify_checkpoint_and_load_strategy(location, self.load_strategy)
            request = {k: sh for k, sh in strategy.load_tensors_metadata(location).items() if select(k)}
            loaded = strategy.load(request, location) if request else {}
            return {k: v if device is None else v.to(device) for k, v in sorted(loaded.items())}

        return _maybe_collective(no_dist, "reading whole tensors", read)

    def get_metadata(self, dir: PathOrStr, no_dist: bool = False) -> CheckpointMetadata:
        """Key, global shape and dtype of every stored tensor (collective unless ``no_dist``).

        Example::

            meta = Checkpointer().get_metadata("ckpt")
            meta.tensors["model.fc.weight"]      # TensorMetadata(shape=(7, 5), dtype=torch.float32)
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
                f"[rank {get_rank()}] {key!r} is a {type(value).__name__}; Checkpointer saves tensors only "
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


# --------------------------------------------------------------------------- model + optimizer


def save_model_and_optim_state(
    dir: PathOrStr,
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    save_overwrite: bool = False,
    *,
    save_strategy: StrategySpec = None,
) -> None:
    """Save ``model``'s and ``optim``'s state (collective) to load at any world size.

    ``model`` may be plain (replicated on every rank; rank 0 writes it) or sharded with DTensor
    / FSDP2 (each rank writes its shard). Keys are parameter names (see
    :mod:`dist_ckpt.training.model_state`).

    Args:
        dir: checkpoint directory.
        model: the model.
        optim: its optimizer (every parameter must belong to ``model``).
        save_overwrite: replace a committed checkpoint in ``dir``.
        save_strategy: sharded save strategy (None: dist_ckpt's default backend).

    Example::

        save_model_and_optim_state("ckpt/step_100", model, optim)
    """
    sd = run_collectively("describing the model and optimizer", lambda: model_optim_state_dict(model, optim))
    Checkpointer(save_strategy=save_strategy).save_sharded(dir, sd, save_overwrite)


def load_model_and_optim_state(
    dir: PathOrStr,
    model: torch.nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    validate: bool = True,
    *,
    load_strategy: StrategySpec = None,
) -> None:
    """Load a checkpoint of :func:`save_model_and_optim_state` into ``model`` (and ``optim``)
    in place, whatever the world size and sharding at save time (collective).

    Steps:

    1. Read the checkpoint's tensor metadata and common state.
    2. Match the model's entries (and the optimizer's parameters, by name) with the checkpoint;
       allocate the optimizer state as saved. A mismatch raises on every rank.
    3. Load every tensor in place (NaN-filled first and checked afterwards with ``validate``).
    4. Hand the optimizer its state and hyperparameters (``optim.load_state_dict``).

    Args:
        dir: the checkpoint directory.
        model: the model to load into (plain, or sharded with DTensor / FSDP2).
        optim: its optimizer, or None to load the model only.
        validate: check that every floating-point element was loaded (see
            :mod:`dist_ckpt.training.load_targets`; integer tensors are not NaN-checked).
        load_strategy: sharded load strategy (None: the checkpoint's registered backend).

    Raises:
        KeyMismatchError: entries missing from the checkpoint or the model/optimizer.
        LoadMismatchError: shapes or optimizer param groups that differ.
        ShardingIntegrityError: with ``validate``, elements that stayed unloaded.

    Mismatches are found in step 2, before any tensor is touched. An error in step 3 leaves
    the model partially loaded (NaN where ``validate`` filled it) and the optimizer unchanged.

    Example::

        load_model_and_optim_state("ckpt/step_100", model, optim)
    """
    path = str(dir)
    checkpointer = Checkpointer(load_strategy=load_strategy)

    # 1. metadata and common state
    def read() -> Tuple[Dict[str, ShardedTensor], StateDict]:
        return dict(load_tensors_metadata(path, load_strategy)), load_common_state_dict(path)

    tensors_metadata, common = run_collectively("reading the checkpoint metadata", read)

    # 2. match and allocate
    def plan() -> Tuple[List[LoadTarget], Any]:
        targets = plan_model_load(model, tensors_metadata, common, path)
        optim_plan = None if optim is None else plan_optim_load(model, optim, tensors_metadata, common, path)
        return targets + ([] if optim_plan is None else optim_plan.targets), optim_plan

    targets, optim_plan = run_collectively("matching the model and optimizer with the checkpoint", plan)

    # 3. tensors
    checkpointer.load_targets(path, targets, validate=validate)

    # 4. optimizer state and hyperparameters
    if optim is not None and optim_plan is not None:
        run_collectively("loading the optimizer state", lambda: optim.load_state_dict(optim_plan.torch_state_dict()))


def unshard_model_state(
    dir: PathOrStr, device: Optional[torch.device] = None, rank0_only: bool = False, no_dist: bool = False
) -> Dict[str, torch.Tensor]:
    """The whole model state of a :func:`save_model_and_optim_state` checkpoint, by FQN.

    Args:
        dir: the checkpoint directory.
        device: where to put the tensors (default CPU).
        rank0_only: only rank 0 reads; other ranks get ``{}`` (collective).
        no_dist: read in this process, without any communication.

    Example::

        sd = unshard_model_state("ckpt/step_100", no_dist=True)
        plain_model.load_state_dict(sd)
    """
    full = Checkpointer().read_full_tensors(dir, lambda k: k.startswith(MODEL_PREFIX), device, rank0_only, no_dist)
    return {k[len(MODEL_PREFIX) :]: v for k, v in full.items()}


def unshard_optim_state(
    dir: PathOrStr, device: Optional[torch.device] = None, rank0_only: bool = False, no_dist: bool = False
) -> OptimStateDict:
    """The whole optimizer state of a :func:`save_model_and_optim_state` checkpoint.

    A ``torch.optim`` style dict keyed by parameter FQN: ``{"state": {fqn: {"step": ...,
    "exp_avg": tensor, ...}}, "param_groups": [{"lr": ..., "params": [fqn, ...]}, ...]}``.

    Args:
        dir: the checkpoint directory.
        device: where to put the tensors (default CPU).
        rank0_only: only rank 0 reads; other ranks get ``{"state": {}, "param_groups": []}``.
        no_dist: read in this process, without any communication.

    Example::

        osd = unshard_optim_state("ckpt/step_100", no_dist=True)
        osd["state"]["fc.weight"]["exp_avg"].shape
    """
    path = str(dir)
    full = Checkpointer().read_full_tensors(
        path, lambda k: k.startswith(OPTIM_STATE_PREFIX), device, rank0_only, no_dist
    )

    def assemble() -> OptimStateDict:
        if rank0_only and not no_dist and get_rank() != 0:
            return OptimStateDict(state={}, param_groups=[])
        common = load_common_state_dict(path)
        osd = unsharded_optim_state(full, common, path)
        if device is not None:
            osd["state"] = {
                fqn: {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in entries.items()}
                for fqn, entries in osd["state"].items()
            }
        return osd

    return _maybe_collective(no_dist, "assembling the optimizer state", assemble)
