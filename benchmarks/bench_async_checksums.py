"""What asynchronous saves block, and what checksums cost, on the default (safetensors) backend.

The state is the demo's GPT-like model (bf16) plus distributed-optimizer Adam moments (fp32)
(:mod:`dist_ckpt.tools.gpt_state`), scaled to ``--size-gb`` GiB, TP=N over N spawned ranks,
CPU tensors. Each rank keeps one save strategy object and one :class:`AsyncCallsQueue` for the
whole run (a training job's situation: the snapshot buffer and the writer process are reused;
both are set up by an untimed warm-up save). Then, ``--repeats`` times, interleaved so that a
slow minute of the disk hits every measurement alike:

1. *sync save, no checksums* (``checksum_block_bytes=None``) and *sync save* (the default, a
   crc32c per 1 MiB block): the checksum overhead on save;
2. *async save, blocking part*: ``dc.save(..., async_sharded_save=True)`` plus
   ``schedule_async_request`` -- what training waits for (validation, common state, the snapshot
   into shared memory) -- then the background write and the collective finalization, timed
   until ``maybe_finalize_async_calls(blocking=True)`` returns. The first run shows the first
   save into a fresh snapshot buffer, and the first save of a strategy whose buffer was
   reserved at start-up (``reserve_snapshot``);
3. *load*, same layout, in place into allocated tensors, from a cold page cache and again warm,
   with and without checksum verification: the checksum overhead on load.

Times are wall-clock between barriers (the slowest rank); each table row shows the best run and
all runs. Ratios: async blocking / sync save (goal <= 0.1), sync save / sync save without
checksums and load / load without verification (goal <= 1.1). Every load is verified bit-exact;
no time is asserted.

Usage::

    python benchmarks/bench_async_checksums.py --size-gb 1 --ranks 2 --repeats 3 --dir /path/on/the/disk
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from dist_ckpt.asynchronous.queue import AsyncCallsQueue
from dist_ckpt.backends.safetensors.strategy import (
    SafetensorsLoadOptions,
    SafetensorsLoadShardedStrategy,
    SafetensorsSaveOptions,
    SafetensorsSaveShardedStrategy,
)
from dist_ckpt.collectives.distributed import barrier, time_collectively
from dist_ckpt.engine.load import load
from dist_ckpt.engine.save import save
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.testing import spawn_ranks
from dist_ckpt.tools.gpt_state import (
    DemoConfig,
    Layout,
    build_sharded_state_dict,
    evict_page_cache,
    expected_values,
    sharded_tensors,
    state_bytes,
)

OPS = [
    ("save_plain", "sync save, no checksums"),
    ("save", "sync save (crc32c per 1 MiB block)"),
    ("async_first", "async save, blocking part, first save (fresh snapshot buffer)"),
    ("async_reserved", "async save, blocking part, first save after reserve_snapshot"),
    ("async_block", "async save, blocking part"),
    ("async_total", "async save, blocking part + background write + finalize"),
    ("load_plain_cold", "load, cold cache, no verification"),
    ("load_cold", "load, cold cache, checksums verified"),
    ("load_plain_warm", "load, warm cache, no verification"),
    ("load_warm", "load, warm cache, checksums verified"),
]


@dataclass(frozen=True)
class Job:
    cfg: DemoConfig
    directory: str
    repeats: int


def _evict(rank: int, directory: str) -> None:
    barrier()
    if rank == 0:
        evict_page_cache(directory)
    barrier()


def _request(cfg: DemoConfig, rank: int, world: int) -> Dict[str, Any]:
    sd = build_sharded_state_dict(cfg, Layout(world, 1), rank, fill=False)
    for sh in sharded_tensors(sd):
        assert sh.data is not None
        sh.data.zero_()
    return sd


def _bad(sd: Dict[str, Any], seed: int) -> int:
    return sum(
        1
        for sh in sharded_tensors(sd)
        if sh.data is not None
        and not torch.equal(sh.data.view(torch.uint8), expected_values(sh, seed).view(torch.uint8))
    )


def timing_job(rank: int, world: int, job: Job) -> Dict[str, List[float]]:
    torch.set_num_threads(1)
    root = Path(job.directory)
    plain = SafetensorsSaveShardedStrategy(SafetensorsSaveOptions(checksum_block_bytes=None))
    default = SafetensorsSaveShardedStrategy()
    asynchronous = SafetensorsSaveShardedStrategy()
    reserved = SafetensorsSaveShardedStrategy()
    verified = SafetensorsLoadShardedStrategy()
    unverified = SafetensorsLoadShardedStrategy(SafetensorsLoadOptions(verify_checksums=False))
    queue = AsyncCallsQueue()
    # warm-up: imports, first collectives, the writer process (untimed; a job pays them once)
    tiny = {"warm": ShardedTensor.from_rank_offsets("warm", torch.ones(4), replica_id=rank)}
    save(tiny, root / "warm_sync", sharded_strategy=plain)
    load(tiny, root / "warm_sync")
    queue.schedule_async_request(
        save(tiny, root / "warm_async", sharded_strategy=SafetensorsSaveShardedStrategy(), async_sharded_save=True)
    )
    queue.maybe_finalize_async_calls(blocking=True)

    sd = build_sharded_state_dict(job.cfg, Layout(world, 1), rank, fill=True)
    reserved.reserve_snapshot(sd)  # at start-up, untimed
    out: Dict[str, List[float]] = {op: [] for op, _ in OPS}
    out["bad"] = [0.0]
    for i in range(job.repeats):
        out["save_plain"].append(time_collectively(lambda: save(sd, root / f"plain{i}", sharded_strategy=plain)))
        out["save"].append(time_collectively(lambda: save(sd, root / f"default{i}", sharded_strategy=default)))

        def blocking() -> None:
            queue.schedule_async_request(
                save(sd, root / f"async{i}", sharded_strategy=asynchronous, async_sharded_save=True)
            )

        block = time_collectively(blocking)
        out["async_first" if i == 0 else "async_block"].append(block)
        out["async_total"].append(block + time_collectively(lambda: queue.maybe_finalize_async_calls(blocking=True)))
        if i == 0:
            out["async_reserved"].append(
                time_collectively(
                    lambda: queue.schedule_async_request(
                        save(sd, root / "reserved", sharded_strategy=reserved, async_sharded_save=True)
                    )
                )
            )
            queue.maybe_finalize_async_calls(blocking=True)
            barrier()
            if rank == 0:
                shutil.rmtree(root / "reserved", ignore_errors=True)
        for name, strategy in (("load_plain", unverified), ("load", verified)):
            request = _request(job.cfg, rank, world)  # dc.load fills its tensors in place

            def load_it(request: Dict[str, Any] = request, strategy: Any = strategy) -> None:
                load(request, root / f"default{i}", sharded_strategy=strategy)

            _evict(rank, str(root / f"default{i}"))
            out[f"{name}_cold"].append(time_collectively(load_it))
            out[f"{name}_warm"].append(time_collectively(load_it))
            out["bad"][0] += _bad(request, job.cfg.seed)
        check = _request(job.cfg, rank, world)
        load(check, root / f"async{i}")
        out["bad"][0] += _bad(check, job.cfg.seed)
        del check
        barrier()
        if rank == 0:
            for name in ("plain", "default", "async"):
                shutil.rmtree(root / f"{name}{i}", ignore_errors=True)
        barrier()
    queue.close()
    return out


def _merge(per_rank: Sequence[Dict[str, List[float]]]) -> Dict[str, List[float]]:
    """Per operation and run: the slowest rank's time."""
    return {op: [max(r[op][i] for r in per_rank) for i in range(len(per_rank[0][op]))] for op, _ in OPS}


