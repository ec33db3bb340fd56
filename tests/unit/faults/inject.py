"""Deterministic fault injection at the write-side I/O calls of a save.

:class:`Injector` wraps the calls through which dist_ckpt and its backends write -- ``os.open``
(for writing), ``os.write``, ``os.fsync``, ``os.replace``, ``os.link``, ``open`` in a writing
mode, and zarr-python's ``LocalStore.set`` -- and numbers them in the order they happen. A first
run with ``at=None`` counts them; then one run per index ``k`` makes call ``k`` fail, either by
raising :class:`InjectedFault` (an ``OSError``, like a failing disk) or by killing the process
on the spot (``os._exit``, which runs no cleanup: a SIGKILL).

Runs are single-threaded where it matters (one safetensors writer thread), so call ``k`` is the
same step in every run.
"""

from __future__ import annotations

import builtins
import errno
import os
import threading
from typing import Any, Callable, Dict, List, Optional

KILL_EXIT_CODE = 137
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class InjectedFault(OSError):
    """The I/O error an :class:`Injector` raises at its chosen call."""

    def __init__(self, step: int, name: str) -> None:
        super().__init__(errno.EIO, f"injected I/O fault at write call {step} ({name})")


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

    def __enter__(self) -> "Injector":
        self._wrap(os, "write", lambda fd, data: f"fd {len(memoryview(data))} bytes")
        self._wrap(os, "fsync", lambda fd: "")
        self._wrap(os, "replace", lambda src, dst, **_: os.path.basename(str(dst)))
        self._wrap(os, "link", lambda src, dst, **_: os.path.basename(str(dst)))
        self._wrap(
            os, "open", lambda path, flags, *a, **k: os.path.basename(str(path)) if flags & _WRITE_FLAGS else None
        )
        self._wrap(
            builtins,
            "open",
            lambda file, mode="r", *a, **k: (
                os.path.basename(str(file)) if isinstance(mode, str) and any(c in mode for c in "wax+") else None
            ),
        )
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


def run_with_fault(
    at: Optional[int], kill: bool, count_file: Optional[str], fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)`` with an :class:`Injector` failing call ``at`` (None: none), writing
    the number of calls seen to ``count_file`` when given. A module-level function, so that an
    async save's background process can run it as its ``AsyncRequest.async_fn``."""
    injector = Injector(at, kill)
    try:
        with injector:
            return fn(*args, **kwargs)
    finally:
        if count_file is not None:
            with builtins.open(count_file, "w") as f:
                f.write(str(len(injector.calls)))
