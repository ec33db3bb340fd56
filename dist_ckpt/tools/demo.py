"""An end-to-end demonstration: save a sharded GPT-like state, load it back resharded, verify.

The demo is what ``dist-ckpt demo`` runs, and the state builder the benchmarks reuse. It shows the
promise of dist_ckpt on one machine:

1. N CPU ranks (a real gloo process group) each build their part of a GPT-like model sharded
   with tensor parallelism TP=N, plus a distributed-optimizer Adam state (flattened ranges),
   common objects and a per-rank ShardedObject, and save it.
2. The same N ranks load it in another layout, TP=N/2 x DP=2, where the data-parallel pairs split
   the flattened optimizer state differently, and verify every value bit-exactly.
3. The parent process, with no process group at all, loads every tensor whole (TP=1, nothing
   flattened) and verifies it again.

Every value is a pure function of (seed, key, global element index), so any rank can compute the
expected content of any slice without communication. Nothing here prints: `run_demo()`
returns a `DemoResult` and the CLI renders it.

Example:

```python
from dist_ckpt.tools.demo import DemoOptions, run_demo
result = run_demo(DemoOptions(size_mib=16, ranks=2))
assert result.ok, result.mismatches
```
"""

from __future__ import annotations

import functools
import logging
import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from dist_ckpt.backends.registry import DEFAULT_SHARDED_BACKEND, StrategyAction, get_default_strategy
from dist_ckpt.collectives.distributed import time_collectively
from dist_ckpt.engine.load import load_with_report
from dist_ckpt.engine.save import save
from dist_ckpt.model.sharded import is_main_replica
from dist_ckpt.tools.gpt_state import (
    MAX_REPORTED,
    OPTIMIZER_STATES,
    DemoConfig,
    Layout,
    build_sharded_state_dict,
    checkpoint_files,
    evict_page_cache,
    full_load_request,
    param_specs,
    sharded_tensors,
    state_bytes,
    verify_loaded,
)
from dist_ckpt.tools.launch import spawn_ranks

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class DemoOptions:
    """What `run_demo()` does.

    Attributes:
        size_mib: target size of the whole state in MiB (model in bf16 + Adam moments in fp32).
        ranks: number of ranks that save (even, >= 2: the reload uses TP=ranks/2 x DP=2).
        backend: sharded backend ``(name, version)``.
        directory: parent of the checkpoint directory (None: the system temp directory).
        keep: keep the checkpoint instead of deleting it at the end.
        layers: number of transformer layers.
        seed: seed of every value.
        single_process_load: also load everything whole in this process (no process group).
        evict_page_cache: drop the checkpoint from the page cache before each timed load, so
            that loads are measured from disk (benchmarks).
        engine: the library that writes and reads the ``zarr`` backend, ``"zarr-python"`` or
            ``"tensorstore"`` (same layout; other backends ignore it).
    """

    size_mib: float = 64.0
    ranks: int = 4
    backend: Tuple[str, int] = DEFAULT_SHARDED_BACKEND
    directory: Optional[Path] = None
    keep: bool = False
    layers: int = 4
    seed: int = 1234
    single_process_load: bool = True
    evict_page_cache: bool = False
    engine: str = "zarr-python"


@dataclass(frozen=True)
class PhaseResult:
    """One timed save or load.

    Attributes:
        name: ``"save"`` or ``"load"``.
        layout: the parallel layout, e.g. ``"TP=2 DP=2"``.
        ranks: number of processes that took part.
        seconds: wall time of the slowest rank, between barriers.
        nbytes: bytes of the state (each tensor once): the basis of `gib_per_s`.
        checked: values compared after a load (None for a save).
        failed: how many of them differ from what was saved.
        mismatches: descriptions of the first few that differ.
    """

    name: str
    layout: str
    ranks: int
    seconds: float
    nbytes: int
    checked: Optional[int] = None
    failed: int = 0
    mismatches: Tuple[str, ...] = ()

    @property
    def gib_per_s(self) -> float:
        return self.nbytes / 2**30 / self.seconds if self.seconds > 0 else math.inf


@dataclass(frozen=True)
class DemoResult:
    """Everything the demo measured and checked."""

    config: DemoConfig
    backend: Tuple[str, int]
    ranks: int
    checkpoint_dir: Path
    kept: bool
    num_tensors: int
    num_shards: int
    state_bytes: int
    num_files: int
    disk_bytes: int
    phases: Tuple[PhaseResult, ...] = ()
    engine: str = "zarr-python"

    @property
    def mismatches(self) -> List[str]:
        return [m for p in self.phases for m in p.mismatches]

    @property
    def ok(self) -> bool:
        """True if every load returned exactly what was saved."""
        return not any(p.failed for p in self.phases)


@dataclass(frozen=True)
class _RankJob:
    cfg: DemoConfig
    checkpoint_dir: str
    backend: Tuple[str, int]
    evict_page_cache: bool
    engine: str


#: the libraries that write and read the zarr backend's one layout (``--engine`` of the commands)
ZARR_ENGINES = ("zarr-python", "tensorstore")


def use_zarr_engine(engine: str, include_save: bool = True) -> None:
    """Make ``engine`` (``"zarr-python"`` or ``"tensorstore"``) this process's ``("zarr", 1)``
    load strategy, and with ``include_save`` its save strategy; zarr-python is the registry's
    default already. Raises ValueError for another name."""
    if engine == "tensorstore":
        from dist_ckpt.backends.zarr.tensorstore_engine import register_default_tensorstore_strategies

        register_default_tensorstore_strategies(include_save=include_save)
    elif engine not in ZARR_ENGINES:
        raise ValueError(f"engine must be one of {ZARR_ENGINES}, got {engine!r}")


