"""The async writer process: started without the user's main module, and never waited on forever.

The writer is ``python -m dist_ckpt.asynchronous.writer``, so async saves work from any script:
one without an ``if __name__ == "__main__":`` guard, ``python -c`` and a script read from stdin
(each run here as two ranks, with a gloo process group). A writer that does not start, or that
stops making progress, fails its save within the queue's ``writer_timeout_s``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest
import torch

import dist_ckpt as dc
import dist_ckpt.asynchronous.worker as worker_module
from dist_ckpt.asynchronous.progress import note_progress
from dist_ckpt.asynchronous.queue import AsyncCallsQueue, AsyncRequest
from dist_ckpt.errors import AsyncSaveError
from dist_ckpt.testing import free_port
from dist_ckpt.testing.layouts import bitwise_equal, full_tensor
from tests.deadlines import scaled
from tests.paths import REPO_ROOT

#: a training script as users write them: no __main__ guard, rank and world from the environment
SCRIPT = """
import os
import torch
import dist_ckpt as dc
from dist_ckpt.testing import init_process_group
from dist_ckpt.testing.layouts import full_tensor, tp_shards

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
init_process_group(rank, world, int(os.environ["PORT"]))
sd = {"step": 3}
for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16), ("i64", torch.int64)):
    sd.update(tp_shards(name, full_tensor(name, (4 * world, 6), dtype), 0, world, rank, world))
queue = dc.AsyncCallsQueue()
queue.schedule_async_request(dc.save(sd, os.environ["OUT"], async_sharded_save=True))
for value in sd.values():
    if isinstance(value, dc.ShardedTensor):
        value.data.zero_()  # training goes on; the checkpoint keeps the values of the call
