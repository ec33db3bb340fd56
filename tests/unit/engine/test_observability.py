"""Reports, progress callbacks and the watchdog of save and load (single process)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, List

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.base import SaveShardedStrategy
from dist_ckpt.backends.safetensors.strategy import SafetensorsSaveShardedStrategy
from dist_ckpt.collectives.distributed import active_steps, run_collectively
from dist_ckpt.engine import monitor as monitor_module
from dist_ckpt.engine.report import Operation, ProgressEvent
from dist_ckpt.engine.watchdog import Watchdog
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor
from tests.deadlines import scaled

WATCHDOG_LOGGER = "dist_ckpt.engine.watchdog"


def _state() -> dict:
    w = torch.arange(48, dtype=torch.float32).reshape(6, 8)  # 192 bytes
    b = torch.arange(10, dtype=torch.bfloat16)  # 20 bytes
    return {
        "w": ShardedTensor.from_rank_offsets("w", w),
        "b": ShardedTensor.from_rank_offsets("b", b),
        "rng": ShardedObject("rng", [1, 2, 3], (1,), (0,)),
        "step": 7,
    }


def _disk(path: Path) -> tuple:
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files]
    return len(sizes), sum(sizes)


def _watchdog_threads() -> List[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dist_ckpt_watchdog"]


# --------------------------------------------------------------------------- reports


@pytest.mark.parametrize("backend", [("safetensors", 1), ("zarr", 1)])
def test_save_report_counts_bytes_files_and_phases(tmp_path: Path, backend: Any) -> None:
    result = dc.save_with_report(_state(), tmp_path / "c", sharded_strategy=backend)
    report = result.report
    assert result.async_request is None
    assert report.operation is Operation.SAVE and report.complete
    assert report.nbytes == report.total_nbytes == 192 + 20
    assert [p.name for p in report.phases] == [
        "preparing the save",
        "checking the state to save",
        "validating the sharding",
        "saving the common state",
        "saving sharded tensors",
        "committing metadata.json",
    ]
    assert all(p.seconds >= 0 for p in report.phases)
    assert report.seconds >= sum(p.seconds for p in report.phases) > 0
    assert report.max_seconds == report.seconds and report.gb_per_s > 0
    assert (report.files, report.file_bytes) == _disk(tmp_path / "c")
    assert report.phase_seconds("saving sharded tensors") == report.phases[4].seconds
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["operation"] == "save" and doc["total_nbytes"] == 212 and len(doc["phases"]) == 6
    assert str(tmp_path / "c") in report.summary() and "saving sharded tensors" in report.summary()


def test_save_without_validation_has_no_validation_phase(tmp_path: Path) -> None:
    report = dc.save_with_report(_state(), tmp_path / "c", validate_access_integrity=False).report
    assert "validating the sharding" not in [p.name for p in report.phases]


def test_save_logs_its_report_at_info(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dist_ckpt.engine.monitor"):
        dc.save(_state(), tmp_path / "c")
    lines = [
        r.getMessage() for r in caplog.records if r.name == "dist_ckpt.engine.monitor" and r.levelno == logging.INFO
    ]
    assert len(lines) == 1 and lines[0].startswith(f"save of {tmp_path / 'c'}: ") and "GiB/s" in lines[0]


def test_load_report_counts_requested_bytes(tmp_path: Path) -> None:
    dc.save(_state(), tmp_path / "c")
    request = {
        # a flattened range of 5 elements of the first two rows (rows of 8 fp32)
        "w": ShardedTensor.from_rank_offsets_flat("w", torch.empty(5), (2, 8), (0, 0, 3), flattened_range=slice(3, 8)),
        "b": ShardedTensor.from_rank_offsets("b", torch.empty(10, dtype=torch.bfloat16)),
    }
    result = dc.load_with_report(request, tmp_path / "c", validate_access_integrity=False)
    report = result.report
    assert torch.equal(result.state_dict["w"], torch.arange(3, 8, dtype=torch.float32))
    assert report.operation is Operation.LOAD and report.complete
    assert report.nbytes == 5 * 4 + 10 * 2
    assert [p.name for p in report.phases] == [
        "opening the checkpoint",
        "loading the common state",
        "matching the requested keys",
        "loading sharded tensors",
        "assembling the state",
    ]
    assert (report.files, report.file_bytes) == _disk(tmp_path / "c")


def test_a_load_lists_the_checkpoint_files_while_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The count of the report comes from a listing of the whole checkpoint (thousands of files
    for zarr: 75 ms of a 1.3 s load on the test VM): a load starts it in a thread as it begins (the
    checkpoint does not change while it is read); a save lists after its commit."""
    listed_by: List[str] = []
    real = monitor_module.count_files

    def recording(location: object) -> object:
        listed_by.append(threading.current_thread().name)
        return real(location)  # type: ignore[arg-type]

    monkeypatch.setattr(monitor_module, "count_files", recording)
    save_report = dc.save_with_report(_state(), tmp_path / "c").report
    load_report = dc.load_with_report(_state(), tmp_path / "c").report
    assert listed_by == [threading.main_thread().name, "dist_ckpt_count_files"]
    assert (save_report.files, save_report.file_bytes) == (load_report.files, load_report.file_bytes)
    assert (load_report.files, load_report.file_bytes) == _disk(tmp_path / "c")


