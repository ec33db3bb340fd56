"""Saves that run out of disk space (a 2 MiB tmpfs): typed error, nothing partial left.

Skipped, with the reason, where the test cannot mount a tmpfs (it needs root and a kernel that
allows it). Each save writes about 4 MiB into 2 MiB; the previous checkpoint on the same file
system must stay intact, no data file may be left under its final name, the location must be
left empty (the failed save deletes what it wrote), and a smaller save into it must succeed.
"""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.async_save.queue import AsyncCallsQueue
from dist_ckpt.model.sharded import ShardedTensor

from . import tally
from .scenario import DataLost, SilentWrong, fingerprint, strategy


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True, text=True
        )
    except OSError as e:
        pytest.skip(f"cannot run mount ({e}): the full-disk test needs a small tmpfs")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs ({done.stderr.strip()}): the test needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _state(mib: float) -> Any:
    n = int(mib * 2**20 / 4)
    return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(n, dtype=torch.float32)), "step": 1}


def _out_of_space(error: BaseException) -> bool:
    seen: Any = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC or "No space left" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@pytest.mark.parametrize("backend, mode", [("safetensors", "sync"), ("zarr", "sync"), ("safetensors", "async")])
def test_a_save_that_fills_the_disk(small_disk, backend, mode):
    previous = small_disk / "iter_1"
    dc.save(_state(0.25), previous, sharded_strategy=strategy(backend))
    before = fingerprint(previous)
    target = small_disk / "iter_2"
    row = "full disk (2 MiB tmpfs)"

    def save_big() -> None:
        if mode == "sync":
            dc.save(_state(4), target, sharded_strategy=strategy(backend))
            return
        queue = AsyncCallsQueue(persistent=False)
        try:
            request = dc.save(_state(4), target, sharded_strategy=strategy(backend), async_sharded_save=True)
            assert request is not None
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
        finally:
            queue.close(abort=True)

    def attempt() -> None:
        try:
            save_big()
        except Exception as e:  # noqa: BLE001 -- classified below
            if not (_out_of_space(e) and tally.is_typed(e, OSError)):
                raise
        else:
            raise AssertionError("4 MiB fitted on a 2 MiB disk")
        if fingerprint(previous) != before:
            raise DataLost("the previous checkpoint changed")
        left = sorted(str(p.relative_to(target)) for p in target.rglob("*")) if target.exists() else []
        if left:
            raise SilentWrong(f"the failed save left {left}")
        dc.save(_state(0.25), target, sharded_strategy=strategy(backend))
        out = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(int(0.25 * 2**18)))}, target)
        if not torch.equal(out["w"], _state(0.25)["w"].data):
            raise SilentWrong("the retry loads other values")

    outcome = tally.attempt(row, f"{backend} {mode}", attempt, seconds=300)
    assert outcome == tally.CLEAN, tally.ROWS[row].failures[-1]
