"""Run a function on N local ranks with a real gloo process group.

Used by tests that need a particular world size, by the demo and by the benchmarks. Ranks are
separate *spawned* processes (never forked: torch and zarr keep threads and event loops that do
not survive ``fork``). The function and its arguments must be picklable (module-level).

Example:

```python
def work(rank: int, world_size: int, ckpt_dir: str) -> float:
    ...
results = spawn_ranks(work, 4, "/tmp/ckpt")   # [result of rank 0, ..., rank 3]
```
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable, List, Sequence

from dist_ckpt.collectives.distributed import destroy_process_group, init_gloo_process_group


class RankError(RuntimeError):
    """A spawned rank raised; the message holds its rank and traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_process_group(rank: int, world_size: int, port: int, timeout_s: float = 120.0) -> None:
    """Initialize a gloo process group on 127.0.0.1:``port`` for this rank."""
    init_gloo_process_group(rank, world_size, f"tcp://127.0.0.1:{port}", timeout_s)


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: Sequence[Any], queue: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        init_process_group(rank, world_size, port)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 -- report everything to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        destroy_process_group()


def _dead_without_report(procs: Sequence[Any], results: dict[int, Any], failures: List[str]) -> List[str]:
    """Ranks whose process exited without putting a result on the queue."""
    reported = set(results) | {int(f.split()[1]) for f in failures if f.startswith("rank ")}
    return [
        f"rank {rank} exited with code {p.exitcode} without reporting a result (killed, or crashed at start-up)"
        for rank, p in enumerate(procs)
        if rank not in reported and p.exitcode is not None and p.exitcode != 0
    ]


def spawn_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0) -> List[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return their results.

    Raises:
        RankError: if any rank raised (with every failing rank's traceback) or timed out.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: List[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(failures) < world_size:
            try:
                rank, ok, value = queue.get(timeout=0.5)
            except queue_module.Empty:
                dead = _dead_without_report(procs, results, failures)
                if dead:
                    failures.extend(dead)
                    break
                if time.monotonic() > deadline:
                    failures.append(
                        f"timed out after {timeout_s}s waiting for ranks "
                        f"{sorted(set(range(world_size)) - set(results))}"
                    )
                    break
                continue
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank} failed:\n{value}")
    finally:
        # after a failure the surviving ranks may be blocked in a collective: stop them now
        grace = 0.0 if failures else 30.0
        for p in procs:
            p.join(timeout=grace)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise RankError("\n".join(failures))
    return [results[r] for r in range(world_size)]
