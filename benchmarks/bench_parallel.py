"""Two-stage and fully-parallel strategies against plain save/load, at DP=2 and DP=4, in one run.

The state is pure data parallelism: every rank holds a full replica of a model of uneven bf16 and
fp32 tensors (``replica_id`` = rank). That is the case these strategies exist for:

* plain save: the main replicas (all on rank 0) write everything; the fully-parallel save
  spreads the writing over the DP ranks;
* plain load: every rank reads every byte from storage; the two-stage and fully-parallel loads
  read each byte once per DP group and broadcast it (gloo, through host memory here).

Every timed load starts from a cold page cache (``posix_fadvise(DONTNEED)`` on every file), and
the raw disk bandwidth is measured in the same run (a file of the state's size, large sequential
writes + fsync, read back cold), so the table shows GiB/s, the ratio to the disk, and the speedup
over the plain strategy (> 1: faster). Loaded values are verified bit-exactly; no timing is
asserted. The last lines say where two-stage loading is slower than a plain load and estimate
the data-parallel size where it starts to pay off (linear in DP between the measured sizes).

Usage::

    python benchmarks/bench_parallel.py                         # 256 MiB replica, DP 2 and 4, /tmp
    python benchmarks/bench_parallel.py --size-mb 1024 --dp 2 4 8 --dir /mnt/nvme/scratch
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import dist_ckpt as dc
from dist_ckpt.backends.registry import StrategyAction, get_default_strategy
from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreLoadShardedStrategy
from dist_ckpt.collectives.distributed import barrier, time_collectively
from dist_ckpt.parallel.fully_parallel import FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper
from dist_ckpt.parallel.two_stage import TwoStageDataParallelLoadShardedStrategy
from dist_ckpt.testing import spawn_ranks
from dist_ckpt.testing.layouts import bitwise_equal, full_tensor
from dist_ckpt.tools.bench import measure_disk

SAVES = ("plain save", "fully-parallel save")
LOADS = (
    "plain load",
    "two-stage load",
    "fully-parallel load",
    "plain load (tensorstore)",
    "two-stage load (tensorstore)",
)


def shapes(total_bytes: int, count: int) -> List[Tuple[str, Tuple[int, int], torch.dtype]]:
    """``count`` tensors of uneven sizes (1x to 4x) adding up to about ``total_bytes``."""
    weights = [1 + (i * 7) % 4 for i in range(count)]
    out = []
    for i, w in enumerate(weights):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        elements = total_bytes * w // sum(weights) // dtype.itemsize
        cols = 1024
        out.append((f"layer{i}.weight", (max(1, elements // cols), cols), dtype))
    return out


def state(
    spec: Sequence[Tuple[str, Tuple[int, int], torch.dtype]], rank: int, empty: bool
) -> Dict[str, dc.ShardedTensor]:
    sd = {}
    for key, shape, dtype in spec:
        data = torch.zeros(shape, dtype=dtype) if empty else full_tensor(key, shape, dtype)
        sd[key] = dc.ShardedTensor.from_rank_offsets(key, data, replica_id=rank)
    return sd


def evict(directory: Path) -> None:
    """Flush every file under ``directory`` and drop it from the page cache."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(rank: int, fn: Callable[[], object], before: Optional[Callable[[], None]] = None) -> float:
    """Wall time of a collective ``fn`` between barriers (the slowest rank's time)."""
    if before is not None and rank == 0:
        before()
    return time_collectively(fn)


def _default(action: StrategyAction) -> object:
    return get_default_strategy(action, "zarr", 1)


def run_rank(rank: int, world: int, directory: str, size_bytes: int, count: int, repeats: int) -> Dict[str, float]:
    """One rank of a DP=``world`` job: best time of each save and load over ``repeats``, and
    the two-stage loader's own split (max over ranks) of its last run into reading and
    broadcasting (``two-stage: <step>`` entries)."""
    torch.set_num_threads(1)
    spec = shapes(size_bytes, count)
    root = Path(directory) / f"dp{world}"
    best: Dict[str, float] = {}
    loaders: Dict[str, Callable[[], object]] = {
        "plain load": lambda: _default(StrategyAction.LOAD_SHARDED),
        "two-stage load": lambda: TwoStageDataParallelLoadShardedStrategy(
            None, base_strategy=_default(StrategyAction.LOAD_SHARDED)
        ),  # type: ignore[arg-type]
        "fully-parallel load": lambda: FullyParallelLoadStrategyWrapper(_default(StrategyAction.LOAD_SHARDED)),  # type: ignore[arg-type]
        "plain load (tensorstore)": TensorStoreLoadShardedStrategy,
        "two-stage load (tensorstore)": lambda: TwoStageDataParallelLoadShardedStrategy(
            None, base_strategy=TensorStoreLoadShardedStrategy()
        ),
    }
    savers: Dict[str, Callable[[], object]] = {
        "plain save": lambda: _default(StrategyAction.SAVE_SHARDED),
        "fully-parallel save": lambda: FullyParallelSaveStrategyWrapper(_default(StrategyAction.SAVE_SHARDED)),  # type: ignore[arg-type]
    }
    sd = state(spec, rank, empty=False)
    for rep in range(repeats):
        order = list(savers) if rep % 2 == 0 else list(reversed(savers))
        for name in order:
            target = root / f"{name.replace(' ', '_')}_{rep}"
            t = timed(rank, lambda: dc.save(sd, target, sharded_strategy=savers[name]()))
            best[name] = min(best.get(name, float("inf")), t)
    ckpt = root / "plain_save_0"
    expected = state(spec, rank, empty=False)
    two_stage = TwoStageDataParallelLoadShardedStrategy(None)
    for rep in range(repeats):
        order = list(loaders) if rep % 2 == 0 else list(reversed(loaders))
        for name in order:
            request = state(spec, rank, empty=True)
            holder: Dict[str, object] = {}
            strategy = loaders[name]()
            if name == "two-stage load":
                two_stage = strategy  # type: ignore[assignment]
            t = timed(
                rank,
                lambda: holder.update(out=dc.load(request, ckpt, sharded_strategy=strategy)),
                before=lambda: evict(ckpt),
            )
            loaded = holder["out"]
            assert isinstance(loaded, dict)
            bad = [k for k in expected if not bitwise_equal(loaded[k], expected[k].data)]  # type: ignore[arg-type]
            if bad:
                raise RuntimeError(f"rank {rank}: {name} loaded wrong values for {bad[:3]}")
            best[name] = min(best.get(name, float("inf")), t)
    for step, times in two_stage.summarize_load_times().items():
        best[f"two-stage: {step}"] = times["max"]
    barrier()
    return best


