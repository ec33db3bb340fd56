"""Megatron-Core module path ``dist_ckpt.strategies.async_utils``: re-exports
[`dist_ckpt.asynchronous.queue`][dist_ckpt.asynchronous.queue] and the async callers of
[`dist_ckpt.asynchronous.callers`][dist_ckpt.asynchronous.callers].

Code written for ``megatron.core.dist_checkpointing.strategies.async_utils`` imports from here unchanged.
"""

from dist_ckpt.asynchronous.callers import AsyncCaller, PersistentAsyncCaller, TemporalAsyncCaller
from dist_ckpt.asynchronous.queue import AsyncCallsQueue, AsyncOutcome, AsyncRequest

__all__ = [
    "AsyncCaller",
    "AsyncCallsQueue",
    "AsyncOutcome",
    "AsyncRequest",
    "PersistentAsyncCaller",
    "TemporalAsyncCaller",
]
