"""A save strategy whose asynchronous background write fails on chosen ranks, for the tests of
failures surfacing at finalization. Its failing function runs in the writer process, which
imports it by module name (``tests.failing_writes``): it must live in an importable module."""

from __future__ import annotations

import dataclasses
import errno
from typing import Any, Tuple

from dist_ckpt.asynchronous.queue import AsyncRequest
from dist_ckpt.backends.safetensors.strategy import SafetensorsSaveShardedStrategy
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.model.sharded import ShardedStateDict
from dist_ckpt.storage import Storage

#: what the failing write raises, for the tests to match
INJECTED = "No space left on device (injected)"


def fail_write(*args: Any, **kwargs: Any) -> None:
    """Stands in for a background write that fails: the disk is full."""
    raise OSError(errno.ENOSPC, INJECTED)


class FailingWriteStrategy(SafetensorsSaveShardedStrategy):
    """The default strategy, whose background write fails on the ranks in ``failing_ranks``
    (the snapshot and everything before it work as usual)."""

    def __init__(self, failing_ranks: Tuple[int, ...] = (0,)) -> None:
        super().__init__()
        self.failing_ranks = failing_ranks

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> AsyncRequest:
        request = super().async_save(sharded_state_dict, checkpoint_dir)
        if get_rank() not in self.failing_ranks:
            return request
        return dataclasses.replace(request, async_fn=fail_write, async_fn_args=(), async_fn_kwargs={})