def crossover(dps: Sequence[int], speedups: Sequence[float]) -> str:
    """Where the speedup crosses 1, linear in DP between measured sizes (or beyond them)."""
    pairs = list(zip(dps, speedups))
    for (d0, s0), (d1, s1) in zip(pairs, pairs[1:]):
        if s0 < 1 <= s1:
            return f"crossover between DP={d0} and DP={d1}, at about DP={d0 + (1 - s0) * (d1 - d0) / (s1 - s0):.1f}"
    if all(s >= 1 for s in speedups):
        return f"faster than plain at every measured DP ({', '.join(str(d) for d in dps)})"
    (d0, s0), (d1, s1) = pairs[-2] if len(pairs) > 1 else pairs[-1], pairs[-1]
    if len(pairs) > 1 and (s1 - s0) / (d1 - d0) > 0.02:
        crossover = d1 + (1 - s1) * (d1 - d0) / (s1 - s0)
        return f"slower at every measured DP; the trend reaches 1.0 at about DP={crossover:.1f} (extrapolated)"
    if len(pairs) > 1 and all(s < 1 for s in speedups):
        return "slower at every measured DP, with no clear trend towards a crossover"
    return "slower at the largest measured DP"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=256, help="bytes of one model replica, MiB")
    parser.add_argument("--tensors", type=int, default=48)
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="data-parallel sizes (= ranks)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per step")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args(argv)
    size = args.size_mb << 20
    work = Path(tempfile.mkdtemp(prefix="dist_ckpt_bench_parallel_", dir=args.dir))
    try:
        raw = [measure_disk(work, size)]
        results = {
            dp: spawn_ranks(run_rank, dp, str(work), size, args.tensors, args.repeats, timeout_s=3600)[0]
            for dp in args.dp
        }
        raw.append(measure_disk(work, size))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_s, read_s = min(w for w, _ in raw), min(r for _, r in raw)
    gib = size / 2**30
    disk_w, disk_r = gib / write_s, gib / read_s
    print(
        f"state: one replica of {args.size_mb} MiB in {args.tensors} tensors, held by every rank (pure DP); dir "
        f"{args.dir}"
    )
    print(
        f"raw disk: write {disk_w:.2f} GiB/s, cold read {disk_r:.2f} GiB/s (best of {len(raw)}: "
        f"{[f'{gib / w:.2f}/{gib / r:.2f}' for w, r in raw]})"
    )
    print(
        "GiB/s = replica size / time; vs disk = that / raw bandwidth; speedup = plain time / this time (> 1: faster)\n"
    )
    rows = [("DP", "step", "seconds", "GiB/s", "vs disk", "speedup")]
    for dp, best in results.items():
        for name in SAVES + LOADS:
            plain = best["plain save" if "save" in name else "plain load"]
            bw = gib / best[name]
            rows.append(
                (
                    str(dp),
                    name,
                    f"{best[name]:.3f}",
                    f"{bw:.2f}",
                    f"{bw / (disk_w if 'save' in name else disk_r):.2f}",
                    f"{plain / best[name]:.2f}",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print()
    dps = list(results)
    for name, plain in (
        ("two-stage load", "plain load"),
        ("fully-parallel load", "plain load"),
        ("fully-parallel save", "plain save"),
    ):
        speedups = [results[dp][plain] / results[dp][name] for dp in dps]
        slower = [f"DP={dp} ({s:.2f}x)" for dp, s in zip(dps, speedups) if s < 1]
        print(
            f"{name}: speedup {', '.join(f'DP={d}: {s:.2f}x' for d, s in zip(dps, speedups))}; "
            f"slower than {plain} at {', '.join(slower) if slower else 'no measured DP'}; {crossover(dps, speedups)}"
        )
    for dp in dps:
        steps = {k.split(": ", 1)[1]: v for k, v in results[dp].items() if k.startswith("two-stage: ")}
        print(
            f"two-stage at DP={dp}, slowest rank's last run: reading {steps.get('load_tensors_from_storage', 0):.3f}s, "
            f"broadcasting {steps.get('broadcast_chunks', 0):.3f}s, metadata and planning "
            f"{sum(v for k, v in steps.items() if k not in ('load_tensors_from_storage', 'broadcast_chunks')):.3f}s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
