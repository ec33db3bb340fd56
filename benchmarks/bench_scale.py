"""Scale benchmark: shard metadata, sharding validation, index and load planning at 8 to 1,024 ranks.

Two parts (issue 14):

* **Simulated ranks** (default): the shard metadata of W ranks x T tensors is built in one
  process, rank by rank, in a tensor x pipeline x data parallel layout (TP-split weights with DP
  replicas, layer norms replicated over TP, pipeline-stacked layers, distributed-optimizer state
  as flattened ranges split over DP, one ShardedObject per rank), and run through the real code
  of each step. Per rank: *encode* (the shard table a rank sends), *unchanged* (what a repeated
  save costs a rank: its shards' fields, compared with the recorded ones), *index part* (the
  index part a rank sends after writing). On rank 0: *gather-decode*, *validate*, *index
  merge*, *index write*. Per loading rank: *read index* and *plan* (a rank's reads for the same
  layout, no data read). Prints seconds and bytes per step and how they grow with W.

* **Real ranks** (``--real``, under ``mpiexec -n 8``): every rank saves T tiny tensors with the
  default backend; rounds of (save without validation, first save with validation, repeated
  save with validation) report what validation adds to a save, as medians.

Examples::

    python benchmarks/bench_scale.py                                  # W in {8,64,256,1024} x T in {100,1000}
    python benchmarks/bench_scale.py --worlds 1024 --tensors 1000 --flat-fraction 1.0   # 1M index rows
    mpiexec -n 8 python benchmarks/bench_scale.py --real --tensors 4000 --rounds 5

No time is asserted; the machine's load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from dist_ckpt.backends.safetensors.index import file_name, read_index, shard_name
from dist_ckpt.backends.safetensors.index_parts import IndexPart, merge_index_parts
from dist_ckpt.backends.safetensors.index_write import write_merged
from dist_ckpt.backends.safetensors.load import plan_reads
from dist_ckpt.backends.safetensors.write import PartResult, plan_file
from dist_ckpt.collectives.shard_metadata import decode_tables
from dist_ckpt.engine.checks.coverage import find_table_problems
from dist_ckpt.model.shard_table import ShardTable, encode_table, shard_fields
from dist_ckpt.model.sharded import ShardedBase, ShardedObject, ShardedTensor, is_main_replica
from dist_ckpt.storage import LocalStorage

LAYOUTS = {8: (2, 2, 2), 64: (4, 4, 4), 256: (8, 4, 8), 1024: (8, 8, 16)}
BLOCK = 1 << 20


def layout(world: int) -> Tuple[int, int, int]:
    """(TP, PP, DP) of ``world`` ranks."""
    if world in LAYOUTS:
        return LAYOUTS[world]
    tp = 2 if world % 2 == 0 else 1
    pp = 2 if (world // tp) % 2 == 0 else 1
    return tp, pp, world // (tp * pp)


def rank_shards(
    rank: int, world: int, tensors: int, hidden: int = 256, flat_fraction: float = 0.1, data: bool = False
) -> List[ShardedBase]:
    """Rank ``rank``'s shards: ``tensors - 1`` tensors of its pipeline stage and one object."""
    tp, pp, dp = layout(world)
    t, p, d = rank % tp, (rank // tp) % pp, rank // (tp * pp)
    flat_every = max(1, round(1 / flat_fraction)) if flat_fraction > 0 else 0

    def make(key: str, dtype: torch.dtype, local: Tuple[int, ...], glob: Tuple[int, ...], offset: Tuple[int, ...],
             replica: object, prepend: int = 0, flat: Optional[slice] = None) -> ShardedTensor:  # fmt: skip
        value = None
        if data:
            shape = (flat.stop - flat.start,) if flat is not None else local
            value = torch.zeros(shape, dtype=dtype)
        return ShardedTensor(key, value, dtype, local, glob, offset, None, replica, prepend, False, flat)

    out: List[ShardedBase] = []
    for i in range(tensors - 1):
        kind, layer = i % 10, i // 10
        key = f"decoder.layers.{p}.{layer}.w{kind}"
        if flat_every and i % flat_every == flat_every - 1:  # distributed-optimizer state: flat ranges over DP
            local = (4 * hidden // tp, hidden)
            numel = local[0] * local[1]
            lo, hi = numel * d // dp, numel * (d + 1) // dp
            out.append(make(f"optimizer.exp_avg.{key}", torch.float32, local, (4 * hidden, hidden),
                            (t * local[0], 0), 0, flat=slice(lo, hi)))  # fmt: skip
        elif kind <= 5:  # column / row parallel weights, replicated over DP
            axis = kind % 2
            glob = (4 * hidden, hidden)
            local = tuple(g // tp if a == axis else g for a, g in enumerate(glob))
            offset = tuple(t * local[a] if a == axis else 0 for a in range(2))
            out.append(make(key, torch.bfloat16, local, glob, offset, (0, 0, d)))
        elif kind <= 7:  # layer norms: replicated over TP and DP
            out.append(make(key, torch.float32, (hidden,), (hidden,), (0,), (0, t, d)))
        else:  # layers stacked along the pipeline stages
            out.append(make(f"decoder.stacked.{layer}.w{kind}", torch.bfloat16, (hidden // tp, hidden),
                            (pp, hidden, hidden), (p, t * (hidden // tp), 0), (0, 0, d), prepend=1))  # fmt: skip
    out.append(ShardedObject("rng_state", {"rank": rank} if data else None, (pp, tp, dp), (p, t, d)))
    return out


# --------------------------------------------------------------------------- simulated ranks


@dataclass
class Row:
    world: int
    tensors: int
    seconds: Dict[str, float] = field(default_factory=dict)
    cpu: Dict[str, float] = field(default_factory=dict)
    bytes: Dict[str, int] = field(default_factory=dict)


def _index_part(rank: int, shards: Sequence[ShardedBase]) -> bytes:
    """What a rank sends to rank 0 after writing: its two files as a save plans them, with crcs."""
    mains = [s for s in shards if isinstance(s, ShardedTensor) and is_main_replica(s.replica_id)]

    def stored(sh: ShardedTensor) -> Tuple[int, ...]:
        rng = sh.flattened_range
        return (rng.stop - rng.start,) if rng is not None else sh.full_local_shape

    files = []
    results = []
    for w, group in enumerate(_split(mains, 2)):
        plan = plan_file(file_name(rank, w), [(shard_name(sh), sh.dtype, stored(sh)) for sh in group], {})
        files.append((plan, group))
        crcs = tuple("00000000" * -(-(e - b) // BLOCK) for b, e in plan.ranges)
        results.append(PartResult(plan.name, 0, crcs, "00000000"))
    return IndexPart(rank, mains, files).encode(results, checksums=True)


def _split(items: List[ShardedTensor], parts: int) -> List[List[ShardedTensor]]:
    return [g for g in (items[i::parts] for i in range(parts)) if g]


class Clock:
    """Wall and CPU seconds of each step (CPU time: what the step costs on a busy machine)."""

    def __init__(self) -> None:
        self.wall: Dict[str, float] = {}
        self.cpu: Dict[str, float] = {}
        self._mark = (time.perf_counter(), time.process_time())

    def start(self) -> None:
        self._mark = (time.perf_counter(), time.process_time())

    def stop(self, name: str) -> None:
        wall, cpu = time.perf_counter() - self._mark[0], time.process_time() - self._mark[1]
        self.wall[name] = self.wall.get(name, 0.0) + wall
        self.cpu[name] = self.cpu.get(name, 0.0) + cpu
        self.start()


def simulate(world: int, tensors: int, flat_fraction: float, plan_ranks: Sequence[int], tmp: Path) -> Row:
    row = Row(world, tensors)
    blobs: List[bytes] = []
    parts: List[bytes] = []
    clock = Clock()
    for rank in range(world):
        shards = rank_shards(rank, world, tensors, flat_fraction=flat_fraction)
        recorded = shard_fields(shards)  # what the rank kept at the last passing check
        clock.start()
        blobs.append(encode_table(ShardTable.from_shards(shards, rank)))
        clock.stop("encode")
        if shard_fields(shards) != recorded:  # a repeated save: describe the shards, compare
            raise SystemExit("the simulated layout is not deterministic")
        clock.stop("unchanged")
        parts.append(_index_part(rank, shards))
        clock.stop("index_part")
    for name in ("encode", "unchanged", "index_part"):  # per rank: the mean
        clock.wall[name] /= world
        clock.cpu[name] /= world
    row.bytes.update(
        shards=world * tensors,
        gathered=sum(map(len, blobs)),
        gathered_padded=world * max(map(len, blobs)),
        index_parts=sum(map(len, parts)),
    )
    gc.collect()  # a rank's process does not hold the simulation's other ranks: time from a collected heap
    clock.start()
    table = decode_tables(blobs)
    clock.stop("decode")
    problems = find_table_problems(table)
    clock.stop("validate")
    if problems:
        raise SystemExit(f"the simulated layout is invalid: {problems[:3]}")
    del table
    tracemalloc.start()  # again, for the peak memory of rank 0's decode + validate (numpy is traced)
    find_table_problems(decode_tables(blobs))
    row.bytes["rank0_peak"] = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del blobs
    ckpt = tmp / f"w{world}_t{tensors}"
    gc.collect()
    clock.start()
    merged = merge_index_parts(parts)
    clock.stop("index_merge")
    write_merged(merged, LocalStorage(ckpt), BLOCK)
    clock.stop("index_write")
    root = ckpt / "safetensors"
    row.bytes.update(
        index_rows=int(merged.rows.shape[0]),
        index_json=(root / "index.json").stat().st_size,
        index_table=sum(p.stat().st_size for p in root.glob("index.*.bin")),
    )
    del parts, merged
    planned = []
    per_rank: List[Clock] = []
    for rank in plan_ranks:
        request = [s for s in rank_shards(rank % world, world, tensors, flat_fraction=flat_fraction)
                   if isinstance(s, ShardedTensor)]  # fmt: skip
        gc.collect()
        c = Clock()
        index = read_index(ckpt)
        c.stop("read_index")
        _, by_file = plan_reads(request, index)
        c.stop("plan")
        per_rank.append(c)
        planned.append(sum(len(v) for v in by_file.values()))
    for name in ("read_index", "plan"):  # the slowest of the ranks planned
        clock.wall[name] = max(c.wall[name] for c in per_rank)
        clock.cpu[name] = max(c.cpu[name] for c in per_rank)
    row.seconds, row.cpu = clock.wall, clock.cpu
    row.bytes.update(planned_shards=max(planned))
    shutil.rmtree(ckpt)
    return row


STEPS = [
    ("encode", "per rank"),
    ("unchanged", "per rank"),
    ("decode", "rank 0"),
    ("validate", "rank 0"),
    ("index_part", "per rank"),
    ("index_merge", "rank 0"),
    ("index_write", "rank 0"),
    ("read_index", "per rank"),
    ("plan", "per rank"),
]


def report(rows: List[Row]) -> None:
    print(f"load average: {os.getloadavg()}")
    for title, attr in (("wall seconds", "seconds"), ("CPU seconds of the process", "cpu")):
        print(f"\n{title}")
        print(f"{'W':>5} {'T':>5} {'shards':>9} | " + " ".join(f"{name:>11}" for name, _ in STEPS))
        print(f"{'':>5} {'':>5} {'':>9} | " + " ".join(f"{where:>11}" for _, where in STEPS))
        for r in rows:
            values = getattr(r, attr)
            cells = " ".join(f"{values[name]:>11.4f}" for name, _ in STEPS)
            print(f"{r.world:>5} {r.tensors:>5} {r.bytes['shards']:>9} | {cells}")
    print()
    print(f"{'W':>5} {'T':>5} | {'gathered':>10} {'padded':>10} {'/shard':>7} | {'idx parts':>10} {'idx rows':>9} "
          f"{'index.json':>10} {'table':>10} | {'rank0 s':>8} {'growth':>7} | {'load s':>7} {'planned':>7} | "
          f"{'r0 peak':>9}")  # fmt: skip
    previous: Dict[int, Row] = {}
    for r in rows:
        rank0 = r.seconds["decode"] + r.seconds["validate"]
        prev = previous.get(r.tensors)
        growth = f"{rank0 / (prev.seconds['decode'] + prev.seconds['validate']):.1f}x" if prev else "-"
        b = r.bytes
        print(
            f"{r.world:>5} {r.tensors:>5} | {b['gathered'] / 1e6:>8.2f}MB {b['gathered_padded'] / 1e6:>8.2f}MB "
            f"{b['gathered'] / b['shards']:>7.1f} | {b['index_parts'] / 1e6:>8.2f}MB {b['index_rows']:>9} "
            f"{b['index_json'] / 1e6:>8.2f}MB {b['index_table'] / 1e6:>8.2f}MB | {rank0:>8.3f} {growth:>7} | "
            f"{r.seconds['read_index'] + r.seconds['plan']:>7.3f} {b['planned_shards']:>7} | "
            f"{b['rank0_peak'] / 1e6:>7.1f}MB"
        )
        previous[r.tensors] = r
    print(
        "rank0 s = decode + validate, wall (what a save's validation costs rank 0), growth vs the previous W at this T;"
        "\nload s = read index + plan, wall, the slowest of 3 loading ranks; planned = stored shards it reads;"
        "\nr0 peak = peak memory allocated by rank 0's decode + validate (tracemalloc)"
    )


# --------------------------------------------------------------------------- real ranks


def real(tensors: int, rounds: int, directory: Optional[str]) -> None:
    from mpi4py import MPI

    import dist_ckpt as dc
    from dist_ckpt.collectives.distributed import barrier, broadcast_json, get_rank, get_world_size
    from dist_ckpt.engine.checks.verdict_cache import VERDICTS
    from dist_ckpt.engine.steps import Step
    from dist_ckpt.testing import free_port, init_process_group

    comm = MPI.COMM_WORLD
    port = comm.bcast(free_port() if comm.rank == 0 else None, root=0)
    torch.set_num_threads(1)
    init_process_group(comm.rank, comm.size, port, timeout_s=600)
    rank, world = get_rank(), get_world_size()
    root = Path(broadcast_json(tempfile.mkdtemp(prefix="bench_scale_", dir=directory) if rank == 0 else None))
    times: Dict[str, List[float]] = {"no validation": [], "first validation": [], "repeated validation": []}
    phase: Dict[str, List[float]] = {"first validation": [], "repeated validation": []}
    sd = {f"s{i}": sh for i, sh in enumerate(rank_shards(rank, world, tensors, hidden=16, data=True))}
    for r in range(rounds):
        for name, validate, clear in [
            ("no validation", False, False),
            ("first validation", True, True),
            ("repeated validation", True, False),
        ]:
            if clear:
                VERDICTS.clear()  # every rank: the next check runs in full
            target = root / f"r{r}_{name.replace(' ', '_')}"
            gc.collect()  # a full collection's pause, due from earlier saves' garbage, is charged to no save
            barrier()
            t0 = time.perf_counter()
            result = dc.save_with_report(sd, target, validate_access_integrity=validate)
            barrier()
            times[name].append(time.perf_counter() - t0)
            if validate:
                phase[name].append(result.report.phase_seconds(Step.VALIDATE_SHARDING))
            if rank == 0:
                shutil.rmtree(target)
    if rank == 0:
        print(f"real ranks: {world} ranks x {tensors} tensors ({world * tensors} shards), {rounds} rounds; "
              f"load average {os.getloadavg()}")  # fmt: skip
        base = statistics.median(times["no validation"])
        for name, values in times.items():
            extra = "" if name == "no validation" else (
                f"  adds {statistics.median(values) - base:+.3f} s; "
                f"'validating the sharding' phase {statistics.median(phase[name]):.3f} s"
            )  # fmt: skip
            print(f"  save, {name:<20} median {statistics.median(values):.3f} s "
                  f"(min {min(values):.3f}, max {max(values):.3f}){extra}")  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)
    barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--tensors", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--flat-fraction", type=float, default=0.1, help="share of tensors saved as flat ranges")
    parser.add_argument("--dir", default=None, help="where the simulated index (and real checkpoints) are written")
    parser.add_argument("--real", action="store_true", help="real ranks: run under mpiexec")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)  # every rank: exist_ok makes the race harmless
    if args.real:
        real(args.tensors[0], args.rounds, args.dir)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_scale_", dir=args.dir) as tmp:
        for tensors in args.tensors:
            for world in args.worlds:
                rows.append(simulate(world, tensors, args.flat_fraction, [0, world // 2 + 1, world - 1], Path(tmp)))
                print(f"  done W={world} T={tensors}", flush=True)
    report(rows)


if __name__ == "__main__":
    main()
