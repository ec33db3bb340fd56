"""Crash safety: a save killed with SIGKILL at any point leaves the previous checkpoint loadable
and the partial one refused.

Each case starts a 2-rank save (``tests/crash_saver.py``: real gloo ranks in their own process
group, storage slowed down on purpose), polls the checkpoint directory's files and bytes, and
SIGKILLs the whole process group -- ranks and background writers -- once the directory reaches
the case's point: by phase (directory created, common.pt, objects, each index and commit
temporary file, index without metadata.json, snapshot taken) and by bytes written (fractions of
the data, synchronous and during the asynchronous writer's work). After each kill:

* the previous checkpoint (saved by the same 2-rank program, to completion) loads bit-exactly
  and verifies clean;
* the partial one is refused by ``load`` (NotACheckpointError: no metadata.json) and
  ``verify_checkpoint`` names metadata.json;
* no process of the killed save survives (the background writer included);
* a new save into the partial directory succeeds (it clears the interrupted save's files).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.errors import NotACheckpointError
from dist_ckpt.testing import free_port
from dist_ckpt.training.checkpoints import find_latest_checkpoint
from tests.crash_saver import full_tensors, state
from tests.deadlines import scaled
from tests.paths import REPO_ROOT

pytestmark = pytest.mark.slow

REPO = REPO_ROOT
WORLD = 2


@dataclass(frozen=True)
class Snapshot:
    """What the poller saw: relative path -> size."""

    files: Dict[str, int]

    def has(self, name: str) -> bool:
        return name in self.files

    def has_temp(self, prefix: str) -> bool:
        return any(Path(n).name.startswith(prefix) and ".tmp-" in n for n in self.files)

    def data_bytes(self, suffix: str) -> int:
        return sum(size for name, size in self.files.items() if name.endswith(suffix) and ".tmp-" not in name)

    def count(self, prefix: str) -> int:
        return sum(1 for n in self.files if n.startswith(prefix))


def _scan(path: Path) -> Optional[Snapshot]:
    if not path.exists():
        return None
    files: Dict[str, int] = {}
    for dirpath, _, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            try:
                files[os.path.relpath(full, path)] = os.stat(full).st_size
            except FileNotFoundError:  # renamed or removed while scanning
                continue
    return Snapshot(files)


def _start(ckpt: Path, mode: str, side: Path) -> List[subprocess.Popen]:
    side.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1"
    )
    procs: List[subprocess.Popen] = []
    for rank in range(WORLD):
        group = _join_group(0 if rank == 0 else procs[0].pid)  # one process group: rank 0 leads it
        cmd = [sys.executable, "-m", "tests.crash_saver", str(rank), str(WORLD), str(port), str(ckpt), mode, str(side)]
        procs.append(
            subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **group)
        )
    return procs


def _join_group(pgid: int) -> Dict[str, Any]:
    """Popen arguments that put the child in process group ``pgid`` (0: a new one it leads)."""
    if sys.version_info >= (3, 11):
        return {"process_group": pgid}
    return {"preexec_fn": functools.partial(os.setpgid, 0, pgid)}


def _run_to_completion(ckpt: Path, mode: str, side: Path) -> None:
    procs = _start(ckpt, mode, side)
    for p in procs:
        _, err = p.communicate(timeout=scaled(120))
        assert p.returncode == 0, err.decode()[-3000:]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


Point = Callable[[Snapshot, Path], bool]


@pytest.fixture(scope="module")
def sizes(tmp_path_factory) -> Dict[str, int]:
    """The previous checkpoint (a complete 2-rank save of the same state), and its data sizes."""
    root = tmp_path_factory.mktemp("previous")
    _run_to_completion(root / "sync", "sync", root / "side")
    snap = _scan(root / "sync")
    assert snap is not None
    return {"root": str(root), "safetensors": snap.data_bytes(".safetensors")}  # type: ignore[dict-item]


def _previous(sizes) -> Path:
    return Path(sizes["root"]) / "sync"


def _frac(f: float) -> Callable[[Dict[str, int]], Point]:
    return lambda sizes: lambda s, side: s.data_bytes(".safetensors") >= f * sizes["safetensors"]


def _async_frac(f: float) -> Callable[[Dict[str, int]], Point]:
    return lambda sizes: (
        lambda s, side: (side / "scheduled.0").exists() and s.data_bytes(".safetensors") >= f * sizes["safetensors"]
    )


def _phase(check: Callable[[Snapshot, Path], bool]) -> Callable[[Dict[str, int]], Point]:
    return lambda sizes: check


CASES: List[Tuple[str, str, Callable[[Dict[str, int]], Point]]] = [
    ("sync", "directory created", _phase(lambda s, side: True)),
    ("sync", "common.pt written", _phase(lambda s, side: s.has("common.pt"))),
    ("sync", "ShardedObjects written", _phase(lambda s, side: s.count("objects/o/") >= WORLD)),
    *[("sync", f"{int(f * 100)}% of the data written", _frac(f)) for f in (0.05, 0.2, 0.4, 0.6, 0.8, 0.95)],
    # index version 3 is two files, the shard table (index.<crc>.bin) then index.json: either being written
    ("sync", "index being written (every rank's data durable)", _phase(lambda s, side: s.has_temp(".index."))),
    ("sync", "index.json written, no metadata.json", _phase(lambda s, side: s.has("safetensors/index.json"))),
    ("sync", "metadata.json being committed", _phase(lambda s, side: s.has_temp(".metadata.json"))),
    ("async", "snapshot taken, writer starting", _phase(lambda s, side: (side / "scheduled.1").exists())),
    *[("async", f"background writer at {int(f * 100)}%", _async_frac(f)) for f in (0.1, 0.3, 0.5, 0.7, 0.9)],
    ("async", "finalize: index being written", _phase(lambda s, side: s.has_temp(".index."))),
    (
        "async",
        "finalize: index.json written, no metadata.json",
        _phase(lambda s, side: s.has("safetensors/index.json")),
    ),
    ("async", "finalize: metadata.json being committed", _phase(lambda s, side: s.has_temp(".metadata.json"))),
    ("zarr", "zarr chunks being written", _phase(lambda s, side: s.count(".partial-zarr/w/c.") >= 1)),
    ("zarr", "zarr/checksums.json being written", _phase(lambda s, side: s.has_temp(".checksums.json"))),
]


def test_at_least_twenty_kill_points():
    assert len(CASES) >= 20


@pytest.mark.parametrize("mode, point_name, make_point", CASES, ids=[f"{m}: {n}" for m, n, _ in CASES])
def test_kill_at(mode, point_name, make_point, sizes, tmp_path):
    point = make_point(sizes)
    # the run directory of a training job: the previous checkpoint, then the one being saved
    run, side = tmp_path / "run", tmp_path / "side"
    shutil.copytree(_previous(sizes), run / "iter_0000001")
    ckpt = run / "iter_0000002"
    procs = _start(ckpt, mode, side)
    deadline = time.monotonic() + scaled(60)
    seen: Optional[Snapshot] = None
    try:
        while time.monotonic() < deadline:
            snap = _scan(ckpt)
            if snap is not None and point(snap, side):
                seen = snap
                break
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.002)
    finally:
        os.killpg(procs[0].pid, signal.SIGKILL)
        errors = [p.communicate(timeout=scaled(30))[1].decode() for p in procs]
    assert seen is not None, (
        f"the save never reached '{point_name}' (exit codes {[p.returncode for p in procs]}): {errors}"
    )
    assert all(p.returncode == -signal.SIGKILL for p in procs), f"a rank ended before the kill: {errors}"
    assert not (ckpt / "metadata.json").exists(), "killed before the commit, yet metadata.json exists"
    # no process of the save survives: the background writers were in the process group too
    for marker in side.glob("worker.*"):
        pid = int(marker.read_text() or 0)
        if pid:
            for _ in range(200):
                if not _pid_alive(pid):
                    break
                time.sleep(0.01)
            assert not _pid_alive(pid), f"the background writer {pid} survived the kill"
    # the partial checkpoint is refused, and verify says why
    with pytest.raises(NotACheckpointError, match="metadata.json is missing"):
        dc.load({"w": dc.ShardedTensor.from_rank_offsets("w", torch.empty(256 * WORLD, 2048))}, ckpt)
    report = dc.verify_checkpoint(ckpt)
    assert not report.ok and report.problems[0].path == "metadata.json"
    # the previous checkpoint is intact, and still the latest complete one of the run
    previous = run / "iter_0000001"
    assert find_latest_checkpoint(run) == str(previous)
    full = full_tensors(WORLD)
    loaded = dc.load({k: dc.ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in full.items()}, previous)
    assert all(torch.equal(loaded[k], full[k]) for k in full)
    assert dc.verify_checkpoint(previous).ok
    # a new save into the partial directory clears the interrupted one's files
    one = state(0, 1)
    dc.save(one, ckpt)
    again = dc.load({"w": dc.ShardedTensor.from_rank_offsets("w", torch.empty(256, 2048))}, ckpt)
    assert torch.equal(again["w"], full_tensors(1)["w"]) and dc.verify_checkpoint(ckpt).ok
