"""A damaged safetensors file read by one rank only: the same clear error on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

import dist_ckpt as dc
from dist_ckpt.backends.safetensors.index import read_index
from dist_ckpt.testing.layouts import full_tensor, tp_shards

from .helpers import raises_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)


def _state(empty: bool = False):
    return tp_shards("w", full_tensor("w", (16 * world(), 8)), 0, world(), rank(), world(), empty=empty)


def _last_ranks_file(path: Path) -> Path:
    shards = read_index(path).tensors["w"].shards
    last = [s.file for s in shards if s.global_offset[0] == 16 * (world() - 1)]
    return path / "safetensors" / last[0]


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_file_read_by_one_rank_raises_everywhere(damage, shared_tmp_path: Path) -> None:
    dc.save(_state(), shared_tmp_path, sharded_strategy=("safetensors", 1))
    victim = _last_ranks_file(shared_tmp_path)
    if rank() == 0:
        if damage == "truncate":
            victim.write_bytes(victim.read_bytes()[:-5])
        else:
            victim.unlink()
    dist.barrier()
    # in the saved layout only the last rank reads that file; every rank must raise, naming it
    err = raises_on_all_ranks(
        dc.CorruptCheckpointError, lambda: dc.load(_state(empty=True), shared_tmp_path), victim.name
    )
    assert f"[rank {world() - 1}]" in str(err)
