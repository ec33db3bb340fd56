"""Megatron-Core module path ``dist_ckpt.strategies.async_utils``: re-exports
[`dist_ckpt.asynchronous.queue`][dist_ckpt.asynchronous.queue].

Code written for ``megatron.core.dist_checkpointing.strategies.async_utils`` imports from here unchanged.
"""

from dist_ckpt.asynchronous.queue import AsyncCallsQueue, AsyncOutcome, AsyncRequest

__all__ = ["AsyncCallsQueue", "AsyncOutcome", "AsyncRequest"]
