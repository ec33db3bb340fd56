"""Byte progress of saves and loads (issue 39, item 6): while the tensors are written or read,
the progress callback gets the bytes done so far and the total, from 0 up to the total."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.engine.report import ProgressEvent
from dist_ckpt.engine.steps import Step
from dist_ckpt.training.checkpointer import Checkpointer

#: 24 tensors of 16 KiB: every one of them moves more than a hundredth of the total
TENSORS, NUMEL = 24, 4096
TOTAL = TENSORS * NUMEL * 4


def _state() -> Dict[str, Any]:
    sd: Dict[str, Any] = {
        f"w{i}": dc.ShardedTensor.from_rank_offsets(f"w{i}", torch.full((NUMEL,), float(i))) for i in range(TENSORS)
    }
    sd["step"] = 3
    return sd


def _bytes_of(events: List[ProgressEvent], step: Step) -> List[ProgressEvent]:
    return [e for e in events if e.phase == step.value]


def _check_climbs_to_the_total(events: List[ProgressEvent]) -> None:
    assert events and all(e.bytes_total == TOTAL for e in events), events
    done = [e.bytes_done for e in events]
    assert done[0] == 0 and not events[0].done, done  # the step starts at 0 ...
    assert done == sorted(done) and all(0 <= d <= TOTAL for d in done), done  # ... climbs ...
    assert done[-1] == TOTAL and events[-1].done and not any(e.done for e in events[:-1]), done  # ... to the total
    assert len({d for d in done if 0 < d < TOTAL}) >= 3, done  # and says so on the way, not only at the end


@pytest.mark.parametrize("backend", [("safetensors", 1), ("zarr", 1)])
def test_a_save_and_a_load_report_their_bytes_as_they_move(tmp_path: Path, backend: Any) -> None:
    saved: List[ProgressEvent] = []
    dc.save(_state(), tmp_path / "c", sharded_strategy=backend, progress=saved.append)
    _check_climbs_to_the_total(_bytes_of(saved, Step.SAVE_SHARDED))
    loaded: List[ProgressEvent] = []
    state = dc.load(_state(), tmp_path / "c", progress=loaded.append)
    _check_climbs_to_the_total(_bytes_of(loaded, Step.LOAD_SHARDED))
    assert torch.equal(state["w5"], torch.full((NUMEL,), 5.0))
    # the other phases count no bytes
    assert all(e.bytes_total == 0 for e in saved + loaded if e.phase not in (Step.SAVE_SHARDED, Step.LOAD_SHARDED))


def test_a_checkpointer_reports_the_bytes_of_its_saves_and_loads(tmp_path: Path) -> None:
    events: List[ProgressEvent] = []
    ckpt = Checkpointer(progress=events.append, watchdog_timeout_s=None)
    tensors = {f"w{i}": torch.full((NUMEL,), float(i)) for i in range(TENSORS)}
    ckpt.save(tmp_path / "c", tensors)
    _check_climbs_to_the_total(_bytes_of(events, Step.SAVE_SHARDED))
    events.clear()
    ckpt.load(tmp_path / "c", {k: torch.zeros_like(v) for k, v in tensors.items()})
    _check_climbs_to_the_total(_bytes_of(events, Step.LOAD_SHARDED))
