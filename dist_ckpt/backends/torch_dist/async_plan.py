"""DCP's ``save`` split into plan, write and finalize: Megatron-Core's ``strategies.state_dict_saver``.

``torch.distributed.checkpoint.save`` plans, writes and writes ``.metadata`` in one collective
call. For an asynchronous save the write must happen later, in the background, so Megatron-Core
splits it:

1. `save_state_dict_async_plan()` (collective): DCP's planning -- local plans, the global plan
   and the global ``Metadata`` on the coordinator -- then the writer's
   ``prepare_write_data`` (`async_writer.FileSystemWriterAsync`). With a planner and a writer
   that can plan alone (``can_run_decentralized_global_plan``), each rank's global plan is made
   locally and only the local plans are gathered (for the metadata); with a cached structure
   (``cached_ckpt_structure``: the plans of the previous save, found equal), nothing is gathered;
   with the plans stored in the metadata of the last checkpoint (``loaded_all_plans``, checked by
   `verify_global_md_reuse()`), the coordinator may reuse that metadata;
2. the write (``writer.get_save_function_and_args()``), anywhere, no collective;
3. `save_state_dict_async_finalize()` (collective): every rank's write results are gathered to the
   coordinator, which writes ``.metadata``; a failure on any rank (of the write, or of the
   ``.metadata`` write) raises [`CheckpointWriteError`][dist_ckpt.backends.torch_dist.async_plan.CheckpointWriteError]
   on every rank, naming each failed rank.

Collectives go through DCP's own process-group wrapper (Megatron-Core's ``dist_wrapper``), which
falls back to one process without a process group.

Example:

```python
ret, central_plan, local_plan, cache_hit, md_reuse = save_state_dict_async_plan(
    dcp_state, writer, planner=MCoreSavePlanner(flatten_state_dict=False))
save_fn, preload_fn, args = writer.get_save_function_and_args()
...                                   # save_fn(*args) in the background
save_state_dict_async_finalize(*ret)
```
"""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any, Dict, List, Optional, Tuple

from torch.distributed.checkpoint.api import WRAPPED_EXCEPTION, CheckpointException, _wrap_exception
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.utils import _DistWrapper, _get_failure_dict

from dist_ckpt.backends.torch_dist.async_writer import FileSystemWriterAsync
from dist_ckpt.collectives.distributed import (
    ProcessGroup,
    all_reduce_max,
    broadcast_json,
    get_rank,
    group_ranks,
    is_distributed,
)
from dist_ckpt.errors import AsyncSaveError

__all__ = [
    "CheckpointWriteError",
    "save_state_dict_async_finalize",
    "save_state_dict_async_plan",
    "verify_global_md_reuse",
]

logger = logging.getLogger(__name__)


class CheckpointWriteError(AsyncSaveError, CheckpointException):
    """A DCP save failed on some ranks: raised on every rank, naming each failed rank and its error.

    Both dist_ckpt's [`AsyncSaveError`][dist_ckpt.errors.AsyncSaveError] and DCP's
    ``CheckpointException`` (what Megatron-Core and DCP raise here), with DCP's ``failures``.
    """

    def __init__(self, msg: str, failures: Dict[int, WRAPPED_EXCEPTION]) -> None:
        CheckpointException.__init__(self, msg, failures)
        self._message = msg

    def __str__(self) -> str:
        return self._message


def _describe(wrapped: WRAPPED_EXCEPTION) -> str:
    error = wrapped[0]
    return f"{type(error).__name__}: {error}"


