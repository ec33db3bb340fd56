"""An AsyncCallsQueue starts its writer process when it is made, and can fault in the first
snapshot's buffer in the background, so that the first save pays neither (issue 40)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.asynchronous.queue import AsyncCallsQueue, AsyncRequest
from dist_ckpt.asynchronous.snapshot import PROCESS_SNAPSHOTS
from dist_ckpt.errors import AsyncSaveError
from tests.paths import REPO_ROOT


def test_the_writer_is_started_with_the_queue_and_serves_the_first_save(tmp_path: Path) -> None:
    queue = AsyncCallsQueue()
    try:
        assert queue._worker is not None and queue._worker.pid is not None  # before any request
        pid = queue._worker.pid
        sd = {"w": dc.ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}
        queue.schedule_async_request(dc.save(sd, tmp_path / "c", async_sharded_save=True))
        queue.maybe_finalize_async_calls(blocking=True)
        assert queue._worker.pid == pid  # the same process wrote it
        assert torch.equal(dc.load_plain_tensors(tmp_path / "c")["w"], torch.arange(6.0))
    finally:
        queue.close()
    assert queue._worker is None


def test_the_writer_can_wait_for_the_first_request() -> None:
    queue = AsyncCallsQueue(start_writer=False)
    assert queue._worker is None
    queue.schedule_async_request(AsyncRequest(None, ()))
    queue.close()
    fresh_per_request = AsyncCallsQueue(persistent=False)
    assert fresh_per_request._worker is None  # a process per request: none to start ahead


def test_a_queue_closed_unused_stops_its_writer() -> None:
    queue = AsyncCallsQueue()
    worker = queue._worker
    assert worker is not None and worker.pid is not None
    process = worker._process
    queue.close()
    assert process is not None and process.poll() is not None


def test_snapshot_bytes_reserves_the_buffer_in_the_background() -> None:
    PROCESS_SNAPSHOTS.release()
    queue = AsyncCallsQueue(start_writer=False, snapshot_bytes=3 << 20)
    try:
        PROCESS_SNAPSHOTS.wait_reserved()
        assert [b.numel() for b in PROCESS_SNAPSHOTS.buffers] == [3 << 20]
    finally:
        queue.close()
        PROCESS_SNAPSHOTS.release()
    with pytest.raises(AsyncSaveError, match="must not be negative"):
        AsyncCallsQueue(start_writer=False, snapshot_bytes=-1)


def test_the_default_save_strategies_are_imported_beside_training() -> None:
    """A fresh process: making the queue imports the default backend's modules on a thread, so
    that the first save does not import them in its caller's time."""
    code = (
        "import sys, threading\n"
        "import dist_ckpt as dc\n"
        "assert 'dist_ckpt.backends.safetensors.strategy' not in sys.modules\n"
        "q = dc.AsyncCallsQueue()\n"
        "for t in threading.enumerate():\n"
        "    if t.name == 'dist_ckpt-warm-up':\n"
        "        t.join()\n"
        "print('dist_ckpt.backends.safetensors.strategy' in sys.modules)\n"
        "q.close()\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True"], out.stderr[-2000:]
