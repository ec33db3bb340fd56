"""Megatron-Core module path ``dist_ckpt.strategies.async_utils``: re-exports
[`dist_ckpt.async_save.queue`][dist_ckpt.async_save.queue].

Code written for ``megatron.core.dist_checkpointing.strategies.async_utils`` imports from here unchanged.
"""

from dist_ckpt.async_save.queue import AsyncCallsQueue, AsyncOutcome, AsyncRequest

__all__ = ["AsyncCallsQueue", "AsyncOutcome", "AsyncRequest"]
