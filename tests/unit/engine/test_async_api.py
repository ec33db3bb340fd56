"""dc.async_save(): one call schedules a background save; its future commits it, or raises its error."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, Iterator

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.asynchronous.queue import AsyncCallsQueue
from dist_ckpt.errors import AsyncSaveError, CheckpointExistsError
from dist_ckpt.model.sharded import ShardedTensor


@pytest.fixture(scope="module")
def queue() -> Iterator[AsyncCallsQueue]:
    q = AsyncCallsQueue()
    yield q
    q.close()


def _state(value: float) -> Dict[str, object]:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((64, 8), value)), "step": int(value)}


def _loaded(path: Path) -> torch.Tensor:
    out = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(64, 8))}, path)
    return out["w"]


def test_the_future_commits_the_state_as_it_was_when_scheduled(tmp_path: Path, queue: AsyncCallsQueue) -> None:
    sd = _state(1.0)
    future = dc.async_save(sd, tmp_path / "c", queue=queue)
    assert isinstance(future, dc.AsyncSaveFuture) and not future.done()
    sd["w"].data.fill_(7.0)  # type: ignore[union-attr]  # training goes on: the snapshot is taken
    assert future.result() == str(tmp_path / "c")
    assert future.done() and "committed" in repr(future)
    assert torch.equal(_loaded(tmp_path / "c"), torch.full((64, 8), 1.0))
    assert future.result() == str(tmp_path / "c")  # a second wait returns at once


def test_waiting_for_a_later_save_commits_the_earlier_ones(tmp_path: Path, queue: AsyncCallsQueue) -> None:
    futures = [dc.async_save(_state(float(i)), tmp_path / f"c{i}", queue=queue) for i in range(3)]
    futures[-1].result()
    assert all(f.done() for f in futures)
    for i in range(3):
        assert torch.equal(_loaded(tmp_path / f"c{i}"), torch.full((64, 8), float(i)))


def test_a_failed_save_raises_from_its_own_future_only(tmp_path: Path, queue: AsyncCallsQueue) -> None:
    bad = dc.async_save(_state(2.0), tmp_path / "bad", queue=queue)
    # the files' directory replaced by a file: what the background write still has to do fails
    shutil.rmtree(tmp_path / "bad" / "safetensors")
    (tmp_path / "bad" / "safetensors").write_text("in the way")
    good = dc.async_save(_state(3.0), tmp_path / "good", queue=queue)
    assert good.result() == str(tmp_path / "good")  # the earlier failure does not hide this save
    assert bad.done() and "failed" in repr(bad)
    with pytest.raises(AsyncSaveError, match=r"\[rank 0\]"):
        bad.result()
    assert not (tmp_path / "bad" / "metadata.json").exists()
    assert torch.equal(_loaded(tmp_path / "good"), torch.full((64, 8), 3.0))


def test_errors_before_the_background_write_raise_at_the_call(tmp_path: Path, queue: AsyncCallsQueue) -> None:
    dc.save(_state(1.0), tmp_path / "c")
    with pytest.raises(CheckpointExistsError):
        dc.async_save(_state(2.0), tmp_path / "c", queue=queue)
    assert queue.get_num_unfinalized_calls() == 0


def test_the_default_queue_commits_a_pending_save_at_exit(tmp_path: Path) -> None:
    """A script that never waits on its future (and has no __main__ guard) still commits."""
    script = textwrap.dedent(
        f"""
        import torch
        import dist_ckpt as dc
        sd = {{"w": dc.ShardedTensor.from_rank_offsets("w", torch.full((4,), 5.0))}}
        dc.async_save(sd, {str(tmp_path / "c")!r})
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path)
    out = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4))}, tmp_path / "c")
    assert torch.equal(out["w"], torch.full((4,), 5.0))
