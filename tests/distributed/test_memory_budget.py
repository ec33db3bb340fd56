"""Multi-rank: a host-memory budget far below the state bounds the peak RSS of each path.

Each rank holds 64 MiB in two strided tensors (transposed views: a non-host layout, so they take
the same staging code as GPU tensors) and saves (safetensors and zarr), async-saves and loads them with an 8 MiB budget.
The peak is VmHWM after resetting it (``/proc/self/clear_refs``), over VmRSS at the start; the
allowance over the budget, ``SLACK_BYTES``, covers the Python and allocator noise of a save (a few
MiB measured) and the 1 MiB floor of each thread's piece. Without the budget each path holds 32 to
64 MiB more, over the bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict

import pytest
import torch

import dist_ckpt as dc
from tests.distributed.helpers import assert_on_all_ranks, rank, world

BUDGET_BYTES = 8 << 20
SLACK_BYTES = 24 << 20
CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def _peak_over_base(fn: Callable[[], object]) -> int:
    """Bytes of RSS high-water above the RSS before ``fn``."""
    CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS
    base = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - base) * 1024


def _state(seed: int) -> Dict[str, dc.ShardedTensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"w{i}": dc.ShardedTensor.from_rank_offsets(
            f"w{i}", torch.randn(2048, 4096, generator=gen).t(), (1, rank(), world())
        )
        for i in range(2)
    }


@pytest.mark.mpi(min_size=2)
def test_budget_bounds_peak_rss_of_each_path(shared_tmp_path: Path) -> None:
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        pytest.skip("cannot reset VmHWM here")
    sd = _state(rank())
    expected = {k: v.data.clone() for k, v in sd.items()}
    peaks = {}
    peaks["save"] = _peak_over_base(
        lambda: dc.save(sd, shared_tmp_path / "sync", host_memory_budget_bytes=BUDGET_BYTES)
    )

    peaks["zarr save"] = _peak_over_base(
        lambda: dc.save(
            sd, shared_tmp_path / "zarr", sharded_strategy=("zarr", 1), host_memory_budget_bytes=BUDGET_BYTES
        )
    )

    def async_save() -> None:
        request = dc.save(sd, shared_tmp_path / "async", async_sharded_save=True, host_memory_budget_bytes=BUDGET_BYTES)
        assert request is not None
        request.execute_sync()

    peaks["async save"] = _peak_over_base(async_save)
    target = {k: dc.ShardedTensor.from_rank_offsets(k, torch.zeros(2048, 4096).t(), (1, rank(), world())) for k in sd}
    peaks["load"] = _peak_over_base(
        lambda: dc.load(target, shared_tmp_path / "async", host_memory_budget_bytes=BUDGET_BYTES)
    )
    # the destinations are touched (zeros) before: their pages are the state, not staging
    over = {path: peak for path, peak in peaks.items() if peak > BUDGET_BYTES + SLACK_BYTES}
    assert_on_all_ranks(not over, f"peak RSS over the budget: {over}")
    same = all(torch.equal(target[k].data, v) for k, v in expected.items())
    assert_on_all_ranks(same, "loaded values differ")
