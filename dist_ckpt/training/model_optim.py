"""A model and its optimizer in one call, with OLMo-core's names and signatures.

* [`save_model_and_optim_state()`][dist_ckpt.training.model_optim.save_model_and_optim_state] /
  [`load_model_and_optim_state()`][dist_ckpt.training.model_optim.load_model_and_optim_state] -- a module (plain, or
  sharded with DTensor / FSDP2 ``fully_shard``) and its ``torch.optim`` optimizer, saved at one world size and loaded in
  place at another. Keys are parameter names (see `dist_ckpt.training.model_state`), so the optimizer continues exactly
  where it stopped. Names are those of the unwrapped model, as ``torch.distributed.checkpoint``'s
  ``get_state_dict`` makes them: save a ``DistributedDataParallel`` or ``torch.compile`` model
  and load into the plain one, or the reverse.
* [`async_save_model_and_optim_state()`][dist_ckpt.training.model_optim.async_save_model_and_optim_state] -- the same
  save, asynchronous: it returns after a snapshot of the tensors, as a Megatron-style
  [`AsyncRequest`][dist_ckpt.asynchronous.queue.AsyncRequest] to schedule on an
  [`AsyncCallsQueue`][dist_ckpt.asynchronous.queue.AsyncCallsQueue]; the checkpoint is committed when the queue
  finalizes it on every rank.
* [`unshard_model_state()`][dist_ckpt.training.model_optim.unshard_model_state] /
  [`unshard_optim_state()`][dist_ckpt.training.model_optim.unshard_optim_state] -- whole tensors in one process.

They are built on [`Checkpointer`][dist_ckpt.training.checkpointer.Checkpointer]. Everything is
collective (all ranks call it together) unless ``no_dist=True``; an error on any rank is raised
on every rank. Without a process group the world is one process.

Differences from OLMo-core: saves return None, not the files each rank wrote -- dist_ckpt
backends decide the files; the asynchronous save returns Megatron-Core's request (finalized by
a queue, collectively) rather than a future; the backend is chosen by the ``*_strategy``
keyword, the default being dist_ckpt's.

Example:

```python
save_model_and_optim_state("ckpt/step_100", model, optim)          # e.g. at 4 ranks
load_model_and_optim_state("ckpt/step_100", model2, optim2)        # e.g. at 2 ranks
full = unshard_model_state("ckpt/step_100", no_dist=True)          # {fqn: tensor}

request = async_save_model_and_optim_state("ckpt/step_200", model, optim)  # after a snapshot
queue.schedule_async_request(request)                              # queue = AsyncCallsQueue()
queue.maybe_finalize_async_calls(blocking=False)                   # every rank; commits when written
```
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from dist_ckpt.asynchronous.queue import AsyncRequest
from dist_ckpt.backends.registry import StrategySpec
from dist_ckpt.collectives.distributed import get_rank, run_collectively
from dist_ckpt.engine.load_parts import load_common_state_dict, load_tensors_metadata
from dist_ckpt.model.sharded import ShardedTensor, StateDict
from dist_ckpt.training.checkpointer import Checkpointer, PathOrStr
from dist_ckpt.training.load_targets import LoadTarget
from dist_ckpt.training.model_state import (
    MODEL_PREFIX,
    OPTIM_STATE_PREFIX,
    ModelEntries,
    OptimStateDict,
    model_entries,
    model_optim_state_dict,
    plan_model_load,
    plan_optim_load,
    unsharded_optim_state,
)

__all__ = [
    "async_save_model_and_optim_state",
    "load_model_and_optim_state",
    "save_model_and_optim_state",
    "unshard_model_state",
    "unshard_optim_state",
]


def save_model_and_optim_state(
    dir: PathOrStr,
    model: torch.nn.Module,
    optim: Optional[torch.optim.Optimizer],
    save_overwrite: bool = False,
    *,
    save_strategy: StrategySpec = None,
    host_memory_budget_bytes: Optional[int] = None,
) -> None:
    """Save ``model``'s and ``optim``'s state (collective) to load at any world size.

    ``model`` may be plain (replicated on every rank; rank 0 writes it) or sharded with DTensor
    / FSDP2 (each rank writes its shard), and wrapped or not: keys are parameter names without
    the ``module.`` of DDP, the ``_orig_mod.`` of ``torch.compile`` or the wrapper attributes of
    FSDP1 and activation checkpointing (see `dist_ckpt.training.model_state`), for the
    optimizer state too. An FSDP1 model is saved with ``optim=None`` only.

    Args:
        dir: checkpoint directory.
        model: the model.
        optim: its optimizer (every parameter must belong to ``model``), or None to save the model
            alone.
        save_overwrite: replace a committed checkpoint in ``dir``.
        save_strategy: sharded save strategy (None: dist_ckpt's default backend).
        host_memory_budget_bytes: most extra host memory the save holds at once (None: the
            process's budget; see `dist_ckpt.storage.host_memory`).

    Example:

    ```python
    save_model_and_optim_state("ckpt/step_100", model, optim)
    ```

    See [`async_save_model_and_optim_state()`][dist_ckpt.training.model_optim.async_save_model_and_optim_state] for the
    save that returns after a snapshot.
    """
    sd = run_collectively("describing the model and optimizer", lambda: model_optim_state_dict(model, optim))
    checkpointer = Checkpointer(save_strategy=save_strategy, host_memory_budget_bytes=host_memory_budget_bytes)
    checkpointer.save_sharded(dir, sd, save_overwrite)


def async_save_model_and_optim_state(
    dir: PathOrStr,
    model: torch.nn.Module,
    optim: Optional[torch.optim.Optimizer],
    save_overwrite: bool = False,
    *,
    save_strategy: StrategySpec = None,
    host_memory_budget_bytes: Optional[int] = None,
) -> AsyncRequest:
    """Save like [`save_model_and_optim_state()`][dist_ckpt.training.model_optim.save_model_and_optim_state],
    asynchronously: return once the tensors are snapshotted, with the request that writes and commits the checkpoint
    (collective).

    The semantics are Megatron-Core's asynchronous save
    ([`AsyncCallsQueue`][dist_ckpt.asynchronous.queue.AsyncCallsQueue]): schedule the request on a queue, call
    ``queue.maybe_finalize_async_calls()`` on every rank equally often (e.g. every step) and ``queue.close()`` before
    the process group goes. Training may change the model and optimizer as soon as this returns: the checkpoint holds
    their values at the call.

    Steps:

    1. Describe the model and optimizer, as
       [`save_model_and_optim_state()`][dist_ckpt.training.model_optim.save_model_and_optim_state] does.
    2. [`dist_ckpt.save()`][dist_ckpt.engine.save.save] with ``async_sharded_save=True``: checks, the common state
       (param groups, optimizer steps) written now by rank 0, and this rank's tensors copied into a
       shared-memory snapshot.

    Then, in the queue: each rank's writer process writes its files; finalization -- collective,
    once every rank's writer finished -- commits ``metadata.json``, then runs the functions added
    with ``request.add_finalize_fn`` in order: the place for what must see the checkpoint
    committed (rotation, metrics). Until then the checkpoint is not committed:
    ``find_latest_checkpoint`` skips it, ``maybe_delete_oldest_checkpoint`` does not count it, a
    load refuses it. A writer's failure on any rank raises
    [`AsyncSaveError`][dist_ckpt.errors.AsyncSaveError] on every rank at finalization, and nothing of that
    save is committed.

    Args:
        dir: checkpoint directory.
        model: the model (as for
            [`save_model_and_optim_state()`][dist_ckpt.training.model_optim.save_model_and_optim_state]).
        optim: its optimizer, or None to save the model alone.
        save_overwrite: replace a committed checkpoint in ``dir`` (removed now, before the new
            one is written).
        save_strategy: an asynchronous sharded save strategy (None: dist_ckpt's default,
            safetensors). Passing the same strategy object to every call reuses its snapshot
            buffer instead of allocating shared memory per save.
        host_memory_budget_bytes: most bytes snapshotted (the rest is written before this
            returns; None: the process's budget; see `dist_ckpt.storage.host_memory`).

    Returns:
        The [`AsyncRequest`][dist_ckpt.asynchronous.queue.AsyncRequest], not scheduled yet.

    Raises:
        IncompatibleStrategyError: ``save_strategy`` cannot save asynchronously (e.g. zarr):
            raised on every rank, before anything is written.

    Example:

    ```python
    queue = dc.AsyncCallsQueue()                     # one writer process per rank
    request = async_save_model_and_optim_state("ckpt/step_100", model, optim)
    request.add_finalize_fn(lambda: print("ckpt/step_100 committed"))
    queue.schedule_async_request(request)
    ...                                              # training goes on
    queue.maybe_finalize_async_calls(blocking=False) # every rank, every step
    queue.close()                                    # waits for and commits the rest
    ```
    """
    sd = run_collectively("describing the model and optimizer", lambda: model_optim_state_dict(model, optim))
    checkpointer = Checkpointer(save_strategy=save_strategy, host_memory_budget_bytes=host_memory_budget_bytes)
    return checkpointer.async_save_request(dir, sd, save_overwrite)


def load_model_and_optim_state(
    dir: PathOrStr,
    model: torch.nn.Module,
    optim: Optional[torch.optim.Optimizer] = None,
    validate: bool = True,
    *,
    load_strategy: StrategySpec = None,
) -> None:
    """Load a checkpoint of [`save_model_and_optim_state()`][dist_ckpt.training.model_optim.save_model_and_optim_state]
    into ``model`` (and ``optim``) in place, whatever the world size and sharding at save time (collective).

    Steps:

    1. Read the checkpoint's tensor metadata and common state.
    2. Match the model's entries (and the optimizer's parameters, by name) with the checkpoint;
       allocate the optimizer state as saved. A mismatch raises on every rank.
    3. Load every tensor in place (NaN-filled first and checked afterwards with ``validate``).
    4. Hand the optimizer its state and hyperparameters (``optim.load_state_dict``).

    Args:
        dir: the checkpoint directory.
        model: the model to load into (plain, or sharded with DTensor / FSDP2; wrapped in DDP,
            ``torch.compile`` or FSDP1 or not, whatever the saved model was).
        optim: its optimizer, or None to load the model only.
        validate: check that every floating-point element was loaded (see
            `dist_ckpt.training.load_targets`; integer tensors are not NaN-checked).
        load_strategy: sharded load strategy (None: the checkpoint's registered backend).

    Raises:
        KeyMismatchError: entries missing from the checkpoint or the model/optimizer.
        LoadMismatchError: shapes or optimizer param groups that differ.
        ShardingIntegrityError: with ``validate``, elements that stayed unloaded.

    Mismatches are found in step 2, before any tensor is touched. An error in step 3 leaves
    the model partially loaded (NaN where ``validate`` filled it) and the optimizer unchanged.

    Example:

    ```python
    load_model_and_optim_state("ckpt/step_100", model, optim)
    ```
    """
    path = str(dir)
    checkpointer = Checkpointer(load_strategy=load_strategy)

    # 1. metadata and common state
    def read() -> Tuple[Dict[str, ShardedTensor], StateDict]:
        return dict(load_tensors_metadata(path, load_strategy)), load_common_state_dict(path)

    tensors_metadata, common = run_collectively("reading the checkpoint metadata", read)

    # 2. match and allocate
    def plan() -> Tuple[List[LoadTarget], Any, ModelEntries]:
        entries = model_entries(model)
        targets = plan_model_load(model, tensors_metadata, common, path, entries)
        optim_plan = None if optim is None else plan_optim_load(model, optim, tensors_metadata, common, path)
        return targets + ([] if optim_plan is None else optim_plan.targets), optim_plan, entries

    targets, optim_plan, entries = run_collectively("matching the model and optimizer with the checkpoint", plan)

    # 3. tensors (an FSDP1 model's state-dict tensors are copies: handed to its load_state_dict)
    checkpointer.load_targets(path, targets, validate=validate)
    if entries.copies:
        run_collectively("loading the model state into FSDP1", lambda: entries.give_back(model))

    # 4. optimizer state and hyperparameters
    if optim is not None and optim_plan is not None:
        run_collectively("loading the optimizer state", lambda: optim.load_state_dict(optim_plan.torch_state_dict()))


def unshard_model_state(
    dir: PathOrStr, device: Optional[torch.device] = None, rank0_only: bool = False, no_dist: bool = False
) -> Dict[str, torch.Tensor]:
    """The whole model state of a
    [`save_model_and_optim_state()`][dist_ckpt.training.model_optim.save_model_and_optim_state] checkpoint, by FQN.

    Args:
        dir: the checkpoint directory.
        device: where to put the tensors (default CPU).
        rank0_only: only rank 0 reads; other ranks get ``{}`` (collective).
        no_dist: read in this process, without any communication.

    Example:

    ```python
    sd = unshard_model_state("ckpt/step_100", no_dist=True)
    plain_model.load_state_dict(sd)
    ```
    """
    full = Checkpointer().read_full_tensors(dir, lambda k: k.startswith(MODEL_PREFIX), device, rank0_only, no_dist)
    return {k[len(MODEL_PREFIX) :]: v for k, v in full.items()}


def unshard_optim_state(
    dir: PathOrStr, device: Optional[torch.device] = None, rank0_only: bool = False, no_dist: bool = False
) -> OptimStateDict:
    """The whole optimizer state of a
    [`save_model_and_optim_state()`][dist_ckpt.training.model_optim.save_model_and_optim_state] checkpoint.

    A ``torch.optim`` style dict keyed by parameter FQN: ``{"state": {fqn: {"step": ...,
    "exp_avg": tensor, ...}}, "param_groups": [{"lr": ..., "params": [fqn, ...]}, ...]}``.

    Args:
        dir: the checkpoint directory.
        device: where to put the tensors (default CPU).
        rank0_only: only rank 0 reads; other ranks get ``{"state": {}, "param_groups": []}``.
        no_dist: read in this process, without any communication.

    Example:

    ```python
    osd = unshard_optim_state("ckpt/step_100", no_dist=True)
    osd["state"]["fc.weight"]["exp_avg"].shape
    ```
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

    return assemble() if no_dist else run_collectively("assembling the optimizer state", assemble)
