"""Deterministic fault injection at the write-side I/O calls of a save.

:class:`Injector` wraps the calls through which dist_ckpt and its backends write -- ``os.open``
(for writing), ``os.write``, ``os.pwrite``, ``os.fsync``, ``os.replace``, ``os.link``, ``open`` (and ``io.open``,
which ``Path.open`` calls: DCP's writer) in a writing mode and the ``write`` calls on the file
objects these return, and zarr-python's ``LocalStore.set`` -- and numbers them in the order they
happen. A first
run with ``at=None`` counts them; then one run per index ``k`` makes call ``k`` fail, either by
raising :class:`InjectedFault` (an ``OSError``, like a failing disk) or by killing the process
on the spot (``os._exit``, which runs no cleanup: a SIGKILL).

Runs are single-threaded where it matters (one safetensors writer thread; the thread that writes
an async save's snapshot from the caller runs while the caller only copies or waits), so call
``k`` is the same step in every run.
"""

from __future__ import annotations

import builtins
import errno
import io
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

KILL_EXIT_CODE = 137
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class InjectedFault(OSError):
    """The I/O error an :class:`Injector` raises at its chosen call."""

    def __init__(self, step: int, name: str) -> None:
        super().__init__(errno.EIO, f"injected I/O fault at write call {step} ({name})")


class _CountedFile:
    """A file object opened for writing whose ``write`` calls are write calls of the injector."""

    def __init__(self, raw: Any, name: str, injector: "Injector") -> None:
        self._raw, self._name, self._injector = raw, name, injector

    def write(self, data: Any) -> int:
        self._injector.hit(f"write {self._name} {len(memoryview(data)) if not isinstance(data, str) else len(data)}")
        return self._raw.write(data)  # type: ignore[no-any-return]

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._raw, attr)

    def __enter__(self) -> "_CountedFile":
        self._raw.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._raw.__exit__(*exc)

    def __iter__(self) -> Any:
        return iter(self._raw)


class Injector:
    """Counts write calls; at call ``at``, raises :class:`InjectedFault` (``kill=False``) or exits
    the process immediately (``kill=True``). Use as a context manager; ``calls`` lists every
    call seen (name and argument), in order."""

    def __init__(self, at: Optional[int] = None, kill: bool = False) -> None:
        self.at = at
        self.kill = kill
        self.calls: List[str] = []
        self._lock = threading.Lock()
        self._saved: Dict[Any, Any] = {}

    def hit(self, name: str) -> None:
        with self._lock:
            index = len(self.calls)
            self.calls.append(name)
        if index == self.at:
            if self.kill:
                os._exit(KILL_EXIT_CODE)
            raise InjectedFault(index, name)

    def _wrap(self, owner: Any, attr: str, describe: Callable[..., Optional[str]]) -> None:
        original = getattr(owner, attr)
        self._saved[(owner, attr)] = original

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            name = describe(*args, **kwargs)
            if name is not None:
                self.hit(f"{attr} {name}")
            return original(*args, **kwargs)

        setattr(owner, attr, wrapper)

    def _wrap_open(self, owner: Any) -> None:
        """``owner.open``: opening for writing is a write call, and so is each ``write`` on the file."""
        original = owner.open
        self._saved[(owner, "open")] = original

        def wrapper(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if not (isinstance(mode, str) and any(c in mode for c in "wax+")) or isinstance(file, int):
                return original(file, mode, *args, **kwargs)
            name = os.path.basename(str(file))
            self.hit(f"open {name}")
            return _CountedFile(original(file, mode, *args, **kwargs), name, self)

        setattr(owner, "open", wrapper)

    def __enter__(self) -> "Injector":
        self._wrap(os, "write", lambda fd, data: f"fd {len(memoryview(data))} bytes")
        self._wrap(os, "pwrite", lambda fd, data, offset: f"fd {len(memoryview(data))} bytes at {offset}")
        self._wrap(os, "fsync", lambda fd: "")
        self._wrap(os, "replace", lambda src, dst, **_: os.path.basename(str(dst)))
        self._wrap(os, "link", lambda src, dst, **_: os.path.basename(str(dst)))
        self._wrap(
            os, "open", lambda path, flags, *a, **k: os.path.basename(str(path)) if flags & _WRITE_FLAGS else None
        )
        self._wrap_open(builtins)
        self._wrap_open(io)
        try:
            from zarr.storage import LocalStore
        except ImportError:  # pragma: no cover -- zarr is a test dependency
            return self
        original_set = LocalStore.set
        self._saved[(LocalStore, "set")] = original_set
        injector = self

        async def set_(store: Any, key: str, value: Any) -> None:
            injector.hit(f"zarr set {key}")
            await original_set(store, key, value)

        LocalStore.set = set_  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        for (owner, attr), original in self._saved.items():
            setattr(owner, attr, original)
        self._saved.clear()


#: in a run of write calls on one file object (``torch.save`` makes one per record of its archive),
#: the calls attacked besides the first and the last: every this many
WRITE_RUN_STRIDE = 16


def attack_points(calls: Sequence[str]) -> List[int]:
    """The indices of ``calls`` (an :attr:`Injector.calls` list) to make fail: every call, except
    that of a run of ``write`` calls on one file object only the first, the last and every
    `WRITE_RUN_STRIDE`-th are kept (the steps between are alike: more bytes into the same file).

    Example:

    ```python
    attack_points(["open f", "write f 1", "write f 2", "write f 3", "fsync "])   # [0, 1, 3, 4]
    ```
    """
    points = []
    for i, call in enumerate(calls):
        in_run = call.startswith("write ") and i > 0 and calls[i - 1].rsplit(" ", 1)[0] == call.rsplit(" ", 1)[0]
        last = i + 1 == len(calls) or calls[i + 1].rsplit(" ", 1)[0] != call.rsplit(" ", 1)[0]
        if not in_run or last or i % WRITE_RUN_STRIDE == 0:
            points.append(i)
    return points


def run_with_fault(
    at: Optional[int], kill: bool, count_file: Optional[str], fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)`` with an :class:`Injector` failing call ``at`` (None: none), writing
    the calls seen, one a line, to ``count_file`` when given. A module-level function, so that an
    async save's background process can run it as its ``AsyncRequest.async_fn``."""
    injector = Injector(at, kill)
    try:
        with injector:
            return fn(*args, **kwargs)
    finally:
        if count_file is not None:
            with builtins.open(count_file, "w") as f:
                f.write("\n".join(injector.calls))