@dataclass(frozen=True)
class _RankReport:
    save_seconds: float
    load_seconds: float
    saved_shards: int
    checked: int
    failed: int
    mismatches: Tuple[str, ...]


def _rank_main(rank: int, world: int, job: _RankJob) -> _RankReport:
    """One rank: save in TP=world, reload in TP=world/2 x DP=2, verify (runs in a spawned process)."""
    torch.set_num_threads(1)
    use_zarr_engine(job.engine)
    save_layout, load_layout = Layout(world, 1), Layout(world // 2, 2)
    sd = build_sharded_state_dict(job.cfg, save_layout, rank, fill=True)
    saved_shards = sum(1 for sh in sharded_tensors(sd) if is_main_replica(sh.replica_id))
    save_seconds = time_collectively(functools.partial(save, sd, job.checkpoint_dir, sharded_strategy=job.backend))
    del sd  # free the saved state before the load allocates the next one
    if job.evict_page_cache and rank == 0:
        evict_page_cache(job.checkpoint_dir)
    request = build_sharded_state_dict(job.cfg, load_layout, rank, fill=False)
    holder: Dict[str, Any] = {}
    load_seconds = time_collectively(lambda: holder.update(loaded=load_with_report(request, job.checkpoint_dir)))
    checked, problems = verify_loaded(request, holder["loaded"].state_dict, job.cfg)
    first = tuple(f"[rank {rank}] {p}" for p in problems[:MAX_REPORTED])
    return _RankReport(save_seconds, load_seconds, saved_shards, checked, len(problems), first)


def _check_options(options: DemoOptions) -> None:
    if options.ranks < 2 or options.ranks % 2:
        raise ValueError(f"ranks must be an even number >= 2 (the reload uses TP=ranks/2 x DP=2), got {options.ranks}")
    if options.size_mib <= 0:
        raise ValueError(f"size_mib must be positive, got {options.size_mib}")
    # fail here, with the registry's message, rather than inside every spawned rank
    get_default_strategy(StrategyAction.SAVE_SHARDED, *options.backend)
    get_default_strategy(StrategyAction.LOAD_SHARDED, *options.backend)


def _rank_phases(reports: Sequence[_RankReport], world: int, nbytes: int) -> List[PhaseResult]:
    save_s, load_s = max(r.save_seconds for r in reports), max(r.load_seconds for r in reports)
    checked, failed = sum(r.checked for r in reports), sum(r.failed for r in reports)
    mismatches = tuple(m for r in reports for m in r.mismatches)
    return [
        PhaseResult("save", str(Layout(world, 1)), world, save_s, nbytes),
        PhaseResult("load", str(Layout(world // 2, 2)), world, load_s, nbytes, checked, failed, mismatches),
    ]


def _single_process_load(cfg: DemoConfig, checkpoint_dir: Path, world: int, evict: bool) -> PhaseResult:
    if evict:
        evict_page_cache(checkpoint_dir)
    request = full_load_request(cfg, world)
    start = time.perf_counter()
    loaded = load_with_report(request, checkpoint_dir).state_dict
    seconds = time.perf_counter() - start
    checked, problems = verify_loaded(request, loaded, cfg)
    first = tuple(f"[single process] {p}" for p in problems[:MAX_REPORTED])
    layout = "TP=1, 1 process, no process group"
    return PhaseResult("load", layout, 1, seconds, state_bytes(cfg), checked, len(problems), first)


def run_demo(options: DemoOptions = DemoOptions()) -> DemoResult:
    """Save, reload resharded on the ranks, reload whole in this process; measure and verify.

    Raises:
        ValueError: invalid options.
        CheckpointingException: the backend is unknown or a step failed in this process.
        dist_ckpt.tools.launch.RankError: a spawned rank raised (its traceback is in the message).
    """
    use_zarr_engine(options.engine)  # here too: this process checks the backend and loads last
    _check_options(options)
    cfg = DemoConfig.for_size(int(options.size_mib * 2**20), options.ranks, options.layers, options.seed)
    parent = options.directory if options.directory is not None else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    ckpt = Path(tempfile.mkdtemp(prefix="dist_ckpt_demo_", dir=parent))
    nbytes = state_bytes(cfg)
    logger.info("demo: %s, %d bytes, %d ranks, checkpoint %s", cfg, nbytes, options.ranks, ckpt)
    try:
        job = _RankJob(cfg, str(ckpt), options.backend, options.evict_page_cache, options.engine)
        reports: List[_RankReport] = spawn_ranks(_rank_main, options.ranks, job)
        phases = _rank_phases(reports, options.ranks, nbytes)
        if options.single_process_load:
            phases.append(_single_process_load(cfg, ckpt, options.ranks, options.evict_page_cache))
        num_files, disk_bytes = checkpoint_files(ckpt)
    finally:
        if not options.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
    num_tensors = len(param_specs(cfg)) * (1 + len(OPTIMIZER_STATES))
    num_shards = sum(r.saved_shards for r in reports)
    return DemoResult(
        cfg,
        options.backend,
        options.ranks,
        ckpt,
        options.keep,
        num_tensors,
        num_shards,
        nbytes,
        num_files,
        disk_bytes,
        tuple(phases),
        options.engine,
    )
