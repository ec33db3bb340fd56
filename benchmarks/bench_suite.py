"""The performance suite of issue 17, in one command: the raw disk, dist_ckpt's backends and its
peers, on one GPT-like state (fp32 parameters + Adam moments, ~3 GB by default) at N ranks.

Systems (``--systems``): ``safetensors``, ``zarr`` (zarr-python engine), ``zarr-ts`` (TensorStore
engine), ``dc-torch_dist`` (dist_ckpt's torch_dist backend, where this checkout has it),
``dcp`` (torch.distributed.checkpoint with DTensors) and ``mcore`` (Megatron-Core's
``dist_checkpointing`` with its default torch_dist backend, run with ``--mcore-python``, the
interpreter of a virtualenv holding megatron-core). A system that is not installed is skipped
with a note. With ``--tree NAME=DIR`` (the source tree of another version of dist_ckpt, e.g. a
``git worktree`` of an older commit; repeatable), ``safetensors@NAME`` and ``zarr@NAME`` run that
version in the same run, interleaved with the others: a before/after comparison of a change.
``--baseline DIR`` is ``--tree base=DIR``.

Per repeat, for every system in turn (interleaved, so a slow minute of the disk hits them alike):

1. the raw disk (:func:`raw_disk`): N streams (one thread each, like N ranks) write the state's
   bytes with 64 MiB writes and an fsync per file, then read them back from a cold page cache;
2. a 2N-rank job saves the state (TP=2N): the checkpoint the resharded loads read;
3. an N-rank job (TP=N): a memcpy of each rank's bytes into allocated memory; *save* (files
   durable, checkpoint committed; peak RSS over the base); *cold load* of the same layout (peak
   RSS over the base); *warm load* (again, page cache warm); an untimed first async save, then
   ``--async-samples`` timed ones, each paired with a timed sync save and each save right after
   a memcpy into the same memory (``suite_ranks._async``): *blocking* (until the call returns)
   and *total* (until durable and finalized), their medians, and per repeat the median blocking
   over the median of the memcpys beside it; over all repeats, the median of each sample's total
   over its sync save; *resharded cold load* 2N -> N;
4. a 1-rank job: *resharded cold load* 2N -> 1.

Each job first saves and loads a tiny state untimed (imports, first collectives). Times are
between barriers (the slowest rank). The table shows medians over the repeats (and min-max), GB/s
of the whole state (10**9 bytes), ratios to the raw disk of the run and to dist_ckpt's
safetensors backend. Every loaded tensor is compared bit-exactly with what was saved; nothing
about time is asserted (the exit status is 1 only if a value is wrong or a system failed).

Cold caches: ``--drop drop_caches`` writes ``/proc/sys/vm/drop_caches`` after ``os.sync()``
(needs root; evicts the whole machine's page cache), ``--drop fadvise`` fsyncs and
``posix_fadvise(DONTNEED)``s every file of the checkpoint; ``auto`` (the default) takes the
first when it is allowed.

First reads: the test VM's virtual disk serves the first read of bytes written some seconds
earlier at about half the speed of later reads of them (the host's caching). So before each
timed cold load the ranks read the checkpoint's files once, untimed, and the cache is dropped
again (``suite_ranks.prime``): every system's load, and the raw re-read beside it, meets the
disk's steady speed. ``--first-read`` times the first read instead.

Free page reporting: a VM whose balloon device reports free memory to its host (Linux's
``page_reporting``; the 2-core test VM does) gives the host back every page that stays free for a
moment, and the guest pays a host fault to use it again. A read or a write that puts 1.5 GB into
the page cache from memory free for ten seconds then takes 2.2 s instead of 0.8 s, so every figure
depends on which memory the system before it left free. ``--free-page-reporting off`` (root) holds
reporting off for the run -- every page stays the guest's, as on bare metal -- and restores it at
the end; ``keep`` (the default) leaves the machine as it is. The header says which.

Usage::

    python benchmarks/bench_suite.py                                   # 3.15 GB, 2 ranks, 3 repeats
    python benchmarks/bench_suite.py --size-gb 0.3 --repeats 1 --systems safetensors,dcp
    git worktree add /tmp/before <commit>
    python benchmarks/bench_suite.py --tree before=/tmp/before --systems safetensors,safetensors@before
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import suite_state as S  # noqa: E402
from raw_io import BLOCK, read_whole  # noqa: E402

HERE = Path(__file__).resolve().parent
ALL_SYSTEMS = "safetensors,zarr,zarr-ts,dc-torch_dist,dcp,mcore"
GB = 1e9


# --------------------------------------------------------------------------- the raw disk


def _drop_method(wanted: str) -> str:
    if wanted != "auto":
        return wanted
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return "drop_caches"
    except OSError:
        return "fadvise"


def _evict(paths: Sequence[Path], how: str) -> None:
    if how == "drop_caches":
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_REPORTING_ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")


def _page_orders() -> int:
    """How many orders of free blocks the kernel keeps (columns of /proc/buddyinfo)."""
    with open("/proc/buddyinfo") as f:
        return len(f.readline().split()) - 4  # "Node 0, zone DMA" then one count per order


@contextmanager
def free_page_reporting(mode: str) -> Iterator[str]:
    """Hold the guest's free page reporting off for the run (``mode == "off"``), or leave it;
    yields a description for the header."""
    try:
        order = int(_REPORTING_ORDER.read_text())
    except (OSError, ValueError):
        yield "no free page reporting"
        return
    if mode == "keep" or order >= _page_orders():
        yield f"free page reporting {'on' if order < _page_orders() else 'off'} (order {order})"
        return
    try:  # no free block is that large: nothing is reported (kernels that cap the value refuse it)
        _REPORTING_ORDER.write_text(str(_page_orders()))
    except OSError as e:
        raise SystemExit(f"--free-page-reporting off: cannot write {_REPORTING_ORDER} ({e}); needs root") from None
    try:
        now = int(_REPORTING_ORDER.read_text())
        held = "held off" if now >= _page_orders() else f"NOT held off (order {now})"
        yield f"free page reporting {held} (order {order} restored at the end)"
    finally:
        _REPORTING_ORDER.write_text(str(order))


def _threads(fn: Callable[[Path], None], paths: Sequence[Path]) -> float:
    threads = [threading.Thread(target=fn, args=(p,)) for p in paths]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def raw_disk(directory: Path, nbytes: int, streams: int, how: str) -> Tuple[float, float]:
    """Seconds for ``streams`` threads to write ``nbytes`` in all (64 MiB writes, fsync per file),
    and to read them back from a cold page cache."""
    paths = [directory / f"raw_{os.getpid()}_{i}.bin" for i in range(streams)]
    part = nbytes // streams
    data = memoryview(os.urandom(BLOCK))

    def write(path: Path) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            left = part
            while left > 0:
                left -= os.write(fd, data[: min(BLOCK, left)])
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(path: Path) -> None:
        read_whole(path, bytearray(BLOCK))

    try:
        write_s = _threads(write, paths)
        _evict(paths, how)
        read_s = _threads(read, paths)
    finally:
        for p in paths:
            p.unlink(missing_ok=True)
    return write_s, read_s


# --------------------------------------------------------------------------- the systems' jobs


def _available(system: str, mcore_python: str) -> Optional[str]:
    """Why ``system`` cannot run here, or None."""
    if system == "mcore":
        if not Path(mcore_python).exists():
            return f"no {mcore_python}"
        probe = subprocess.run([mcore_python, "-c", "import megatron.core.dist_checkpointing"], capture_output=True)
        if probe.returncode != 0:
            return "megatron-core does not import"
        # its save processes need psutil, which megatron-core does not install; without it they die and the save hangs
        probe = subprocess.run([mcore_python, "-c", "import psutil"], capture_output=True)
        return (
            None
            if probe.returncode == 0
            else f"megatron-core's async writer needs psutil: {mcore_python} -m pip install psutil"
        )
    if system == "dc-torch_dist":
        try:
            from dist_ckpt.backends.registry import StrategyAction, get_default_strategy

            get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1)
        except Exception as e:  # noqa: BLE001 -- any failure means: not in this checkout
            return f"dist_ckpt has no torch_dist backend here ({type(e).__name__})"
    return None


def _job(args: Dict[str, Any], python: str) -> List[Dict[str, Any]]:
    env = dict(os.environ)
    tree = args.get("tree") or str(HERE.parent)  # the dist_ckpt source tree the ranks import
    env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [python, str(HERE / "suite_ranks.py"), json.dumps(args)], capture_output=True, text=True, env=env
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return list(json.loads(line[len("RESULT ") :]))
    raise RuntimeError(f"{args['system']} {args['job']} failed:\n{proc.stderr[-4000:]}")


def run_system(
    system: str,
    model: S.Model,
    ranks: int,
    directory: Path,
    how: str,
    python: str,
    tree: Optional[Path] = None,
    prime: bool = True,
    async_samples: int = 3,
) -> Dict[str, Any]:
    """One repeat of one system: the 2N-rank save, the N-rank job, the 1-rank load (``tree``: the
    dist_ckpt source tree to import instead of this one; ``prime``: read each checkpoint once
    before its timed cold load, see ``suite_ranks.prime``; ``async_samples``: timed async saves,
    see ``suite_ranks._async``)."""
    work = Path(tempfile.mkdtemp(prefix=f"suite_{system.replace('@', '_')}_", dir=directory))
    common = {
        "system": system,
        "model": asdict(model),
        "drop": how,
        "prime": prime,
        "tree": str(tree) if tree else None,
    }
    try:
        src = str(work / "src")
        saved = _job({**common, "job": "save", "world": 2 * ranks, "dir": src}, python)
        main = _job(
            {
                **common,
                "job": "main",
                "world": ranks,
                "dir": str(work / "ckpt"),
                "src": src,
                "async": True,
                "async_samples": async_samples,
            },
            python,
        )
        one = _job(
            {**common, "job": "load", "world": 1, "dir": str(work / "one"), "src": src, "op": "reshard1"}, python
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out: Dict[str, Any] = {"save_2n": max(r["save"] for r in saved), "reshard1": one[0]["reshard1"]}
    keys = ("memcpy", "save", "load", "raw_read", "warm", "async_memcpy", "async_block", "async_total", "sync_beside")
    for key in keys + ("reshard",):
        if key in main[0]:
            out[key] = max(r[key] for r in main)
    if "async_totals" in main[0]:  # each sample's slowest rank, async total over the sync save beside it
        totals = [max(sample) for sample in zip(*(r["async_totals"] for r in main))]
        syncs = [max(sample) for sample in zip(*(r["sync_saves"] for r in main))]
        out["async_vs_sync_samples"] = [t / s for t, s in zip(totals, syncs)]  # sync first in odd samples
        out["async_vs_sync"] = statistics.median(out["async_vs_sync_samples"])
    for key in ("save_rss", "load_rss"):
        out[key] = max(r[key] for r in main)
    out["async_error"] = main[0].get("async_error")
    out["bad"] = [b for r in saved + main + one for b in r["bad"]]
    return out


# --------------------------------------------------------------------------- the table


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _fmt_range(values: Sequence[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}" if len(values) > 1 else ""


def render(results: Dict[str, List[Dict[str, Any]]], raw: List[Tuple[float, float]], nbytes: int, ranks: int) -> str:
    """The table: medians (GB/s or seconds), the range over repeats, ratios to disk and safetensors."""
    raw_w = _median([nbytes / GB / w for w, _ in raw])
    raw_r = _median([nbytes / GB / r for _, r in raw])
    base = results.get("safetensors")

    def med(system: str, key: str) -> float:
        return _median([r[key] for r in results[system] if r.get(key) is not None])

    rows = [["system", "measure", "median", "range", "vs raw disk", "vs safetensors"]]
    rows.append(
        [
            "raw disk",
            f"write, {ranks} streams, fsync'd, GB/s",
            f"{raw_w:.2f}",
            _fmt_range([nbytes / GB / w for w, _ in raw]),
            "1.00",
            "",
        ]
    )
    rows.append(
        [
            "raw disk",
            f"cold read, {ranks} streams, GB/s",
            f"{raw_r:.2f}",
            _fmt_range([nbytes / GB / r for _, r in raw]),
            "1.00",
            "",
        ]
    )
    measures = [
        ("save", "durable save, GB/s", True, raw_w),
        ("load", "cold load, GB/s", True, raw_r),
        ("warm", "warm load, GB/s", True, None),
        ("reshard", f"resharded cold load {2 * ranks} -> {ranks}, s", False, None),
        ("reshard1", f"resharded cold load {2 * ranks} -> 1, s", False, None),
        ("async_block", "async save: caller blocks, s", False, None),
        ("async_total", "async save: total, s", False, None),
        ("sync_beside", "sync save beside the async saves, s", False, None),
        ("memcpy", "memcpy of the rank's bytes, s", False, None),
        ("async_memcpy", "memcpy beside the async saves, s", False, None),
        ("save_2n", f"save at {2 * ranks} ranks, s", False, None),
    ]
    for system in results:
        for key, label, rate, disk in measures:
            runs = [r[key] for r in results[system] if r.get(key) is not None]
            if not runs:
                continue
            value = [nbytes / GB / t for t in runs] if rate else runs
            m = _median(value)
            vs_disk = f"{m / disk:.2f}" if disk else ""
            vs_base = ""
            if base is not None and system != "safetensors" and key not in ("memcpy", "async_memcpy", "save_2n"):
                b = med("safetensors", key)
                if b == b:
                    vs_base = f"{m / (nbytes / GB / b):.2f}" if rate else f"{b / m:.2f}" if m else ""
            rows.append([system, label, f"{m:.3f}", _fmt_range(value, 3), vs_disk, vs_base])
        paired = [r["raw_read"] / r["load"] for r in results[system] if r.get("raw_read") and r.get("load")]
        if paired:
            rows.append(
                [system, "cold load / raw re-read of its files", f"{_median(paired):.2f}", _fmt_range(paired), "", ""]
            )
        blocks = [
            r["async_block"] / (r.get("async_memcpy") or r["memcpy"])
            for r in results[system]
            if r.get("async_block") and r.get("memcpy")
        ]
        if blocks:
            label = "async blocking / memcpy beside it"
            rows.append([system, label, f"{_median(blocks):.2f}", _fmt_range(blocks), "", ""])
        # pooled over the repeats: one pair's ratio swings by +-20% with the disk's speed from one
        # second to the next, so a median of a repeat's few pairs moves with a single slow second
        paired_ratios = [x for r in results[system] for x in r.get("async_vs_sync_samples", [])]
        if paired_ratios:
            label = f"async total / sync save beside it, {len(paired_ratios)} pairs"
            rows.append([system, label, f"{_median(paired_ratios):.2f}", _fmt_range(paired_ratios), "", ""])
        totals = [r["async_total"] / r["save"] for r in results[system] if r.get("async_total") and r.get("save")]
        if totals:
            label = "async total / the job's save before its loads"
            rows.append([system, label, f"{_median(totals):.2f}", _fmt_range(totals), "", ""])
        for key, label in (
            ("save_rss", "peak RSS over base, save, MiB"),
            ("load_rss", "peak RSS over base, load, MiB"),
        ):
            mib = [r[key] / 2**20 for r in results[system]]
            rows.append([system, label, f"{_median(mib):.0f}", _fmt_range(mib, 0), "", ""])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows
    ]
    lines.append("")
    lines.append(
        "raw disk per measurement, in run order (write / read GB/s): "
        + ", ".join(f"{nbytes / GB / w:.2f}/{nbytes / GB / r:.2f}" for w, r in raw)
    )
    lines.append(
        "'vs safetensors': this system's rate / safetensors' rate, or safetensors' time / this time (> 1: faster)"
    )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=3.15, help="state size in GB (default: %(default)s)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the main jobs (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=16, help="transformer layers (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default: %(default)s)")
    parser.add_argument("--systems", default=ALL_SYSTEMS, help="comma-separated (default: %(default)s)")
    parser.add_argument("--drop", choices=("auto", "drop_caches", "fadvise"), default="auto")
    parser.add_argument(
        "--mcore-python",
        default=None,
        help="interpreter with megatron-core (default: /opt/mcore-venv/bin/python if it exists, else this one: "
        "dist_ckpt's test extra installs megatron-core)",
    )
    parser.add_argument(
        "--free-page-reporting",
        choices=("keep", "off"),
        default="keep",
        help="hold a VM's free page reporting off for the run (root; see above)",
    )
    parser.add_argument(
        "--first-read",
        action="store_true",
        help="time cold loads on the first read of a fresh checkpoint (default: read it once, untimed, before)",
    )
    parser.add_argument(
        "--async-samples",
        type=int,
        default=6,
        help="timed async saves per repeat, each paired with a timed sync save (an even count balances which "
        "comes first); their medians are reported (default: %(default)s)",
    )
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    parser.add_argument("--baseline", type=Path, help="the same as --tree base=DIR")
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="source tree of another dist_ckpt version, for the systems named SYSTEM@NAME (repeatable)",
    )
    args = parser.parse_args(argv)
    if args.async_samples < 1:
        parser.error(f"--async-samples must be at least 1, got {args.async_samples}")
    if args.mcore_python is None:
        venv = Path("/opt/mcore-venv/bin/python")
        args.mcore_python = str(venv) if venv.exists() else sys.executable
    model = S.Model.for_size(int(args.size_gb * GB), args.layers, multiple=2 * args.ranks)
    args.dir.mkdir(parents=True, exist_ok=True)
    how = _drop_method(args.drop)
    trees = {name: Path(d).resolve() for name, _, d in (t.partition("=") for t in args.tree)}
    if args.baseline is not None:
        trees["base"] = args.baseline.resolve()
    systems = []
    for system in [s for s in args.systems.split(",") if s]:
        why = _available(system, args.mcore_python)
        if "@" in system:
            name, _, tree_name = system.partition("@")
            tree = trees.get(tree_name)
            if name not in ("safetensors", "zarr"):
                why = "only safetensors and zarr run from another tree"
            elif tree is None or not (tree / "dist_ckpt").is_dir():
                why = f"no dist_ckpt source tree named {tree_name!r} (--tree {tree_name}=DIR)"
        if why:
            print(f"skipping {system}: {why}")
        else:
            systems.append(system)
    with free_page_reporting(args.free_page_reporting) as reporting:
        return _run(args, systems, trees, model, how, reporting)


def _run(
    args: argparse.Namespace, systems: List[str], trees: Dict[str, Path], model: S.Model, how: str, reporting: str
) -> int:
    nbytes = model.nbytes()
    print(
        f"suite: {nbytes / GB:.2f} GB state ({model}, {len(model.specs())} tensors, fp32), {args.ranks} ranks, "
        f"{args.repeats} repeats, under {args.dir}, cold caches by {how}"
        f"{' (first reads)' if args.first_read else ' (after an untimed read)'}, {reporting}, "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results: Dict[str, List[Dict[str, Any]]] = {s: [] for s in systems}
    raw: List[Tuple[float, float]] = []
    failed = 0
    for i in range(args.repeats):
        for system in systems:
            raw.append(raw_disk(args.dir, nbytes, args.ranks, how))
            python = args.mcore_python if system == "mcore" else sys.executable
            try:
                tree = trees.get(system.partition("@")[2]) if "@" in system else None
                res = run_system(
                    system,
                    model,
                    args.ranks,
                    args.dir,
                    how,
                    python,
                    tree,
                    prime=not args.first_read,
                    async_samples=args.async_samples,
                )
            except RuntimeError as e:
                print(f"{system}: {e}", file=sys.stderr)
                failed += 1
                continue
            results[system].append(res)
            print(
                f"  repeat {i + 1} {system}: "
                + ", ".join(f"{k} {v:.3f}" for k, v in res.items() if isinstance(v, float)),
                flush=True,
            )
    raw.append(raw_disk(args.dir, nbytes, args.ranks, how))
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}\n")
    results = {s: r for s, r in results.items() if r}
    print(render(results, raw, nbytes, args.ranks))
    for system, runs in results.items():
        for r in runs:
            if r.get("async_error"):
                print(f"\n{system}: no async save: {r['async_error'].strip().splitlines()[-1]}")
                break
    if args.json:
        args.json.write_text(json.dumps({"raw": raw, "results": results, "bytes": nbytes}, indent=1))
    bad = [f"{s}: {b}" for s, runs in results.items() for r in runs for b in r["bad"]]
    if bad:
        print(f"\nerror: {len(bad)} loaded tensors differ from what was saved: {bad[:5]}", file=sys.stderr)
    else:
        print("\nevery loaded tensor verified bit-exact")
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
