"""The training process's handle on the background process that writes asynchronous saves.

`AsyncWorker` starts one writer process (`dist_ckpt.asynchronous.writer`) and sends it
calls (a function, its arguments), which it runs one after another, in the order submitted;
`AsyncWorker.poll()` collects their outcomes without blocking.

Why a separate process, and how it is started:

* writing, checksumming and fsyncing in a thread of the training process would compete with
  training for the GIL; a process does not;
* ``fork`` would copy a process that holds a CUDA context, NCCL/gloo communicators and threads
  (a forked child cannot use CUDA and may deadlock on a lock another thread held at the fork);
* multiprocessing's ``spawn`` re-runs the user's main module in the child, so a training script
  without ``if __name__ == "__main__":``, a ``python -c`` or stdin script or a notebook hangs or
  fails. The writer is instead ``python -m dist_ckpt.asynchronous.writer`` (same interpreter, an
  environment that imports this dist_ckpt): a clean process that imports only dist_ckpt and the
  modules of the functions it is sent, under every launcher and from any script;
* it runs in a session of its own, so that a Ctrl-C in the terminal interrupts the training
  process only: the writer exits when its training process does, quietly.

Calls travel over a Unix socket (`channel`): a tensor in shared memory (the snapshot) is
passed as a file descriptor, the writer maps the same memory, and no copy of the data is made.
Each call is pickled *before* it is sent, in the caller, so an argument that cannot be sent
raises there.

No wait on the writer is unbounded. It must say it is ready within ``timeout_s`` of its start;
while it has calls, it is asked (at most every ``heartbeat_s``, whenever the training process
polls or waits) what it is doing and how much CPU it used; a writer that does not answer for
``timeout_s`` seconds, or whose CPU time stops growing for ``timeout_s`` seconds (blocked on a
hung file system, deadlocked) while its call notes no progress either
(`dist_ckpt.asynchronous.progress`: a call that waits on purpose), is killed and its calls fail with an
[`AsyncSaveError`][dist_ckpt.errors.AsyncSaveError] naming the rank and what the writer was doing. A
writer that dies (killed, out of memory) fails its calls the same way.

Example:

```python
worker = AsyncWorker(rank=0)
outcome = AsyncOutcome()
worker.submit(0, write_files, (root, parts), {}, outcome)
...                                   # training continues
worker.poll()                         # non-blocking; sets outcome.done / result / error
worker.wait(outcome)                  # blocking, bounded by the timeout
worker.close()
```
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import site
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from dist_ckpt.asynchronous.channel import FrameReader, encode, readable, send_frame
from dist_ckpt.errors import AsyncSaveError
from dist_ckpt.storage.errors import AsyncStorageError

__all__ = ["DEFAULT_WRITER_TIMEOUT_S", "AsyncOutcome", "AsyncWorker", "writer_command", "writer_environment"]

logger = logging.getLogger(__name__)

#: default of how long the writer may take to start, or go without answering or using CPU
#: while it has calls, before it is killed: generous, so that only a writer that is really
#: stuck is stopped, never a large but healthy write
DEFAULT_WRITER_TIMEOUT_S = 600.0

#: a writer whose CPU time grew by less than this (seconds) made no progress
_PROGRESS_EPS_S = 1e-3

#: the directory that holds the dist_ckpt package
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class AsyncOutcome:
    """How the background part of one request ended; filled in by the process that ran it.

    Attributes:
        done: the call finished (successfully or not) or can no longer finish (its process died).
        result: the call's return value, on success.
        error: an [`AsyncSaveError`][dist_ckpt.errors.AsyncSaveError] describing the failure, naming the rank
            (an [`AsyncStorageError`][dist_ckpt.storage.errors.AsyncStorageError], a ``StorageError`` too,
            when the failure was a write the file system refused).
    """

    done: bool = False
    result: Any = None
    error: Optional[BaseException] = field(default=None, repr=False)

    def succeed(self, result: Any) -> None:
        self.done, self.result, self.error = True, result, None

    def fail(self, error: BaseException) -> None:
        self.done, self.result, self.error = True, None, error


def writer_command(fd: int) -> List[str]:
    """The command line of a writer process serving the socket ``fd``."""
    return [sys.executable, "-m", "dist_ckpt.asynchronous.writer", str(fd)]


def writer_environment() -> Dict[str, str]:
    """This process's environment, with this dist_ckpt importable first (unless it is installed
    in a site directory, which every interpreter reads) and one OpenMP thread by default."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    sites = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if _PACKAGE_ROOT not in sites:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
    return env


