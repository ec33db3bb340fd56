"""One rank of a save that tests/unit/test_crash_safety.py kills with SIGKILL at chosen points.

Run as ``python -m tests.crash_saver RANK WORLD PORT CKPT_DIR MODE SIDE_DIR``. The rank saves
:func:`state` into ``CKPT_DIR`` with storage slowed down on purpose -- every data write is cut
into 64 KiB pieces with a pause after each, and every atomic metadata write pauses between
writing its temporary file and renaming it -- so that the test, polling the directory, can
stop the save in each phase. MODE is ``sync`` (the default backend), ``async`` (the same,
through an AsyncCallsQueue: snapshot, background writer, collective finalize) or ``zarr``.

The rank writes ``SIDE_DIR/<event>.<rank>`` markers (``scheduled``, ``worker``: the writer's pid,
``done``) so the test knows what happened; nothing here is used by the library.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict

import torch

from tests.deadlines import scaled

PIECE = 64 << 10
PAUSE_S = 0.006
COMMIT_PAUSE_S = 0.25


def state(rank: int, world: int) -> Dict[str, Any]:
    """What rank ``rank`` saves: two row-split tensors (2 MiB and 1 MiB a rank), an object, a step."""
    import dist_ckpt as dc

    gen = torch.Generator().manual_seed(1234)
    w = torch.randn(256 * world, 2048, generator=gen)
    e = torch.randint(-(2**40), 2**40, (128 * world, 1024), generator=gen)
    return {
        "w": dc.ShardedTensor.from_rank_offsets("w", w[256 * rank : 256 * (rank + 1)].clone(), (0, rank, world)),
        "e": dc.ShardedTensor.from_rank_offsets("e", e[128 * rank : 128 * (rank + 1)].clone(), (0, rank, world)),
        "o": dc.ShardedObject("o", {"rank": rank}, (world,), (rank,)),
        "step": 42,
    }


def full_tensors(world: int) -> Dict[str, torch.Tensor]:
    """The global tensors :func:`state` shards."""
    gen = torch.Generator().manual_seed(1234)
    return {
        "w": torch.randn(256 * world, 2048, generator=gen),
        "e": torch.randint(-(2**40), 2**40, (128 * world, 1024), generator=gen),
    }


def slow_storage() -> None:
    """Slow down every data write and every atomic metadata write of this process."""
    from dist_ckpt.storage import files as local

    original = local.SequentialWriter.write

    def write(self: Any, data: memoryview) -> None:
        view = data.cast("B") if data.format != "B" else data
        for start in range(0, len(view), PIECE):
            original(self, view[start : start + PIECE])
            time.sleep(PAUSE_S)

    local.SequentialWriter.write = write  # type: ignore[method-assign]

    from dist_ckpt.storage import direct_io

    write_at = direct_io.write_at

    def slow_write_at(fd: int, direct_fd: Any, data: memoryview, offset: int) -> int:  # an async save's snapshot
        view = data.cast("B") if data.format != "B" else data
        direct = 0
        for start in range(0, len(view), PIECE):
            direct += write_at(fd, direct_fd, view[start : start + PIECE], offset + start)
            time.sleep(PAUSE_S)
        return direct

    direct_io.write_at = slow_write_at  # type: ignore[assignment]

    write_temp_file = local.write_temp_file

    def slow_temp_file(path: Any, buffers: Any, *, fsync: bool = True) -> Any:
        tmp = write_temp_file(path, buffers, fsync=fsync)
        time.sleep(COMMIT_PAUSE_S)  # the temporary file exists, the final name does not yet
        return tmp

    local.write_temp_file = slow_temp_file  # type: ignore[assignment]
    try:
        from zarr.storage import LocalStore
    except ImportError:
        return
    set_original = LocalStore.set

    async def slow_set(self: Any, key: str, value: Any) -> None:
        await asyncio.sleep(0.03)
        await set_original(self, key, value)

    LocalStore.set = slow_set  # type: ignore[method-assign]


def throttled_write(fn: Callable[..., Any], *args: Any) -> Any:
    """The async_fn run in the background writer: the real one, on slowed storage."""
    slow_storage()
    return fn(*args)


def main(argv: list) -> None:
    rank, world, port = int(argv[0]), int(argv[1]), int(argv[2])
    ckpt, mode, side = Path(argv[3]), argv[4], Path(argv[5])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import dist_ckpt as dc
    from dist_ckpt.asynchronous.queue import AsyncCallsQueue
    from dist_ckpt.testing import init_process_group

    slow_storage()
    init_process_group(rank, world, port, timeout_s=scaled(60))
    sd = state(rank, world)
    if mode == "sync":
        dc.save(sd, ckpt)
    elif mode == "zarr":
        dc.save(sd, ckpt, sharded_strategy=("zarr", 1))
    else:
        # the writer imports async_fn's module and never the script run as __main__ (this one):
        # refer to the function through this module's importable name
        from tests.crash_saver import throttled_write as importable_throttled_write

        queue = AsyncCallsQueue()
        request = dc.save(sd, ckpt, async_sharded_save=True)
        slowed = dataclasses.replace(
            request, async_fn=importable_throttled_write, async_fn_args=(request.async_fn, *request.async_fn_args)
        )
        queue.schedule_async_request(slowed)
        (side / f"worker.{rank}").write_text(str(queue._worker.pid if queue._worker else ""))
        (side / f"scheduled.{rank}").write_text("")
        while not queue.maybe_finalize_async_calls(blocking=False):  # a training loop's polls
            time.sleep(0.05)
        queue.close()
    (side / f"done.{rank}").write_text("")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