def test_async_save_report_is_completed_by_the_finalization(tmp_path: Path) -> None:
    result = dc.save_with_report(_state(), tmp_path / "c", async_sharded_save=True)
    report = result.report
    assert result.async_request is not None and not report.complete
    assert report.phases[-1].name == "preparing the async save"
    assert "(not complete)" in report.summary()
    result.async_request.execute_sync()
    assert report.complete and dc.check_is_distributed_checkpoint(tmp_path / "c")
    assert [p.name for p in report.phases[-3:]] == [
        "writing in the background (until finalized)",
        "finalizing the sharded tensors",
        "committing metadata.json",
    ]
    assert report.nbytes == 212 and report.files == _disk(tmp_path / "c")[0]


# --------------------------------------------------------------------------- progress


def test_progress_events_bracket_every_phase_in_order(tmp_path: Path) -> None:
    events: List[ProgressEvent] = []
    report = dc.save_with_report(_state(), tmp_path / "c", progress=events.append).report
    moving = [e for e in events if not e.done and e.bytes_done > 0]  # the bytes written (test_byte_progress)
    assert {e.phase for e in moving} <= {"saving sharded tensors"}
    events = [e for e in events if e not in moving]
    assert len(events) == 2 * len(report.phases)
    for i, phase in enumerate(report.phases):
        start, end = events[2 * i], events[2 * i + 1]
        assert (start.phase, start.done, end.phase, end.done) == (phase.name, False, phase.name, True)
        assert start.index == end.index == i + 1 and start.total == len(report.phases)
        assert start.seconds <= end.seconds
        assert start.operation is Operation.SAVE and start.checkpoint_dir == str(tmp_path / "c")
    loaded: List[ProgressEvent] = []
    dc.load(_state(), tmp_path / "c", progress=loaded.append)
    assert [e.phase for e in loaded if e.done][-1] == "assembling the state"
    assert all(e.operation is Operation.LOAD for e in loaded)


def test_a_failing_progress_callback_fails_the_save_and_commits_nothing(tmp_path: Path) -> None:
    def progress(event: ProgressEvent) -> None:
        if event.phase == "saving sharded tensors" and event.done:
            raise RuntimeError("the callback broke")

    with pytest.raises(RuntimeError, match="the callback broke"):
        dc.save(_state(), tmp_path / "c", progress=progress)
    assert not dc.check_is_distributed_checkpoint(tmp_path / "c")


# --------------------------------------------------------------------------- watchdog


def test_watchdog_warns_about_a_slow_step_and_keeps_going(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=WATCHDOG_LOGGER):
        with Watchdog(timeout_s=0.05, what="the test") as dog:
            with dog.step("sleeping"):
                time.sleep(0.3)
            with dog.step("quick"):
                pass
    warnings = [r.getMessage() for r in caplog.records if r.name == WATCHDOG_LOGGER]
    assert len(warnings) >= 2, warnings  # once per timeout while the step lasts
    assert dog.warnings == len(warnings)
    assert all(w.startswith("rank 0 has been in step 'sleeping' of the test for ") for w in warnings)
    assert not any("quick" in w for w in warnings)
    assert not _watchdog_threads()


def test_watchdog_names_the_inner_collective_step(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=WATCHDOG_LOGGER):
        with Watchdog(timeout_s=0.05) as dog:
            with dog.step("outer"):
                run_collectively("writing the files", lambda: time.sleep(0.2))
    assert "'outer' > 'writing the files'" in caplog.records[0].getMessage()
    assert active_steps() == ()