def _call_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


@dataclass
class _Progress:
    """What the training process knows of the running writer."""

    ready: bool = False
    doing: str = "starting (python -m dist_ckpt.asynchronous.writer: importing torch and dist_ckpt)"
    ping_seq: int = 0
    ping_sent_at: Optional[float] = None  # this process's clock; None: no ping unanswered
    last_ping_at: float = 0.0
    base: Optional[Tuple[float, int, float]] = None  # (cpu s, progress noted, the writer's clock) at its last progress
    latest: Optional[float] = None  # the writer's clock at its latest status


class AsyncWorker:
    """Handle on one writer process, started by `start()` or on the first `submit()` (and again
    after one that died or was stopped).

    Args:
        rank: this process's rank, named in error messages.
        timeout_s: how long the writer may take to start, or go without answering or using
            CPU while it has calls, before it is killed (the calls then fail). May be changed
            between calls.

    Example:

    ```python
    worker = AsyncWorker(rank=0)
    worker.submit(0, write_snapshot_parts, args, {}, outcome)
    worker.wait(outcome)
    worker.close()
    ```
    """

    def __init__(self, rank: int = 0, timeout_s: float = DEFAULT_WRITER_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise AsyncSaveError(f"the writer's timeout_s must be positive, got {timeout_s!r}")
        self.rank = rank
        self.timeout_s = timeout_s
        self._process: Optional["subprocess.Popen[bytes]"] = None
        self._sock: Optional[socket.socket] = None
        self._frames = FrameReader()
        self._started_at = 0.0
        self._state = _Progress()
        self._pending: Dict[int, Tuple[AsyncOutcome, str]] = {}

    @property
    def pid(self) -> Optional[int]:
        """The writer's process id (None before it starts)."""
        return None if self._process is None else self._process.pid

    @property
    def heartbeat_s(self) -> float:
        """How often a writer with calls is asked what it is doing (a tenth of the timeout, at most 1 s)."""
        return min(1.0, self.timeout_s / 10)

    # ------------------------------------------------------------------ start and send

    def _start(self) -> None:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._process = subprocess.Popen(
                writer_command(child_end.fileno()),
                pass_fds=(child_end.fileno(),),
                env=writer_environment(),
                stdin=subprocess.DEVNULL,
                # a session of its own: a terminal's Ctrl-C (SIGINT to its foreground process
                # group) reaches the training process, which handles it, and not the writer, which
                # would die of it with a traceback of its own; the writer exits with its parent
                start_new_session=True,
            )
        except BaseException:
            parent_end.close()
            raise
        finally:
            child_end.close()
        self._sock, self._frames, self._state = parent_end, FrameReader(), _Progress()
        self._started_at = time.monotonic()
        self._send(("hello", list(sys.path), self.rank))
        logger.debug("started async checkpoint writer process %d", self._process.pid)

    def start(self) -> None:
        """Start the writer process now, if it is not running, without waiting for it: it imports
        torch and dist_ckpt (seconds) while the caller goes on, so that the first `submit()` does
        not wait for its start-up. A writer that cannot be started is started again at `submit()`."""
        self.poll()  # notices a writer that exited
        if self._process is not None:
            return
        try:
            self._start()
        except OSError as e:
            logger.warning("could not start the async checkpoint writer ahead of the first save: %s", e)
            self._close_process()

    def _send(self, message: Tuple[Any, ...], fds: Sequence[int] = ()) -> None:
        assert self._sock is not None
        self._sock.settimeout(self.timeout_s)  # a writer that does not read fails the send in time
        send_frame(self._sock, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), fds)

    def submit(
        self, idx: int, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any], outcome: AsyncOutcome
    ) -> None:
        """Send ``fn(*args, **kwargs)`` to the writer; its result or error will land in ``outcome``.

        Raises:
            AsyncSaveError: the call cannot be sent to another process (e.g. a lambda, or a
                function of the script run as ``__main__``, which the writer does not import).
        """
        name = _call_name(fn)
        try:
            if getattr(fn, "__module__", None) == "__main__":
                raise TypeError(f"{name} is defined in the script run as __main__, which the writer does not import")
            payload, fds = encode((fn, args, kwargs))
        except Exception as e:  # noqa: BLE001 -- pickling fails in many ways
            raise AsyncSaveError(
                f"[rank {self.rank}] the background part of the save cannot be sent to the writer process: "
                f"{type(e).__name__}: {e} (async_fn and its arguments must be picklable: functions of an importable "
                f"module, tensors, plain data)"
            ) from e
        self.poll()  # settles the calls of a writer that died
        try:
            if self._process is None:
                self._start()
            if not self._pending:  # the writer was idle: its progress is measured from now
                self._state.base = self._state.latest = None
            self._pending[idx] = (outcome, name)
            self._send(("call", idx, name, payload), fds)
        except (OSError, ValueError) as e:  # no interpreter, no socket, a writer that does not read
            self._pending.setdefault(idx, (outcome, name))
            self._stop_writer(f"could not be sent async call {idx} ({name}): {type(e).__name__}: {e}")

    # ------------------------------------------------------------------ receive and check

    def poll(self) -> None:
        """Collect finished calls (non-blocking); fail the pending ones if the writer died, or
        if it did not start, stopped answering or stopped making progress within the timeout."""
        if self._process is None:
            return
        if not self._receive():  # the writer closed its end: it is exiting
            try:
                self._process.wait(1.0)
            except subprocess.TimeoutExpired:
                pass
        if self._process.poll() is not None:
            self._drain_after_exit()
            return
        now = time.monotonic()
        problem = self._stall(now)
        if problem is not None:
            self._stop_writer(problem)
            return
        self._maybe_ping(now)

    def _receive(self, wait_s: float = 0.0) -> bool:
        """Handle what the writer sent (waiting up to ``wait_s`` for something); False at EOF."""
        assert self._sock is not None
        while True:
            if not readable(self._sock, wait_s):
                return True
            try:
                data = self._sock.recv(1 << 16)
            except OSError:
                return False
            if not data:
                return False
            for payload in self._frames.feed(data):
                self._handle(pickle.loads(payload))
            wait_s = 0.0

    def _handle(self, message: Tuple[Any, ...]) -> None:
        kind, state = message[0], self._state
        if kind == "ready":
            state.ready, state.doing = True, "idle"
            if Path(message[2]).resolve() != Path(__file__).resolve().parents[1] / "__init__.py":
                logger.warning("the async writer imported %s, not this process's dist_ckpt", message[2])
        elif kind == "status":
            _, seq, measured_at, cpu, doing, noted = message
            if seq == state.ping_seq:
                state.ping_sent_at = None
            state.doing, state.latest = doing, measured_at
            if state.base is None or cpu > state.base[0] + _PROGRESS_EPS_S or noted != state.base[1]:
                state.base = (cpu, noted, measured_at)
        elif kind == "result":
            self._settle(message[1], message[2], message[3])
            state.base = state.latest = None  # the next call's progress is measured from its first status

    def _settle(self, idx: int, ok: bool, value: Any) -> None:
        outcome, _ = self._pending.pop(idx, (None, ""))
        if outcome is None:
            return
        if ok:
            outcome.succeed(value)
            return
        message = f"[rank {self.rank}] the background save failed: {value['type']}: {value['message']}" + (
            f"\n{value['traceback'].rstrip()}" if value.get("traceback") else ""
        )
        if "storage_errno" not in value:
            outcome.fail(AsyncSaveError(message))
            return
        error = AsyncStorageError(message, operation="write")  # a failed write (see the writer)
        error.errno = value["storage_errno"]
        outcome.fail(error)

    def _stall(self, now: float) -> Optional[str]:
        """Why the writer must be stopped, or None."""
        state, limit = self._state, self.timeout_s
        if not state.ready:
            if now - self._started_at > limit:
                return f"did not start within {limit:g} s (it was {state.doing})"
            return None
        if not self._pending:
            return None
        if state.ping_sent_at is not None and now - state.ping_sent_at > limit:
            return f"stopped answering for {limit:g} s (it was {state.doing})"
        if state.base is not None and state.latest is not None and state.latest - state.base[2] > limit:
            return f"made no progress (used no CPU) for {state.latest - state.base[2]:.0f} s while {state.doing}"
        return None

    def _maybe_ping(self, now: float) -> None:
        state = self._state
        if (
            state.ready
            and self._pending
            and state.ping_sent_at is None
            and now - state.last_ping_at >= self.heartbeat_s
        ):
            state.ping_seq += 1
            state.ping_sent_at = state.last_ping_at = now
            try:
                self._send(("ping", state.ping_seq))
            except OSError as e:
                self._stop_writer(f"could not be asked what it is doing: {type(e).__name__}: {e}")

    # ------------------------------------------------------------------ stop

    def _stop_writer(self, problem: str) -> None:
        """Kill the writer and fail its calls with ``problem`` (what it did wrong)."""
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
            try:
                process.wait(5.0)
            except subprocess.TimeoutExpired:  # a process in uninterruptible I/O: reaped later
                pass
        pid = "?" if process is None else process.pid
        self._fail_pending(
            f"[rank {self.rank}] the background writer (pid {pid}) {problem}; it was stopped and the save was not "
            f"committed (if it was only slow, raise AsyncCallsQueue(writer_timeout_s=...))"
        )
        self._close_process()

    def _drain_after_exit(self) -> None:
        # results sent just before the exit may still be in the socket
        deadline = time.monotonic() + 1.0
        while self._pending and time.monotonic() < deadline and self._receive(wait_s=0.05):
            pass
        assert self._process is not None
        code = self._process.returncode
        how = f"exited with code {code} before the save finished (its error is on this process's stderr)"
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in {s.value for s in signal.Signals} else "?"
            how = f"was killed by signal {-code} ({name}) before the save finished (out of memory, or killed)"
        self._fail_pending(f"[rank {self.rank}] the background save process {how}; the checkpoint was not committed")
        self._close_process()

    def _fail_pending(self, message: str) -> None:
        for idx in sorted(self._pending):
            outcome, name = self._pending.pop(idx)
            outcome.fail(AsyncSaveError(f"{message} [async call {idx}: {name}]"))

    def _close_process(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock, self._process = None, None

    def wait(self, outcome: AsyncOutcome, timeout_s: Optional[float] = None) -> bool:
        """Block until ``outcome`` is done (or ``timeout_s`` passed); return whether it is done.

        Never waits longer than the writer's own timeout allows: a writer that stops making
        progress fails the outcome.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not outcome.done:
            self.poll()
            if outcome.done or self._process is None:
                break
            left = self.heartbeat_s if deadline is None else min(self.heartbeat_s, deadline - time.monotonic())
            if left <= 0:
                break
            self._receive(wait_s=left)
        return outcome.done

    def close(self, abort: bool = False, timeout_s: float = 60.0) -> None:
        """Stop the writer: after its queued calls (``abort=False``, waiting at most
        ``timeout_s``), or now (killed; its calls fail)."""
        process = self._process
        if process is None:
            return
        if not abort and process.poll() is None:
            try:
                self._send(("stop",))
                deadline = time.monotonic() + timeout_s
                while process.poll() is None and time.monotonic() < deadline and self._receive(wait_s=0.05):
                    pass
                process.wait(max(0.0, deadline - time.monotonic()))
            except (OSError, subprocess.TimeoutExpired):
                pass
        if process.poll() is None:
            process.kill()
            process.wait()
        self.poll()  # settles what it sent, fails the rest
        self._close_process()
