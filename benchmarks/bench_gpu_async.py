"""What an async save of CUDA tensors blocks, against device-to-host copies of the same bytes.

One process, one GPU: ``--size-gb`` GiB of fp32 CUDA tensors in ``--tensors`` tensors. Measured in
one run, interleaved: a device-to-host copy of every tensor into page-locked (pinned) host memory
and into pageable host memory (both touched before), and ``--repeats`` async saves with the
default (safetensors) backend, each timed until ``save`` plus ``schedule_async_request`` return
(what training waits for) and until ``maybe_finalize_async_calls(blocking=True)`` returns (the
total). The GPU tensors change right after each save returns; every save is loaded back and
compared bit-exactly with the values at the call. The first save, which allocates and page-locks
the snapshot buffer, is reported apart. Printed: ratios of the blocking time to each copy; no time
is asserted anywhere.

Usage (needs CUDA)::

    python benchmarks/bench_gpu_async.py --size-gb 4 --repeats 3 --dir /path/on/the/disk
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Callable, List

import torch

import dist_ckpt as dc
from dist_ckpt.asynchronous.queue import AsyncCallsQueue
from dist_ckpt.backends.safetensors.strategy import SafetensorsSaveShardedStrategy


def _timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _d2h(tensors: List[torch.Tensor], pinned: bool) -> float:
    """Seconds of a device-to-host copy of every tensor into host memory touched before."""
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in tensors]

    def copy() -> None:
        for h, t in zip(host, tensors):
            h.copy_(t)

    copy()
    return _timed(copy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=4.0)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_async.py needs a CUDA device")
    numel = int(args.size_gb * (1 << 30)) // args.tensors // 4
    tensors = [torch.randn(numel, device="cuda") for _ in range(args.tensors)]
    sd = {f"t{i}": dc.ShardedTensor.from_rank_offsets(f"t{i}", t) for i, t in enumerate(tensors)}
    root = tempfile.mkdtemp(dir=args.dir)
    queue, strategy = AsyncCallsQueue(), SafetensorsSaveShardedStrategy()
    pinned, pageable, blocks, totals, bad = [], [], [], [], 0
    for i in range(args.repeats + 1):
        pinned.append(_d2h(tensors, pinned=True))
        pageable.append(_d2h(tensors, pinned=False))
        expected = [t.cpu() for t in tensors]
        torch.cuda.synchronize()
        start = time.perf_counter()
        queue.schedule_async_request(dc.save(sd, f"{root}/c{i}", sharded_strategy=strategy, async_sharded_save=True))
        blocked = time.perf_counter() - start
        for t in tensors:  # training goes on
            t.add_(1.0)
        queue.maybe_finalize_async_calls(blocking=True)
        total = time.perf_counter() - start
        names = [f"t{k}" for k in range(len(tensors))]
        loaded = dc.load({n: dc.ShardedTensor.from_rank_offsets(n, torch.empty(numel)) for n in names}, f"{root}/c{i}")
        bad += sum(not torch.equal(loaded[n], e) for n, e in zip(names, expected))
        label = "first save (allocates and page-locks the snapshot)" if i == 0 else f"save {i}"
        print(f"{label}: blocks {blocked:.3f} s, total {total:.3f} s", flush=True)
        if i:
            blocks.append(blocked)
            totals.append(total)
    queue.close()
    med = statistics.median
    print(f"{args.size_gb:g} GiB of CUDA tensors in {args.tensors} tensors, {args.repeats} saves (medians)")
    print(f"  async blocking / D2H copy into pinned memory:   {med(blocks) / med(pinned[1:]):.2f}")
    print(f"  async blocking / D2H copy into pageable memory: {med(blocks) / med(pageable[1:]):.2f}")
    print(f"  async total / async blocking:                   {med(totals) / med(blocks):.1f}")
    print("  every loaded tensor bit-exact" if bad == 0 else f"  {bad} loaded tensors DIFFER")


if __name__ == "__main__":
    main()
