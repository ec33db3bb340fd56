"""A rank that dies in the middle of a collective save or load (real processes, gloo).

The dead rank reports nothing (``os._exit``, like a SIGKILL or an OOM kill); every survivor
must raise :class:`~dist_ckpt.errors.RankFailedError` naming the dead rank and the step, within
the roll call's bound (no hang), and nothing may be committed. Jobs of 2 and 4 ranks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Tuple

import pytest

from dist_ckpt.testing import free_port
from tests.deadlines import scaled

from . import tally

ROOT = Path(__file__).resolve().parents[3]

#: (world size, dying rank, where it dies, a word the survivors' step must contain)
CASES: List[Tuple[int, int, str, str]] = [
    (2, 1, "write", "writing safetensors files"),
    (4, 2, "gather", "validating the sharding"),
    (4, 0, "commit", "committing"),
    (4, 3, "load", "loading sharded tensors"),
]


def _run_job(tmp_path: Path, world: int, victim: int, where: str, seconds: float = 240.0) -> List[dict]:
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    args = [str(tmp_path / "ckpt"), str(victim), where, str(out)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.unit.faults.rank_worker", str(r), str(world), str(port), *args],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in range(world)
    ]
    give_up = time.monotonic() + scaled(seconds)
    try:
        for p in procs:
            p.wait(timeout=max(1.0, give_up - time.monotonic()))
    except subprocess.TimeoutExpired as e:
        raise tally.Hang(f"a survivor of rank {victim}'s death at {where!r} is still running") from e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for r in range(world):
        if r == victim:
            continue
        report = out / f"{r}.json"
        if not report.is_file():
            raise AssertionError(f"rank {r} ended without a report (exit code {procs[r].returncode})")
        results.append({"rank": r, **json.loads(report.read_text())})
    return results


@pytest.mark.parametrize("world, victim, where, step", CASES)
def test_a_dead_rank_is_named_on_every_survivor(tmp_path, world, victim, where, step):
    row = "rank killed mid-collective (2 and 4 ranks)"

    def attempt() -> None:
        for result in _run_job(tmp_path, world, victim, where):
            if result["type"] != "RankFailedError":
                raise AssertionError(f"rank {result['rank']} got {result['type']}: {result.get('message')}")
            if result["failed_ranks"] != [victim] or step not in result["step"]:
                raise AssertionError(
                    f"rank {result['rank']}: failed ranks {result['failed_ranks']}, step {result['step']!r}"
                )
            assert f"rank {victim} failed" in result["message"], result["message"]
            assert "destroy_error" not in result, result["destroy_error"]
        if where != "load" and (tmp_path / "ckpt" / "metadata.json").exists():
            raise tally.SilentWrong("a save that lost a rank was committed")

    outcome = tally.attempt(row, f"{world} ranks, rank {victim} dies at {where}", attempt, seconds=300)
    assert outcome == tally.CLEAN, tally.ROWS[row].failures[-1]
