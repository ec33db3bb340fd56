"""The async writer process: ``python -m dist_ckpt.asynchronous.writer FD``.

Started by `dist_ckpt.asynchronous.worker.AsyncWorker` as a fresh interpreter that imports
dist_ckpt and never the user's main module, so it works from any script: one without an
``if __name__ == "__main__":`` guard, ``python -c``, a script read from stdin, a notebook.
``FD`` is its end of a Unix socket to the training process (see `channel`).

Two threads:

* the main thread runs the calls, one after another, in the order received, and sends each
  result (or the error) back. It keeps a call's arguments after sending its result, until the
  next call comes or it has been idle for `_RELEASE_IDLE_S`: releasing them unmaps an async
  save's snapshot, which takes a while for a large one (10-14 ms for 750 MiB on the test VM), and
  done at once it would delay the result, or share the CPU with the copy of a save started right
  after;
* the reader thread receives messages: a call is queued for the main thread; a ``ping`` is
  answered at once with what the writer is doing, the CPU seconds its other threads used so
  far and the progress its call noted without using CPU (`progress`); the training process
  takes figures that stop growing for too long as a hang.

It exits when told to (after the calls already received), when the training process closes
the socket, or when its parent process is gone. It calls no collective.

Messages (pickled tuples): from the training process ``("hello", sys_path, rank)``,
``("call", idx, name, payload)`` (with descriptors), ``("ping", seq)``, ``("stop",)``; to it
``("ready", pid, dist_ckpt_file)``, ``("status", seq, measured_at, cpu_s, doing, progress)``,
``("result", idx, ok, value)``.
"""

from __future__ import annotations

import os
import pickle
import queue
import resource
import socket
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

from dist_ckpt.asynchronous.channel import decode, readable, recv_frame, send_frame
from dist_ckpt.asynchronous.progress import progress_count
from dist_ckpt.storage.errors import storage_error_in

__all__ = ["main"]

#: how often the reader thread checks that the parent process is still there (seconds)
_PARENT_CHECK_S = 1.0

#: how long an idle writer keeps the last call's arguments (see the module) before it releases them
_RELEASE_IDLE_S = 1.0

#: a call received: (idx, name, payload, descriptors); None: stop
_Call = Optional[Tuple[int, str, bytes, List[int]]]


class _Writer:
    """The writer's shared state: the socket (sends are serialized), what the main thread is doing."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.calls: "queue.Queue[_Call]" = queue.Queue()
        self.doing = "idle"
        self._send_lock = threading.Lock()
        self._main = threading.main_thread().ident

    def send(self, message: Tuple[Any, ...]) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            send_frame(self.sock, payload)

    def where(self) -> str:
        """The innermost frames of the main thread, e.g. ``sleep (helpers.py:143) < write (x.py:9)``."""
        frame = sys._current_frames().get(self._main or 0)
        frames = traceback.extract_stack(frame)[-2:] if frame is not None else []
        return " < ".join(f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})" for f in reversed(frames))

    def status(self, seq: int) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = usage.ru_utime + usage.ru_stime - time.thread_time()  # all threads but this one
        doing = self.doing if self.doing == "idle" else f"{self.doing} in {self.where()}"
        self.send(("status", seq, time.monotonic(), cpu, doing, progress_count()))


def _read(writer: _Writer, parent: int) -> None:
    """The reader thread: queue calls, answer pings; exit the process when the parent is gone."""
    while True:
        if not readable(writer.sock, _PARENT_CHECK_S):
            if os.getppid() != parent:
                os._exit(0)
            continue
        try:
            payload, fds = recv_frame(writer.sock)
        except (EOFError, OSError):
            os._exit(0)  # the training process is gone: nothing written now could be committed
        message = pickle.loads(payload)
        if message[0] == "call":
            writer.calls.put((message[1], message[2], message[3], fds))
        elif message[0] == "ping":
            writer.status(message[1])
        elif message[0] == "stop":
            writer.calls.put(None)
            return


def _run(writer: _Writer, idx: int, name: str, payload: bytes, fds: List[int]) -> Tuple[Any, ...]:
    """Run one call and send its outcome back; return its name, function and arguments, which the
    caller releases later (see the module)."""
    fn: Any = None
    args: Any = ()
    kwargs: Any = {}
    try:
        writer.doing = f"loading async call {idx} ({name})"
        try:
            fn, args, kwargs = decode(payload, fds)
        finally:
            for fd in fds:
                os.close(fd)
        writer.doing = f"running async call {idx} ({name})"
        outcome: Tuple[Any, ...] = ("result", idx, True, fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 -- every failure goes back to the training process
        # a write that failed is told as the StorageError it is, whatever the writing code made of it
        failed = storage_error_in(e) if isinstance(e, Exception) else None
        shown: BaseException = failed if failed is not None else e
        description: Dict[str, Any] = {
            "type": type(shown).__name__,
            "message": str(shown),
            "traceback": traceback.format_exc(),
        }
        if failed is not None:
            description["storage_errno"] = failed.errno
        outcome = ("result", idx, False, description)
    writer.doing = f"sending the result of async call {idx} ({name})"
    try:
        writer.send(outcome)
    except OSError:
        os._exit(0)  # the training process is gone
    except Exception:  # noqa: BLE001 -- an unpicklable result (pickling fails before anything is sent)
        error = {"type": "TypeError", "message": "the call's result cannot be sent back", "traceback": ""}
        writer.send(("result", idx, False, error))
    writer.doing = "idle"
    return f"async call {idx} ({name})", fn, args, kwargs


def _release(writer: _Writer, held: List[Any]) -> None:
    """Drop the last call's function and arguments (``held``, emptied here), saying so while it
    takes: this unmaps an async save's snapshot."""
    if held:
        writer.doing = f"releasing the arguments of {held[0]}"
        held.clear()
        writer.doing = "idle"


def main(argv: Optional[List[str]] = None) -> int:
    """Serve the training process on the socket whose descriptor is ``argv[0]``."""
    args = sys.argv[1:] if argv is None else argv
    parent = os.getppid()
    sock = socket.socket(fileno=int(args[0]))
    payload, _ = recv_frame(sock)
    hello = pickle.loads(payload)
    # the training process's import path, so that async_fn's module imports here too
    sys.path.extend(p for p in hello[1] if p not in sys.path)
    writer = _Writer(sock)
    import dist_ckpt

    writer.send(("ready", os.getpid(), dist_ckpt.__file__))
    threading.Thread(target=_read, args=(writer, parent), name="dist_ckpt_writer_reader", daemon=True).start()
    held: List[Any] = []  # the last call's name, function and arguments, kept a while (see the module)
    while True:
        try:
            call = writer.calls.get(timeout=_RELEASE_IDLE_S if held else None)
        except queue.Empty:
            _release(writer, held)  # idle for a while
            continue
        _release(writer, held)  # before the next call maps its own snapshot
        if call is None:
            return 0
        held[:] = _run(writer, *call)


if __name__ == "__main__":
    sys.exit(main())