def save_state_dict_async_plan(
    state_dict: Dict[str, Any],
    storage_writer: FileSystemWriterAsync,
    process_group: Optional[ProcessGroup] = None,
    coordinator_rank: int = 0,
    planner: Optional[SavePlanner] = None,
    cached_ckpt_structure: Optional[Tuple[Optional[SavePlan], Optional[SavePlan], bool]] = None,
    loaded_all_plans: Optional[List[SavePlan]] = None,
) -> Tuple[Tuple[FileSystemWriterAsync, Optional[Metadata], _DistWrapper], SavePlan, SavePlan, bool, bool]:
    """Step 1 of the module docstring (collective over ``process_group``).

    Args:
        state_dict: the DCP state dict (e.g. from ``mcore_to_pyt_state_dict``).
        storage_writer: the writer (its ``prepare_write_data`` is called last).
        process_group: the ranks that save (default: all).
        coordinator_rank: the global rank that writes ``.metadata``.
        planner: the save planner (default: DCP's ``DefaultSavePlanner``).
        cached_ckpt_structure: ``(central_plan, local_plan, validated)`` of the previous save:
            when ``validated``, the cached central plan is used and nothing is gathered.
        loaded_all_plans: every rank's local plan as stored in a loaded checkpoint's metadata.

    Returns:
        ``((storage_writer, global_metadata, dist_wrapper), central_plan, local_plan,
        central_plan == cached central plan, whether the loaded metadata can be reused)``; the
        first element is what `save_state_dict_async_finalize()` takes. ``global_metadata`` is
        None on ranks other than the coordinator and when nothing was gathered.
    """
    cached_central, cached_local, validated = cached_ckpt_structure or (None, None, False)
    wrapper = _DistWrapper(process_group, is_distributed(), coordinator_rank)
    planner = planner if planner is not None else DefaultSavePlanner()
    rank = get_rank()
    global_metadata: Optional[Metadata] = None
    local_plan = cached_local
    md_reuse = False

    def local_step() -> SavePlan:
        nonlocal local_plan
        planner.set_up_planner(state_dict, is_coordinator=wrapper.is_coordinator)
        storage_writer.set_up_storage_writer(wrapper.is_coordinator)
        if not validated or local_plan is None:
            local_plan = planner.create_local_plan()
        local_plan = storage_writer.prepare_local_plan(local_plan)
        return local_plan

    def global_step(all_local_plans: List[SavePlan]) -> List[SavePlan]:
        nonlocal global_metadata
        all_local_plans, global_metadata = planner.create_global_plan(all_local_plans)
        return storage_writer.prepare_global_plan(all_local_plans)

    if validated and cached_central is not None:
        logger.debug("rank %d: the cached save plan is reused", rank)
        local_step()
        central_plan = cached_central
    elif getattr(planner, "can_run_decentralized_global_plan", False) and getattr(
        storage_writer, "can_run_decentralized_global_plan", False
    ):
        local_plan = local_step()
        md_reuse = verify_global_md_reuse(loaded_all_plans or [], local_plan, rank, wrapper)
        if not md_reuse:
            all_local_plans = wrapper.gather_object(local_plan)
            if wrapper.is_coordinator:
                assert all_local_plans is not None
                _, global_metadata = planner.create_global_plan(all_local_plans)
                global_metadata.all_local_plans = all_local_plans  # type: ignore[attr-defined]  # Megatron's record
        central_plan = storage_writer.prepare_decentralized_global_plan(
            planner.create_decentralized_global_plan(local_plan)  # type: ignore[attr-defined]
        )
    else:
        central_plan = wrapper.reduce_scatter("plan", local_step, global_step)
    central_plan = planner.finish_plan(central_plan)
    storage_writer.prepare_write_data(central_plan, planner)
    assert local_plan is not None
    return (
        (storage_writer, global_metadata, wrapper),
        central_plan,
        local_plan,
        cached_central == central_plan,
        md_reuse,
    )


def verify_global_md_reuse(
    loaded_all_plans: List[SavePlan], local_plan: SavePlan, rank: int, dist_wrapper: _DistWrapper
) -> bool:
    """Whether the metadata of a loaded checkpoint describes this save too (collective when plans
    were given): every rank's local plan equals, but for its file prefix, the plan stored for it.

    Args:
        loaded_all_plans: the local plans stored in the loaded metadata (empty: no reuse).
        local_plan: this rank's local plan.
        rank: this rank, the index of its stored plan.
        dist_wrapper: the wrapper of the save's process group.
    """
    if not loaded_all_plans or len(loaded_all_plans) != dist_wrapper.get_world_size():
        return False
    stored = loaded_all_plans[rank] if rank < len(loaded_all_plans) else None
    same = stored is not None and all(
        getattr(local_plan, f.name) == getattr(stored, f.name) for f in fields(local_plan) if f.name != "storage_data"
    )
    if not same:
        logger.debug("rank %d: the loaded metadata does not describe this save", rank)
    group = dist_wrapper.group if dist_wrapper.use_dist else None
    (differs_anywhere,) = all_reduce_max([0 if same else 1], group) if dist_wrapper.use_dist else [0 if same else 1]
    return differs_anywhere == 0


def save_state_dict_async_finalize(
    storage_writer: FileSystemWriterAsync, global_metadata: Optional[Metadata], dist_wrapper: _DistWrapper
) -> None:
    """Step 3 of the module docstring (collective): gather the write results, write ``.metadata``
    on the coordinator, and raise on every rank if anything failed anywhere.

    Raises:
        CheckpointWriteError: a rank's write failed (or never finished), or the coordinator could
            not write ``.metadata`` (or had no metadata to write); nothing was committed.
    """
    results = storage_writer.retrieve_write_results()
    gathered = dist_wrapper.gather_object(results)
    failed: Optional[Dict[str, str]] = None
    if dist_wrapper.is_coordinator:
        assert gathered is not None
        failures = _get_failure_dict(gathered)
        if not failures:
            try:
                if global_metadata is None:
                    raise AsyncSaveError("the coordinator has no global metadata (neither planned nor cached)")
                storage_writer.finish(global_metadata, gathered)  # type: ignore[arg-type]  # no failures: lists
            except Exception as e:  # noqa: BLE001 -- reported on every rank below
                failures = {dist_wrapper.rank: _wrap_exception(e)}
        failed = {str(r): _describe(w) for r, w in failures.items()}
    if dist_wrapper.use_dist:
        members = group_ranks(dist_wrapper.group)
        failed = broadcast_json(failed, src=members.index(dist_wrapper.coordinator_rank), group=dist_wrapper.group)
    if failed:
        text = "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items(), key=lambda kv: int(kv[0])))
        raise CheckpointWriteError(
            f"[rank {get_rank()}] the DCP save in {storage_writer.checkpoint_id!r} failed, nothing committed: {text}",
            {int(r): _wrap_exception(AsyncSaveError(m)) for r, m in failed.items()},
        )
