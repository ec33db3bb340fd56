"""A gate that holds a background write until the test opens it, so a test knows the writer has
not read a byte of the snapshot while training changes every tensor (no hoping for timing)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

from dist_ckpt.asynchronous.queue import AsyncCallsQueue, AsyncRequest
from tests.deadlines import scaled


def gated_call(gate: str, reached: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """In the writer process: mark ``reached``, wait until ``gate`` exists, then run ``fn``."""
    Path(reached).touch()
    deadline = time.monotonic() + scaled(60.0)
    while not Path(gate).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test never opened the writer gate {gate}")
        time.sleep(0.01)
    return fn(*args, **kwargs)


class GatedQueue(AsyncCallsQueue):
    """An AsyncCallsQueue whose requests' background work waits at a gate the test opens."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.gate = directory / "gate-open"
        self.reached = directory / "gate-reached"

    def schedule_async_request(self, async_request: AsyncRequest) -> int:
        if async_request.async_fn is not None:
            async_request = dataclasses.replace(
                async_request,
                async_fn=gated_call,
                async_fn_args=(str(self.gate), str(self.reached), async_request.async_fn, *async_request.async_fn_args),
            )
        return super().schedule_async_request(async_request)

    def wait_until_writer_waits(self) -> None:
        """Block until the writer process sits at the gate: it is running and has written nothing."""
        deadline = time.monotonic() + scaled(60.0)
        while not self.reached.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the writer never reached the gate")
            time.sleep(0.01)

    def open_gate(self) -> None:
        self.gate.touch()
