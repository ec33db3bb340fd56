"""Reports and the watchdog across ranks: every rank gets a complete report of a save and a load
(its own bytes and time, the job's totals, the same file count), and a rank stuck in a step is
named by the watchdog of every rank."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch.distributed as dist

import dist_ckpt as dc
from dist_ckpt.asynchronous.queue import AsyncCallsQueue
from dist_ckpt.backends.base import SaveShardedStrategy
from dist_ckpt.backends.safetensors.strategy import SafetensorsSaveShardedStrategy
from dist_ckpt.collectives.distributed import all_gather_json, run_collectively
from dist_ckpt.engine.report import Operation
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor, is_main_replica
from dist_ckpt.testing.layouts import full_tensor, tp_shards

from .helpers import assert_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)

SHAPES = {"row": ((8 * 4, 16), 0), "col": ((16, 8 * 4), 1)}
GLOBAL_BYTES = sum(4 * a * b for (a, b), _ in SHAPES.values())


def _state(tp: int, empty: bool = False) -> Dict[str, Any]:
    sd: Dict[str, Any] = {}
    for name, (shape, axis) in SHAPES.items():
        sd.update(tp_shards(name, full_tensor(name, shape), axis, tp, rank(), world(), empty=empty))
    sd["obj"] = ShardedObject("rank_obj", {"rank": rank()}, (world(),), (rank(),))
    sd["step"] = 3
    return sd


def _main_bytes(sd: Dict[str, Any]) -> int:
    return sum(
        v.data.numel() * v.data.element_size()
        for v in sd.values()
        if isinstance(v, ShardedTensor) and is_main_replica(v.replica_id)
    )


def _disk_files(path: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


def test_save_and_load_report_on_every_rank(shared_tmp_path: Path) -> None:
    ckpt = shared_tmp_path / "c"
    sd = _state(tp=world())
    report = dc.save_with_report(sd, ckpt).report
    ok = (
        report.complete
        and report.operation is Operation.SAVE
        and (report.rank, report.world_size) == (rank(), world())
        and report.nbytes == _main_bytes(sd)
        and report.total_nbytes == GLOBAL_BYTES
        and report.max_seconds >= report.seconds > 0
        and len(report.phases) == 6
    )
    assert_on_all_ranks(ok, f"save report {report.to_json()}")
    # every rank reports the same job figures, and rank 0's file count matches the disk
    jobs = all_gather_json([report.total_nbytes, report.max_seconds, report.files, report.file_bytes])
    assert_on_all_ranks(len({tuple(j) for j in jobs}) == 1, f"job figures differ: {jobs}")
    assert_on_all_ranks(rank() != 0 or report.files == _disk_files(ckpt), f"{report.files} files reported")

    # load resharded: TP=world/2 x DP=2, so the ranks read replicas too
    request = _state(tp=max(1, world() // 2), empty=True)
    loaded = dc.load_with_report(request, ckpt).report
    requested = sum(v.data.numel() * 4 for v in request.values() if isinstance(v, ShardedTensor))
    ok = (
        loaded.complete
        and loaded.operation is Operation.LOAD
        and loaded.rank == rank()
        and loaded.nbytes == requested
        and loaded.total_nbytes == sum(all_gather_json(requested))
        and loaded.files == report.files
        and len(loaded.phases) == 5
    )
    assert_on_all_ranks(ok, f"load report {loaded.to_json()}")


def test_async_save_report_completed_on_every_rank(shared_tmp_path: Path) -> None:
    ckpt = shared_tmp_path / "a"
    sd = _state(tp=world())
    queue = AsyncCallsQueue(persistent=False)
    try:
        result = dc.save_with_report(sd, ckpt, async_sharded_save=True)
        assert result.async_request is not None
        before = result.report.complete
        queue.schedule_async_request(result.async_request)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    report = result.report
    ok = (
        not before
        and report.complete
        and report.total_nbytes == GLOBAL_BYTES
        and report.phases[-1].name == "committing metadata.json"
        and dc.check_is_distributed_checkpoint(ckpt)
    )
    assert_on_all_ranks(ok, f"async report {report.to_json()} (complete before finalization: {before})")


class _RankOneIsLate(SaveShardedStrategy):
    """Rank 1 sleeps inside a collective step: the others wait for it in the error exchange."""

    def __init__(self, seconds: float) -> None:
        super().__init__("safetensors", 1)
        self.inner = SafetensorsSaveShardedStrategy()
        self.seconds = seconds

    def save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> None:
        run_collectively("a slow step", lambda: time.sleep(self.seconds if rank() == 1 else 0))
        self.inner.save(sharded_state_dict, checkpoint_dir)


def test_watchdog_names_the_step_on_every_rank(shared_tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dist_ckpt.engine.watchdog"):
        dc.save(_state(tp=world()), shared_tmp_path / "w", sharded_strategy=_RankOneIsLate(1.0), watchdog_timeout_s=0.2)
    warnings: List[str] = [r.getMessage() for r in caplog.records if r.name == "dist_ckpt.engine.watchdog"]
    expected = f"rank {rank()} has been in step 'saving sharded tensors' > 'a slow step' of the save of"
    assert_on_all_ranks(bool(warnings) and warnings[0].startswith(expected), f"watchdog said {warnings}")
    alive = [t.name for t in threading.enumerate() if t.name == "dist_ckpt_watchdog"]
    assert_on_all_ranks(not alive, f"threads left: {alive}")
    assert_on_all_ranks(dc.check_is_distributed_checkpoint(shared_tmp_path / "w"), "the save did not commit")
    dist.barrier()
