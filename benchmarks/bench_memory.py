"""Peak host memory and throughput of saves and loads under a host-memory budget (issue 35).

Spawns ``--world`` ranks (gloo); each holds ``--rank-mib`` MiB in strided tensors (transposed
views: a non-host layout that takes the same staging code as GPU tensors, so the machine needs no
GPU). For each budget (none, then ``--budgets`` MiB), in this order on every rank: a sync save, an
async save (blocking part, then its write) and a load into touched strided tensors, each with its
peak RSS over the RSS before it (VmHWM after ``/proc/self/clear_refs``), and, interleaved with
them, the raw disk: the rank's bytes written with plain sequential writes and fsync, then read back
(`raw_io`). Rank 0 prints one table: peak MiB over base, GiB/s, and the ratio of each save and
load to the raw figure measured next to it.

    .venv/bin/python benchmarks/bench_memory.py --world 2 --rank-mib 768 --budgets 64 256 1024
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from raw_io import BLOCK, read_whole, write_whole  # noqa: E402

import dist_ckpt as dc  # noqa: E402

CLEAR_REFS = Path("/proc/self/clear_refs")
TENSOR_MIB = 64  # each tensor of the state


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measure(fn: Callable[[], object]) -> Tuple[float, int]:
    """(seconds, bytes of peak RSS over the RSS before) of ``fn`` on this rank, after a barrier."""
    dist.barrier()
    CLEAR_REFS.write_text("5")
    base = _kib("VmRSS")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    peak = (_kib("VmHWM") - base) * 1024
    dist.barrier()
    return seconds, peak


def _state(rank: int, world: int, mib: int, fill: bool) -> Dict[str, dc.ShardedTensor]:
    rows = TENSOR_MIB * 2**20 // 4 // 1024
    out = {}
    for i in range(max(1, mib // TENSOR_MIB)):
        data = torch.randn(1024, rows) if fill else torch.zeros(1024, rows)
        out[f"w{i}"] = dc.ShardedTensor.from_rank_offsets(f"w{i}", data.t(), (1, rank, world))
    return out


def _rank(rank: int, world: int, root: str, mib: int, budgets: List[Optional[int]], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29577")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sd = _state(rank, world, mib, fill=True)
    target = _state(rank, world, mib, fill=False)
    nbytes = sum(sh.local_shape[0] * sh.local_shape[1] * 4 for sh in sd.values())
    block = memoryview(bytearray(BLOCK))
    rows = []
    for b, budget in enumerate(budgets):
        ckpt = Path(root) / f"b{b}"
        raw = Path(root) / f"raw_{rank}"
        w_raw, _ = _measure(lambda: write_whole(raw, nbytes, block))
        save_s, save_peak = _measure(lambda: dc.save(sd, ckpt / "sync", host_memory_budget_bytes=budget))

        def async_save() -> None:
            request = dc.save(sd, ckpt / "async", async_sharded_save=True, host_memory_budget_bytes=budget)
            assert request is not None
            request.execute_sync()

        async_s, async_peak = _measure(async_save)
        r_raw, _ = _measure(lambda: read_whole(raw, bytearray(BLOCK)))
        load_s, load_peak = _measure(lambda: dc.load(target, ckpt / "sync", host_memory_budget_bytes=budget))
        raw.unlink()
        shutil.rmtree(ckpt, ignore_errors=True)
        rows.append((budget, save_s, save_peak, async_s, async_peak, load_s, load_peak, w_raw, r_raw))
    peaks = torch.tensor([[r[2], r[4], r[6]] for r in rows], dtype=torch.float64)
    times = torch.tensor([[r[1], r[3], r[5], r[7], r[8]] for r in rows], dtype=torch.float64)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if rank == 0:
        total = nbytes * world / 2**30
        lines = [
            f"state {mib} MiB per rank x {world} ranks; peak RSS over base (max over ranks), GiB/s of the job",
            "budget MiB | save peak | async peak | load peak | save GiB/s (x raw write) | load GiB/s (x raw read)",
        ]
        for (budget, *_), p, t in zip(rows, peaks.tolist(), times.tolist()):
            name = "none" if budget is None else str(budget >> 20)
            lines.append(
                f"{name:>10} | {p[0] / 2**20:9.1f} | {p[1] / 2**20:10.1f} | {p[2] / 2**20:9.1f} | "
                f"{total / t[0]:.3f} ({t[3] / t[0]:.2f}) | {total / t[2]:.3f} ({t[4] / t[2]:.2f})"
            )
        Path(out).write_text("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rank-mib", type=int, default=768, help="state per rank (768: 1.5 GB at 2 ranks)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 256, 1024], help="MiB")
    args = parser.parse_args()
    budgets: List[Optional[int]] = [None, *(m << 20 for m in args.budgets)]
    root = tempfile.mkdtemp(prefix="bench_memory_", dir=os.environ.get("BENCH_DIR"))
    out = os.path.join(root, "result.txt")
    try:
        spawn_args = (args.world, root, args.rank_mib, budgets, out)
        mp.spawn(_rank, args=spawn_args, nprocs=args.world)  # type: ignore[attr-defined,no-untyped-call]
        print(Path(out).read_text(), end="")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