queue.maybe_finalize_async_calls(blocking=True)
queue.close()
print("saved on rank", rank)
"""

WORLD = 2
#: a hang guard for the scripts (each normally takes a few seconds)
SCRIPT_TIMEOUT_S = 300


def _run_script(how: str, tmp_path: Path) -> List[subprocess.CompletedProcess]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    command = {"file": [str(script)], "-c": ["-c", SCRIPT], "stdin": ["-"]}[how]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), WORLD_SIZE=str(WORLD), PORT=str(free_port()))
    env["OUT"] = str(tmp_path / "ckpt")
    results = []
    with contextlib.ExitStack() as stack:
        procs = [
            subprocess.Popen(
                [sys.executable, *command],
                env=dict(env, RANK=str(rank)),
                cwd=tmp_path,
                # read by `python -` (a file of its own per rank: they would share an offset)
                stdin=stack.enter_context(open(script, "rb")) if how == "stdin" else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for rank in range(WORLD)
        ]
        try:
            for proc in procs:
                out, err = proc.communicate(timeout=SCRIPT_TIMEOUT_S)
                results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return results


@pytest.mark.parametrize("how", ["file", "-c", "stdin"])
def test_async_save_from_any_script(tmp_path: Path, how: str) -> None:
    """An unguarded script, ``python -c`` and ``python -`` each commit a bit-exact checkpoint."""
    for rank, result in enumerate(_run_script(how, tmp_path)):
        assert result.returncode == 0, f"rank {rank}: {result.stderr.decode()[-3000:]}"
        assert f"saved on rank {rank}" in result.stdout.decode()
    ckpt = tmp_path / "ckpt"
    assert dc.check_is_distributed_checkpoint(ckpt) and dc.verify_checkpoint(ckpt).ok
    tensors = dc.load_plain_tensors(ckpt)
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16), ("i64", torch.int64)):
        assert bitwise_equal(tensors[name], full_tensor(name, (4 * WORLD, 6), dtype)), name
    assert dc.load_common_state_dict(ckpt)["step"] == 3


def _sleep_request(seconds: float) -> AsyncRequest:
    return AsyncRequest(time.sleep, (seconds,))


def test_a_hung_writer_fails_the_save_within_the_timeout(tmp_path: Path) -> None:
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(_sleep_request(0))  # the writer is up
        queue.maybe_finalize_async_calls(blocking=True)
        queue.writer_timeout_s = 2.0
        queue.schedule_async_request(_sleep_request(3600))  # uses no CPU: a hung file system
        with pytest.raises(AsyncSaveError) as info:
            queue.maybe_finalize_async_calls(blocking=True)
        text = str(info.value)
        stalled = "made no progress" in text or "stopped answering" in text  # the latter on a loaded host
        assert "[rank 0]" in text and stalled and "running async call 1" in text, text
        assert "sleep" in text and "writer_timeout_s" in text, text
        assert queue.get_num_unfinalized_calls() == 0
        # a new writer takes the next save
        queue.writer_timeout_s = 600.0
        sd = {"w": dc.ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}
        queue.schedule_async_request(dc.save(sd, tmp_path / "c", async_sharded_save=True))
        queue.maybe_finalize_async_calls(blocking=True)
        assert torch.equal(dc.load_plain_tensors(tmp_path / "c")["w"], torch.arange(6.0))
    finally:
        queue.close(abort=True)


def test_a_writer_that_does_not_start_fails_the_save(monkeypatch: pytest.MonkeyPatch) -> None:
    # an interpreter that never says it is ready (python starts in well under the timeout)
    never_ready = [sys.executable, "-c", "import time; time.sleep(600)"]
    monkeypatch.setattr(worker_module, "writer_command", lambda fd: never_ready)
    queue = AsyncCallsQueue(writer_timeout_s=2.0)
    try:
        queue.schedule_async_request(_sleep_request(0))
        with pytest.raises(AsyncSaveError, match=r"\[rank 0\].*did not start within 2 s"):
            queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close(abort=True)


def test_a_function_of_the_main_script_is_refused_when_scheduled() -> None:
    def fn() -> None:
        pass

    fn.__module__ = "__main__"
    queue = AsyncCallsQueue()
    with pytest.raises(AsyncSaveError, match="defined in the script run as __main__"):
        queue.schedule_async_request(AsyncRequest(fn, ()))
    assert queue.get_num_unfinalized_calls() == 0


def test_timeouts_must_be_positive() -> None:
    with pytest.raises(AsyncSaveError, match="positive"):
        AsyncCallsQueue(writer_timeout_s=0)
    with pytest.raises(AsyncSaveError, match="positive"):
        AsyncCallsQueue().writer_timeout_s = -1.0


def test_the_writer_exits_with_its_training_process(tmp_path: Path) -> None:
    """A training process that dies leaves no writer behind (it was writing when it died)."""
    code = (
        "import time, dist_ckpt as dc\n"
        "from dist_ckpt.asynchronous.queue import AsyncRequest\n"
        "q = dc.AsyncCallsQueue()\n"
        "q.schedule_async_request(AsyncRequest(time.sleep, (3600,)))\n"
        "print(q._worker.pid, flush=True)\n"
        "import os; os._exit(0)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=SCRIPT_TIMEOUT_S)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    pid = int(result.stdout.split()[0])
    for _ in range(600):  # it checks for its parent every second
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        pytest.fail(f"writer {pid} outlived its training process")


def patient_wait(seconds: float) -> str:
    """A call that waits on purpose, using no CPU, and notes its progress (as an async save's
    background process does while the training process writes the snapshot)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.1)
        note_progress()
    return "waited"


def test_a_call_that_notes_progress_outlives_the_timeout() -> None:
    from tests.unit.asynchronous.test_writer_process import patient_wait as importable_patient_wait

    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(_sleep_request(0))  # the writer is up
        queue.maybe_finalize_async_calls(blocking=True)
        queue.writer_timeout_s = 1.5
        request = AsyncRequest(importable_patient_wait, (4.0,))
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        assert request.outcome.result == "waited"
    finally:
        queue.close(abort=True)


