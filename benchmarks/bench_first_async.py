"""The first async save of a fresh process, and saves back to back, against a memcpy (issue 40).

Each configuration runs in a fresh Python process (what a job pays at its first checkpoint):

- ``cold``: ``AsyncCallsQueue(start_writer=False)``, no reservation (the writer process starts,
  and the snapshot buffer is faulted in, inside the first save);
- ``warm``: the queue made at start-up starts its writer and reserves the snapshot buffer in the
  background (``snapshot_bytes=``) while the process "trains" (sleeps ``--train-s``).

Per process it measures, in this order: a memcpy of the state's bytes into memory already touched
(the reference the issue's target is stated in), the first async save's blocking time and its
total (until finalized), then ``--back-to-back`` saves each scheduled as soon as the previous
returned (finalized without blocking in between), and a sync save of the same state. It prints
ratios to the memcpy and to the sync save, never absolute seconds alone.

Usage: ``python benchmarks/bench_first_async.py [--mib 512] [--repeats 2] [--dir /tmp]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

CHILD = r"""
import json, sys, time
import torch
import dist_ckpt as dc
from dist_ckpt.asynchronous.queue import AsyncCallsQueue

mode, mib, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
train_s, back_to_back = float(sys.argv[4]), int(sys.argv[5])
n = 8
tensors = [torch.randn(mib * (1 << 20) // 4 // n) for _ in range(n)]
nbytes = sum(t.numel() * 4 for t in tensors)
sd = {f"w{i}": dc.ShardedTensor.from_rank_offsets(f"w{i}", t) for i, t in enumerate(tensors)}
target = [torch.empty_like(t) for t in tensors]
for dst, src in zip(target, tensors):
    dst.copy_(src)  # touched once, so that the timed copy measures a memcpy, not page faults
t0 = time.perf_counter()
for dst, src in zip(target, tensors):
    dst.copy_(src)
memcpy = time.perf_counter() - t0
del target
queue = AsyncCallsQueue(start_writer=(mode == "warm"), snapshot_bytes=(nbytes + (64 << 20) if mode == "warm" else 0))
time.sleep(train_s)  # training before the first checkpoint
out = {"memcpy": memcpy}
t0 = time.perf_counter()
queue.schedule_async_request(dc.save(sd, f"{root}/first", async_sharded_save=True))
out["first_block"] = time.perf_counter() - t0
queue.maybe_finalize_async_calls(blocking=True)
out["first_total"] = time.perf_counter() - t0
blocks = []
for i in range(back_to_back):
    t0 = time.perf_counter()
    queue.schedule_async_request(dc.save(sd, f"{root}/b2b{i}", async_sharded_save=True))
    blocks.append(time.perf_counter() - t0)
    queue.maybe_finalize_async_calls(blocking=False)
queue.close()
out["b2b_blocks"] = blocks
t0 = time.perf_counter()
dc.save(sd, f"{root}/sync")
out["sync"] = time.perf_counter() - t0
print("RESULT " + json.dumps(out))
"""


def run(mode: str, mib: int, root: Path, train_s: float, back_to_back: int) -> Dict[str, object]:
    work = Path(tempfile.mkdtemp(dir=root, prefix=f"first_async_{mode}_"))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, mode, str(mib), str(work), str(train_s), str(back_to_back)],
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    result: Dict[str, object] = json.loads(line[len("RESULT ") :])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--mib", type=int, default=512, help="the state's size")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--train-s", type=float, default=6.0, help="time before the first checkpoint")
    parser.add_argument("--back-to-back", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    rows: Dict[str, List[Dict[str, object]]] = {"cold": [], "warm": []}
    for _ in range(args.repeats):
        for mode in rows:  # interleaved, so that the disk's drift hits both alike
            rows[mode].append(run(mode, args.mib, args.dir, args.train_s, args.back_to_back))
    print(f"{args.mib} MiB, {args.repeats} fresh processes per row; medians of ratios")
    print(f"{'':6} {'first block / memcpy':>22} {'first total / sync':>20} {'back-to-back block / memcpy':>28}")
    for mode, results in rows.items():
        first = statistics.median(float(r["first_block"]) / float(r["memcpy"]) for r in results)  # type: ignore[arg-type]
        total = statistics.median(float(r["first_total"]) / float(r["sync"]) for r in results)  # type: ignore[arg-type]
        b2b = statistics.median(
            b / float(r["memcpy"])  # type: ignore[arg-type]
            for r in results
            for b in r["b2b_blocks"][1:]  # type: ignore[index]
        )
        print(f"{mode:6} {first:22.2f} {total:20.2f} {b2b:28.2f}")


if __name__ == "__main__":
    main()
