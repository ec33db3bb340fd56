"""Save and load throughput of each sharded backend and of torch.distributed.checkpoint (DCP),
next to the raw disk bandwidth measured in the same run, and the peak memory of loading ranks.

The ``vs DCP`` column compares each backend with DCP's own ``save``/``load`` of the same tensors;
for ``torch_dist``, which writes through DCP, it is the cost of what dist_ckpt adds (planning,
the common state, the commit, and the crc32c of every byte at save and at load).

The state is the demo's GPT-like model (bf16) plus distributed-optimizer Adam moments (fp32)
(:mod:`dist_ckpt.tools.gpt_state`), scaled to ``--size-gb`` GiB and sharded TP=N over N spawned
ranks (gloo). For every system, in turns (so that slow and fast minutes of a noisy disk are
shared fairly), ``--repeats`` times:

1. *save* the state (every file fsynced; for dist_ckpt, ``metadata.json`` committed);
2. drop every checkpoint file from the page cache, then *load* it in the same layout, in place
   into tensors that are already allocated and touched -- as a training job's parameters are;
3. dist_ckpt backends only: *load resharded* as TP=N/2 x DP=2 (again from a cold cache).

Each timing job first saves and loads a tiny state with the same system, untimed, so one-time
costs (module imports, the first collectives) are not counted: a job pays them once.

DCP gets the same tensors: each main-replica shard under a key made of its checkpoint key, offset
and flattened range (replicated shards share a key, so DCP saves them once, as dist_ckpt does),
written with ``FileSystemWriter(thread_count=2)`` and read back with ``dcp.load``.

Then, once per system, a fresh job loads the checkpoint and reports ``ru_maxrss`` of each loading
rank before the request is allocated (every system's modules already imported, as in a training
job) and after the load: the growth, compared with the bytes of
the rank's state, is the memory the load needs beyond the state itself.

The raw disk is measured before and after, two ways: one stream (write + fsync of one file as
large as the state, then a cold sequential read) and four streams (four files written by four
threads with early writeback, read back cold by four threads) -- the way a checkpoint writer that
keeps the disk busy can use it. Ratios divide by the best raw figure of the run; the table shows
all of them. Times are the best of the repeats. No timing is asserted; the script exits 1 if a
loaded value is wrong.

Usage::

    python benchmarks/bench_backends.py --size-gb 1 --ranks 2 --dir /path/on/the/disk --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from raw_io import BLOCK, read_whole  # the script's directory: sys.path[0]

from dist_ckpt.collectives.distributed import barrier, time_collectively
from dist_ckpt.engine.load import load
from dist_ckpt.engine.save import save
from dist_ckpt.model.sharded import ShardedTensor, is_main_replica
from dist_ckpt.testing import spawn_ranks
from dist_ckpt.tools.bench import measure_disk
from dist_ckpt.tools.gpt_state import (
    DemoConfig,
    Layout,
    build_sharded_state_dict,
    evict_page_cache,
    expected_values,
    sharded_tensors,
    state_bytes,
)

DCP = "dcp"


def measure_disk_parallel(directory: Path, nbytes: int, streams: int = 4) -> Tuple[float, float]:
    """Like ``measure_disk``, with ``streams`` files written and read by as many threads, the
    writes starting writeback early (the technique the safetensors backend uses): what the
    storage gives to a writer that keeps it busy."""
    import threading

    from dist_ckpt.storage.files import SequentialWriter

    paths = [directory / f"bench_raw_{os.getpid()}_{i}.bin" for i in range(streams)]
    part = nbytes // streams
    data = memoryview(os.urandom(BLOCK))

    def write(path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            writer = SequentialWriter(fd, early_writeback=True)
            remaining = part
            while remaining > 0:
                writer.write(data[: min(BLOCK, remaining)])
                remaining -= min(BLOCK, remaining)
            writer.finish()
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def read(path: Path) -> None:
        read_whole(path, bytearray(BLOCK))

    def timed_threads(fn: Callable[[Path], None]) -> float:
        threads = [threading.Thread(target=fn, args=(p,)) for p in paths]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - start

    try:
        write_s = timed_threads(write)
        read_s = timed_threads(read)
    finally:
        for p in paths:
            p.unlink(missing_ok=True)
    return write_s, read_s


@dataclass(frozen=True)
class Job:
    cfg: DemoConfig
    system: str  # "dcp" or "backend:version"
    directory: str
    reshard: bool


def _backend(system: str) -> Tuple[str, int]:
    name, _, version = system.partition(":")
    return name, int(version or 1)


def _request(cfg: DemoConfig, layout: Layout, rank: int) -> Dict[str, Any]:
    """A load request whose tensors are allocated and touched (like a live model's)."""
    sd = build_sharded_state_dict(cfg, layout, rank, fill=False)
    for sh in sharded_tensors(sd):
        assert sh.data is not None
        sh.data.zero_()
    return sd


def _dcp_view(sd: Dict[str, Any], main_only: bool) -> Dict[str, torch.Tensor]:
    """The tensors of a sharded state dict under keys that say which piece each one is."""
    out: Dict[str, torch.Tensor] = {}
    for sh in sharded_tensors(sd):
        if main_only and not is_main_replica(sh.replica_id):
            continue
        rng = "" if sh.flattened_range is None else f"|{sh.flattened_range.start}:{sh.flattened_range.stop}"
        assert sh.data is not None
        out[f"{sh.key}|{','.join(map(str, sh.global_offset))}{rng}"] = sh.data
    return out


def _check(sd: Dict[str, Any], seed: int) -> int:
    """Number of tensors whose loaded value differs from what was saved."""
    bad = 0
    for sh in sharded_tensors(sd):
        assert sh.data is not None
        if not torch.equal(sh.data.view(torch.uint8), expected_values(sh, seed).view(torch.uint8)):
            bad += 1
    return bad


def _save(system: str, sd: Dict[str, Any], directory: str) -> None:
    if system == DCP:
        import torch.distributed.checkpoint as dcp

        dcp.save(_dcp_view(sd, main_only=True), storage_writer=dcp.FileSystemWriter(directory, thread_count=2))
    else:
        save(sd, directory, sharded_strategy=_backend(system))


def _load(system: str, sd: Dict[str, Any], directory: str) -> None:
    if system == DCP:
        import torch.distributed.checkpoint as dcp

        dcp.load(_dcp_view(sd, main_only=False), storage_reader=dcp.FileSystemReader(directory))
    else:
        load(sd, directory)


def _evict(rank: int, directory: str) -> None:
    barrier()
    if rank == 0:
        evict_page_cache(directory)
    barrier()


def _warm_up(system: str, rank: int, directory: str) -> None:
    """Save and load a tiny state once, so that one-time costs (imports, first collectives)
    are not timed: a training job pays them once, not at every checkpoint."""
    tiny = {"warm": ShardedTensor.from_rank_offsets("warm", torch.ones(4), replica_id=rank)}
    _save(system, tiny, directory)
    _load(system, tiny, directory)


def timing_job(rank: int, world: int, job: Job) -> Dict[str, float]:
    """One rank: warm up, save, cold same-layout load, optionally cold resharded load; verify."""
    torch.set_num_threads(1)
    _warm_up(job.system, rank, job.directory + "_warmup")
    layout = Layout(world, 1)
    sd = build_sharded_state_dict(job.cfg, layout, rank, fill=True)
    out = {"save": time_collectively(functools.partial(_save, job.system, sd, job.directory))}
    del sd  # free the saved state before the loads allocate theirs
    request = _request(job.cfg, layout, rank)
    _evict(rank, job.directory)
    out["load"] = time_collectively(lambda: _load(job.system, request, job.directory))
    out["bad"] = _check(request, job.cfg.seed)
    del request
    if job.reshard:
        request = _request(job.cfg, Layout(world // 2, 2), rank)
        _evict(rank, job.directory)
        out["reshard"] = time_collectively(lambda: _load(job.system, request, job.directory))
        out["bad"] += _check(request, job.cfg.seed)
    return out


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux >= 4.0), so that the next
    :func:`_peak_rss` covers only what happens from now on."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    """Peak resident set size of this process in bytes (VmHWM, what ``ru_maxrss`` reports)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_job(rank: int, world: int, job: Job) -> Tuple[int, int, int]:
    """One rank of a fresh job: ``(RSS before, peak RSS by the end of the load, bytes of the rank's
    state)``; the peak mark is reset first, so it covers the request and the load only."""
    torch.set_num_threads(1)
    # every system's modules are imported before the baseline (a training job has them loaded):
    # torch.distributed.checkpoint alone is ~46 MiB of RSS, which the torch_dist backend imports lazily
    import torch.distributed.checkpoint as dcp  # noqa: F401

    if job.system != DCP:
        from dist_ckpt.backends.registry import StrategyAction, get_default_strategy

        get_default_strategy(StrategyAction.LOAD_SHARDED, *_backend(job.system))
    _reset_peak_rss()
    before = _rss()
    request = _request(job.cfg, Layout(world, 1), rank)
    nbytes = sum(sh.data.numel() * sh.data.element_size() for sh in sharded_tensors(request) if sh.data is not None)
    _evict(rank, job.directory)
    _load(job.system, request, job.directory)
    return before, _peak_rss(), nbytes


@dataclass
class Results:
    times: Dict[str, Dict[str, List[float]]] = field(default_factory=dict)
    memory: Dict[str, List[Tuple[int, int, int]]] = field(default_factory=dict)
    bad: int = 0

    def add(self, system: str, report: Sequence[Dict[str, float]]) -> None:
        per_op = self.times.setdefault(system, {})
        for op in ("save", "load", "reshard"):
            if op in report[0]:
                per_op.setdefault(op, []).append(max(r[op] for r in report))
        self.bad += int(sum(r["bad"] for r in report))


def _gib_s(nbytes: int, seconds: float) -> float:
    return nbytes / 2**30 / seconds


def render(
    res: Results, nbytes: int, disk: Sequence[Tuple[float, float]], fast: Sequence[Tuple[float, float]], ranks: int
) -> str:
    plain_w, plain_r = min(d[0] for d in disk), min(d[1] for d in disk)
    fast_w, fast_r = min(d[0] for d in fast), min(d[1] for d in fast)
    write_s, read_s = min(plain_w, fast_w), min(plain_r, fast_r)  # the disk limit: the best seen
    disk_w, disk_r = _gib_s(nbytes, write_s), _gib_s(nbytes, read_s)
    dcp = res.times.get(DCP, {})
    rows = [["operation", "best s", "GiB/s", "vs disk", "vs DCP", "all runs (s)"]]
    for label, seconds, limit in (
        ("disk write, 1 stream + fsync", plain_w, write_s),
        ("disk write, 4 streams, early writeback", fast_w, write_s),
        ("disk read, 1 stream, cold", plain_r, read_s),
        ("disk read, 4 streams, cold", fast_r, read_s),
    ):
        rows.append([label, f"{seconds:.3f}", f"{_gib_s(nbytes, seconds):.3f}", f"{limit / seconds:.2f}", "", ""])
    labels = {
        "save": f"save TP={ranks}",
        "load": f"load TP={ranks}, cold",
        "reshard": f"load TP={ranks // 2} DP=2, cold",
    }
    for system, ops in res.times.items():
        for op, runs in ops.items():
            best = min(runs)
            disk_gib = disk_w if op == "save" else disk_r
            vs_dcp = f"{min(dcp[op]) / best:.2f}x" if op in dcp and system != DCP else ""
            rate = _gib_s(nbytes, best)
            rows.append(
                [
                    f"{system}: {labels[op]}",
                    f"{best:.3f}",
                    f"{rate:.3f}",
                    f"{rate / disk_gib:.2f}",
                    vs_dcp,
                    " ".join(f"{r:.2f}" for r in runs),
                ]
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = "\n".join(
        "  ".join(c.ljust(w) if i in (0, 5) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    )
    lines = [table, "", "peak RSS of each loading rank (fresh job, same layout): growth during the load vs its state"]
    for system, per_rank in res.memory.items():
        parts = [
            f"rank {r}: +{(peak - before) / 2**20:.0f} MiB for {state / 2**20:.0f} MiB ({(peak - before) / state:.2f}x)"
            for r, (before, peak, state) in enumerate(per_rank)
        ]
        lines.append(f"  {system}: " + "; ".join(parts))
    lines.append("")
    for name, runs in (("1 stream", disk), ("4 streams", fast)):
        lines.append(
            f"raw disk ({name}), before / after: write "
            + " / ".join(f"{_gib_s(nbytes, d[0]):.3f}" for d in runs)
            + " GiB/s, read "
            + " / ".join(f"{_gib_s(nbytes, d[1]):.3f}" for d in runs)
            + " GiB/s"
        )
    lines.append("'vs disk' divides by the best raw figure of the run (write or read), whichever way it was measured")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="state size in GiB (default: %(default)s)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks; even (default: %(default)s)")
    parser.add_argument(
        "--backends",
        default="safetensors:1,zarr:1,torch_dist:1",
        help="comma-separated NAME:VERSION list (default: %(default)s)",
    )
    parser.add_argument("--no-dcp", action="store_true", help="skip torch.distributed.checkpoint")
    parser.add_argument("--repeats", type=int, default=3, help="runs per system (default: %(default)s)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="directory on the storage to measure (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    systems = [s for s in args.backends.split(",") if s] + ([] if args.no_dcp else [DCP])
    cfg = DemoConfig.for_size(int(args.size_gb * 2**30), args.ranks)
    nbytes = state_bytes(cfg)
    args.dir.mkdir(parents=True, exist_ok=True)
    disk = [measure_disk(args.dir, nbytes)]
    fast = [measure_disk_parallel(args.dir, nbytes)]
    res = Results()
    for _ in range(args.repeats):
        for system in systems:
            ckpt = Path(tempfile.mkdtemp(prefix="bench_backends_", dir=args.dir))
            try:
                job = Job(cfg, system, str(ckpt / "ckpt"), reshard=system != DCP)
                res.add(system, spawn_ranks(timing_job, args.ranks, job))
                if system not in res.memory:
                    res.memory[system] = spawn_ranks(memory_job, args.ranks, Job(cfg, system, job.directory, False))
            finally:
                shutil.rmtree(ckpt, ignore_errors=True)
    disk.append(measure_disk(args.dir, nbytes))
    fast.append(measure_disk_parallel(args.dir, nbytes))
    print(
        f"backends benchmark: {nbytes / 2**30:.2f} GiB state (hidden {cfg.hidden}, {cfg.layers} layers, vocab "
        f"{cfg.vocab}), {args.ranks} ranks, {args.repeats} runs each, under {args.dir}\n"
    )
    print(render(res, nbytes, disk, fast, args.ranks))
    if res.bad:
        print(f"\nerror: {res.bad} loaded tensors differ from what was saved", file=sys.stderr)
        return 1
    print("\nevery loaded tensor verified bit-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