class SlowToRelease:
    """An argument whose release in the writer process takes until ``release_file`` exists (as
    unmapping a large snapshot takes a while): the call's outcome must not wait for it."""

    def __init__(self, release_file: str) -> None:
        self.release_file = release_file
        self.owner = os.getpid()

    def __del__(self) -> None:
        if os.getpid() == self.owner:
            return
        deadline = time.monotonic() + scaled(60)
        while not os.path.exists(self.release_file) and time.monotonic() < deadline:
            time.sleep(0.05)


class MarksRelease:
    """An argument that writes the (system-wide monotonic) time of its release in the writer
    process to ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.owner = os.getpid()

    def __del__(self) -> None:
        if os.getpid() != self.owner:
            Path(self.marker).write_text(repr(time.monotonic()))


def finished_at(arg: object) -> float:
    """The time the call ended, in the writer process."""
    return time.monotonic()


def _started_queue() -> AsyncCallsQueue:
    """A queue whose writer process is up (its start, importing torch, is not timed by the test)."""
    queue = AsyncCallsQueue()
    queue.schedule_async_request(_sleep_request(0))
    queue.maybe_finalize_async_calls(blocking=True)
    return queue


def test_the_outcome_is_sent_before_the_arguments_are_released(tmp_path: Path) -> None:
    from tests.unit.asynchronous.test_writer_process import SlowToRelease as ImportableArg
    from tests.unit.asynchronous.test_writer_process import finished_at as importable_finished_at

    release = tmp_path / "release"
    queue = _started_queue()
    try:
        request = AsyncRequest(importable_finished_at, (ImportableArg(str(release)),))
        queue.schedule_async_request(request)
        worker = queue._get_worker()
        assert worker.wait(request.outcome, timeout_s=scaled(30)), "the outcome waited for the arguments' release"
        assert isinstance(request.outcome.result, float)
    finally:
        release.touch()
        queue.close()


def test_arguments_are_kept_while_idle_then_released(tmp_path: Path) -> None:
    """Kept after the outcome is sent, so that the unmapping of a snapshot shares the CPU
    neither with the finished save's completion nor with the copy of a save started right
    after; released after an idle moment. Both times are taken in the writer process."""
    from tests.unit.asynchronous.test_writer_process import MarksRelease as ImportableMarks
    from tests.unit.asynchronous.test_writer_process import finished_at as importable_finished_at

    marker = tmp_path / "released"
    queue = _started_queue()
    try:
        request = AsyncRequest(importable_finished_at, (ImportableMarks(str(marker)),))
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        deadline = time.monotonic() + scaled(60)
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "an idle writer kept the last call's arguments"
        kept = float(marker.read_text()) - request.outcome.result
        assert kept >= 0.5, f"released {kept:.3f} s after the call ended, while the writer was idle"
    finally:
        queue.close()


def test_arguments_are_released_before_the_next_call_runs(tmp_path: Path) -> None:
    from tests.unit.asynchronous.test_writer_process import MarksRelease as ImportableMarks
    from tests.unit.asynchronous.test_writer_process import finished_at as importable_finished_at

    marker = tmp_path / "released"
    queue = _started_queue()
    try:
        queue.schedule_async_request(AsyncRequest(importable_finished_at, (ImportableMarks(str(marker)),)))
        check = AsyncRequest(os.path.exists, (str(marker),))
        queue.schedule_async_request(check)
        queue.maybe_finalize_async_calls(blocking=True)
        assert check.outcome.result is True
    finally:
        queue.close()


def test_a_ctrl_c_in_the_terminal_does_not_reach_the_writer() -> None:
    """A terminal sends Ctrl-C's SIGINT to its whole foreground process group. The training
    process handles it (and its writer exits with it, see above); a writer in that group died of
    it too, printing a KeyboardInterrupt traceback of its own, one per rank (issue 39, item 15)."""
    queue = _started_queue()
    try:
        writer = queue._get_worker().pid
        assert writer is not None
        assert os.getpgid(writer) != os.getpgid(0), "the writer shares the training process's process group"
        request = AsyncRequest(time.sleep, (0,))
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        assert request.outcome.done and request.outcome.error is None
    finally:
        queue.close()
