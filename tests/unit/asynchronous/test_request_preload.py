"""Megatron-Core's ``AsyncRequest(..., preload_fn=...)``: the staging step replaces ``async_fn_args[1]``
before the background work runs (FileSystemWriterAsync's device-to-host copies)."""

from __future__ import annotations

from typing import Any, List

import pytest

from dist_ckpt.asynchronous.queue import AsyncRequest
from dist_ckpt.errors import AsyncSaveError

CALLS: List[Any] = []


def record(rank: int, buckets: Any, results: Any) -> str:
    CALLS.append((rank, buckets, results))
    return "written"


def test_preload_fn_replaces_the_second_argument_when_the_request_runs() -> None:
    CALLS.clear()
    staged: List[str] = []
    request = AsyncRequest(
        record, (0, "on the device", "queue"), [lambda: staged.append("finalized")], preload_fn=lambda: "on the host"
    )
    assert request.call_args() == (0, "on the host", "queue")
    request.execute_sync()
    assert CALLS == [(0, "on the host", "queue")] and staged == ["finalized"] and request.outcome.result == "written"
    assert AsyncRequest(record, (0, "b", "q")).call_args() == (0, "b", "q")


def test_preload_fn_without_an_argument_to_replace_is_refused() -> None:
    with pytest.raises(AsyncSaveError, match="replaces async_fn_args"):
        AsyncRequest(record, (0,), preload_fn=lambda: 1).call_args()
