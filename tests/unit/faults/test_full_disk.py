"""Saves that run out of disk space (a 1 MiB tmpfs): a typed error, nothing partial left.

Skipped, with the reason, where the test cannot mount a tmpfs (it needs root and a kernel that
allows it). Each save writes about 2 MiB into 1 MiB, with every backend (both zarr engines),
synchronously and, where the backend can, asynchronously. The error must be a
[`StorageError`][dist_ckpt.storage.errors.StorageError] (an ``OSError`` whose ``errno`` is
``ENOSPC``) whose message names the rank, the file and the bytes it wanted to write; the
previous checkpoint on the same file system must stay intact, no data file may be left under
its final name, the location must be left empty (the failed save deletes what it wrote), and a
smaller save into it must succeed.
"""

from __future__ import annotations

import errno
import re
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.asynchronous.queue import AsyncCallsQueue
from dist_ckpt.errors import AsyncSaveError
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.storage.errors import AsyncStorageError, StorageError
from dist_ckpt.strategies import get_alternative_strategy
from tests.failing_writes import INJECTED, FailingWriteStrategy

from . import tally
from .scenario import DataLost, SilentWrong, fingerprint, strategy


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
        )
    except OSError as e:
        pytest.skip(f"cannot run mount ({e}): the full-disk test needs a small tmpfs")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs ({done.stderr.strip()}): the test needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="module")
def queue() -> Iterator[AsyncCallsQueue]:
    """One writer process for the module's async saves (starting one takes seconds)."""
    q = AsyncCallsQueue(persistent=True)
    yield q
    q.close()


def _state(mib: float) -> Any:
    n = int(mib * 2**20 / 4)
    return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(n, dtype=torch.float32)), "step": 1}


def _save_strategy(backend: str) -> Any:
    if backend == "tensorstore":
        pytest.importorskip("tensorstore")
        return get_alternative_strategy(dc.StrategyAction.SAVE_SHARDED, "zarr", 1, "tensorstore")
    return strategy(backend)


def _check_error(error: BaseException, target: Path) -> None:
    """A StorageError of a full disk, naming the rank, a file of ``target`` and the bytes wanted;
    anything else is raised again (a raw exception)."""
    if not isinstance(error, StorageError) or error.errno != errno.ENOSPC:
        raise error
    text = str(error)
    if "[rank 0]" not in text or str(target) not in text or not re.search(r"\d+ bytes", text):
        raise AssertionError(f"the error does not name the rank, the file and the bytes wanted: {text}")


@pytest.mark.parametrize(
    "backend, mode",
    [
        ("safetensors", "sync"),
        ("safetensors", "async"),
        ("zarr", "sync"),
        ("tensorstore", "sync"),
        ("torch_dist", "sync"),
        ("torch_dist", "async"),
    ],
)
def test_a_save_that_fills_the_disk(small_disk, queue, backend, mode):
    save_strategy = _save_strategy(backend)
    previous = small_disk / "iter_1"
    dc.save(_state(0.125), previous, sharded_strategy=save_strategy)
    before = fingerprint(previous)
    target = small_disk / "iter_2"
    row = "full disk (1 MiB tmpfs)"

    def save_big() -> None:
        if mode == "sync":
            dc.save(_state(2), target, sharded_strategy=save_strategy)
            return
        request = dc.save(_state(2), target, sharded_strategy=save_strategy, async_sharded_save=True)
        assert request is not None
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)

    def attempt() -> None:
        try:
            save_big()
        except Exception as e:  # noqa: BLE001 -- classified below
            _check_error(e, target)
        else:
            raise AssertionError("2 MiB fitted on a 1 MiB disk")
        if fingerprint(previous) != before:
            raise DataLost("the previous checkpoint changed")
        left = sorted(str(p.relative_to(target)) for p in target.rglob("*")) if target.exists() else []
        if left:
            raise SilentWrong(f"the failed save left {left}")
        dc.save(_state(0.125), target, sharded_strategy=save_strategy)
        out = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(int(0.125 * 2**18)))}, target)
        if not torch.equal(out["w"], _state(0.125)["w"].data):
            raise SilentWrong("the retry loads other values")

    outcome = tally.attempt(row, f"{backend} {mode}", attempt, seconds=300)
    assert outcome == tally.CLEAN, tally.ROWS[row].failures[-1]


def test_an_injected_full_disk_in_the_background(tmp_path, queue):
    """The same without a small disk (no root needed): the background write fails with ENOSPC
    (``tests.failing_writes``); finalizing raises an AsyncStorageError, both the AsyncSaveError
    an async save raises and the StorageError a failed write is, naming the rank and the cause."""
    request = dc.save(
        _state(0.125), tmp_path / "ckpt", sharded_strategy=FailingWriteStrategy(), async_sharded_save=True
    )
    assert request is not None
    queue.schedule_async_request(request)
    with pytest.raises(AsyncStorageError, match=r"\[rank 0\] the background save failed: StorageError") as caught:
        queue.maybe_finalize_async_calls(blocking=True)
    assert isinstance(caught.value, AsyncSaveError) and caught.value.errno == errno.ENOSPC
    assert INJECTED in str(caught.value)
    assert not (tmp_path / "ckpt" / "metadata.json").exists()
