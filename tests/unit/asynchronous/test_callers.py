"""Megatron-Core's async callers (``strategies.async_utils``) in one process, used as its AsyncCallsQueue
uses them: schedule a frozen request, poll ``is_current_async_call_done`` until True, finalize, close.
Each test starts a writer process (about 2 s here); the multi-rank agreement is in
tests/distributed/test_async_callers.py."""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from dist_ckpt.errors import AsyncSaveError
from dist_ckpt.strategies.async_utils import AsyncCaller, AsyncRequest, PersistentAsyncCaller, TemporalAsyncCaller


def append_line(path: str, text: str) -> int:
    """The background work of the tests: append to a file (returns the file's new size)."""
    with open(path, "a") as f:
        f.write(text + "\n")
    with open(path) as f:
        return len(f.read())


def fail(message: str) -> None:
    raise ValueError(message)


def _finish(caller: AsyncCaller, request: AsyncRequest) -> None:
    while not caller.is_current_async_call_done(blocking=False):
        caller.is_current_async_call_done(blocking=True)
    for fn in request.finalize_fns:
        fn()


def test_persistent_caller_runs_requests_in_order_on_one_writer(tmp_path: Path) -> None:
    out = str(tmp_path / "log")
    finalized: List[str] = []
    caller = PersistentAsyncCaller()
    try:
        requests = [
            AsyncRequest(append_line, (out, f"save {i}"), [lambda i=i: finalized.append(f"save {i}")]).freeze()
            for i in range(2)
        ]
        for r in requests:
            caller.schedule_async_call(r)
        pid = caller._worker.pid if caller._worker else None
        for r in requests:
            _finish(caller, r)
        assert caller.is_current_async_call_done()  # nothing current: done
        assert caller._worker is not None and caller._worker.pid == pid  # one process for both
    finally:
        caller.close()
    assert Path(out).read_text() == "save 0\nsave 1\n" and finalized == ["save 0", "save 1"]
    assert [r.outcome.result for r in requests] == [7, 14]


def test_temporal_caller_stops_its_writer_when_the_request_is_done(tmp_path: Path) -> None:
    out = str(tmp_path / "log")
    caller = TemporalAsyncCaller()
    request = AsyncRequest(append_line, (out, "placeholder"), [], preload_fn=lambda: "staged").freeze()
    caller.schedule_async_call(request)
    with pytest.raises(AsyncSaveError, match="one request at a time"):
        caller.schedule_async_call(request)
    assert caller.is_current_async_call_done(blocking=True, no_dist=True)
    assert caller._worker is None and Path(out).read_text() == "staged\n"  # preload_fn's args[1]
    caller.schedule_async_call(AsyncRequest(None, ()).freeze())  # nothing to run: no process
    assert caller._worker is None and caller.is_current_async_call_done()


def test_a_failed_request_raises_when_checked_and_the_caller_goes_on(tmp_path: Path) -> None:
    caller = PersistentAsyncCaller()
    try:
        caller.schedule_async_call(AsyncRequest(fail, ("bad value",)).freeze())
        with pytest.raises(AsyncSaveError, match=r"rank 0.*ValueError: bad value"):
            caller.is_current_async_call_done(blocking=True)
        assert caller.is_current_async_call_done()  # the failed request is over
        caller.schedule_async_call(AsyncRequest(append_line, (str(tmp_path / "log"), "after")).freeze())
        assert caller.is_current_async_call_done(blocking=True)
    finally:
        caller.close()
    with pytest.raises(AsyncSaveError, match="cannot be sent"):
        TemporalAsyncCaller().schedule_async_call(AsyncRequest(lambda: None, ()).freeze())