def test_watchdog_is_quiet_for_fast_steps(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=WATCHDOG_LOGGER):
        with Watchdog(timeout_s=5) as dog:
            with dog.step("fast"):
                pass
    assert not caplog.records and dog.warnings == 0


@pytest.mark.parametrize("timeout", [0, -1.0, True, "10"])
def test_watchdog_rejects_a_bad_timeout(tmp_path: Path, timeout: Any) -> None:
    with pytest.raises(CheckpointingException, match="watchdog timeout"):
        dc.save(_state(), tmp_path / "c", watchdog_timeout_s=timeout)
    assert not (tmp_path / "c").exists()


class _SlowSave(SaveShardedStrategy):
    """The safetensors save, after a step that sleeps: a stand-in for a hung collective."""

    def __init__(self, seconds: float) -> None:
        super().__init__("safetensors", 1)
        self.inner = SafetensorsSaveShardedStrategy()
        self.seconds = seconds
        self.threads_seen: List[str] = []

    def save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> None:
        self.threads_seen = [t.name for t in threading.enumerate()]
        run_collectively("waiting for the other ranks", lambda: time.sleep(self.seconds))
        self.inner.save(sharded_state_dict, checkpoint_dir)


def test_save_watchdog_logs_the_stuck_phase_and_leaves_no_thread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    strategy = _SlowSave(0.3)
    with caplog.at_level(logging.WARNING, logger=WATCHDOG_LOGGER):
        dc.save(_state(), tmp_path / "c", sharded_strategy=strategy, watchdog_timeout_s=0.1)
    assert "dist_ckpt_watchdog" in strategy.threads_seen
    warnings = [r.getMessage() for r in caplog.records if r.name == WATCHDOG_LOGGER]
    assert warnings, "the watchdog said nothing about a step three times longer than its timeout"
    assert warnings[0].startswith("rank 0 has been in step 'saving sharded tensors' > 'waiting for the other ranks' ")
    assert f"of the save of {tmp_path / 'c'}" in warnings[0]
    assert not _watchdog_threads()
    assert dc.check_is_distributed_checkpoint(tmp_path / "c")  # it only warned


def test_no_watchdog_thread_when_disabled(tmp_path: Path) -> None:
    strategy = _SlowSave(0.0)
    dc.save(_state(), tmp_path / "c", sharded_strategy=strategy, watchdog_timeout_s=None)
    assert "dist_ckpt_watchdog" not in strategy.threads_seen


def test_watchdog_thread_stops_when_the_load_fails(tmp_path: Path) -> None:
    with pytest.raises(dc.NotACheckpointError):
        dc.load(_state(), tmp_path / "absent", watchdog_timeout_s=0.05)
    assert not _watchdog_threads()


@pytest.mark.parametrize(
    "nbytes, text",
    [
        (0, "0 B"),
        (212, "212 B"),
        (4310, "4.21 KiB"),
        (1_070_000_000, "1020 MiB"),
        (3 * 2**30, "3 GiB"),
        (5 * 2**50, "5120 TiB"),
    ],
)
def test_format_bytes(nbytes: int, text: str) -> None:
    from dist_ckpt.engine.report import format_bytes

    assert format_bytes(nbytes) == text


def test_watchdog_touch_restarts_the_clock_of_a_step_that_makes_progress(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a fake clock: the watchdog thread sees only the times this test sets
    import dist_ckpt.engine.watchdog as watchdog_module

    now = [0.0]
    monkeypatch.setattr(watchdog_module.time, "monotonic", lambda: now[0])
    polled = threading.Event()

    class Counting(Watchdog):
        def _warn(self, step: str, elapsed: float) -> None:
            super()._warn(step, elapsed)
            polled.set()

    with caplog.at_level(logging.WARNING, logger=WATCHDOG_LOGGER):
        with Counting(timeout_s=10, what="the conversion", poll_s=0.001) as dog:
            with dog.step("copying tensors"):
                for _ in range(5):  # 9 s of progress at a time: never 10 s without it
                    now[0] += 9
                    dog.touch()
                time.sleep(0.05)  # let the thread poll the (frozen) clock many times
                assert dog.warnings == 0
                now[0] += 11  # no progress for 11 s
                assert polled.wait(timeout=scaled(60))  # a hang guard, not a timing check
    warnings = [r.getMessage() for r in caplog.records if r.name == WATCHDOG_LOGGER]
    assert len(warnings) == 1 and "'copying tensors' of the conversion for 11 s" in warnings[0]