def render(times: Dict[str, List[float]], nbytes: int) -> str:
    rows = [["operation", "best s", "GiB/s", "all runs (s)"]]
    for op, label in OPS:
        runs = times[op]
        if runs:
            best = min(runs)
            rows.append([label, f"{best:.3f}", f"{nbytes / 2**30 / best:.2f}", " ".join(f"{r:.3f}" for r in runs)])
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    table = "\n".join(
        "  ".join(c.ljust(w) if i in (0, 3) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    )

    def ratio(a: str, b: str) -> str:
        return f"{min(times[a]) / min(times[b]):.3f}" if times[a] and times[b] else "n/a"

    lines = [
        table,
        "",
        "ratios (best runs):",
        f"  async blocking / sync save                 {ratio('async_block', 'save')}   (goal <= 0.1)",
        f"    first save, fresh buffer / reserved      {ratio('async_first', 'save')} / "
        f"{ratio('async_reserved', 'save')}",
        f"  sync save / sync save without checksums    {ratio('save', 'save_plain')}   (goal <= 1.1)",
        f"  load / load without verification, cold     {ratio('load_cold', 'load_plain_cold')}   (goal <= 1.1)",
        f"  load / load without verification, warm     {ratio('load_warm', 'load_plain_warm')}",
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="state size in GiB (default: %(default)s)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs (default: %(default)s)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="directory on the storage to measure (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    cfg = DemoConfig.for_size(int(args.size_gb * 2**30), args.ranks)
    nbytes = state_bytes(cfg)
    work = Path(tempfile.mkdtemp(prefix="bench_async_", dir=args.dir))
    try:
        per_rank = spawn_ranks(timing_job, args.ranks, Job(cfg, str(work), args.repeats), timeout_s=3600)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"async save and checksums benchmark: {nbytes / 2**30:.2f} GiB state (hidden {cfg.hidden}, {cfg.layers} "
        f"layers), {args.ranks} ranks, CPU tensors, {args.repeats} runs, under {args.dir}\n"
    )
    print(render(_merge(per_rank), nbytes))
    bad = int(sum(r["bad"][0] for r in per_rank))
    if bad:
        print(f"\nerror: {bad} loaded tensors differ from what was saved", file=sys.stderr)
        return 1
    print("\nevery loaded tensor verified bit-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
