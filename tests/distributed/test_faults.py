"""Faults in multi-rank saves and loads: the same typed error on every rank, nothing deleted
that the save cannot prove it wrote, nothing partial committed (issue 15).

Faults that kill a rank cannot run inside this MPI session (it would lose that rank): they are
in tests/unit/faults/test_rank_death.py, with their own process groups.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

import dist_ckpt as dc
from dist_ckpt.backends.safetensors.strategy import SafetensorsSaveShardedStrategy
from dist_ckpt.engine.save_claim import IN_PROGRESS_FILENAME, SaveClaim
from dist_ckpt.storage.errors import StorageError
from dist_ckpt.testing.layouts import full_tensor, tp_shards

from .helpers import assert_on_all_ranks, raises_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)


def state() -> Dict[str, Any]:
    sd: Dict[str, Any] = dict(tp_shards("w", full_tensor("w", (8 * world(), 4)), 0, world(), rank(), world()))
    sd["o"] = dc.ShardedObject("o", {"rank": rank()}, (world(),), (rank(),))
    return sd


def files(path: Path) -> Dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_save_running_elsewhere_refuses_on_every_rank(shared_tmp_path: Path) -> None:
    """Another save's record (of a live process: this job's rank 0) is there: every rank raises,
    nothing is written or deleted."""
    target = shared_tmp_path / "ckpt"
    if rank() == 0:
        (target / "safetensors").mkdir(parents=True)
        (target / "safetensors" / "theirs.safetensors").write_bytes(b"another save's file")
        (target / IN_PROGRESS_FILENAME).write_bytes(SaveClaim("e" * 32, ("safetensors",)).to_bytes())
    dist.barrier()
    before = files(target)
    raises_on_all_ranks(dc.SaveConflictError, lambda: dc.save(state(), target), match="is being written by save")
    assert_on_all_ranks(files(target) == before, "the refused save changed the other save's files")


def test_entries_of_unknown_origin_refuse_on_every_rank(shared_tmp_path: Path) -> None:
    target = shared_tmp_path / "ckpt"
    if rank() == 0:
        (target / "objects").mkdir(parents=True)
        (target / "common.pt").write_bytes(b"a user's file")
    dist.barrier()
    raises_on_all_ranks(dc.SaveConflictError, lambda: dc.save(state(), target), match="left alone")
    assert_on_all_ranks((target / "common.pt").read_bytes() == b"a user's file", "a user's file was touched")


def test_a_reserved_key_on_one_rank_refuses_on_every_rank(shared_tmp_path: Path) -> None:
    sd = state()
    if rank() == world() - 1:
        sd["bad"] = dc.ShardedObject("checksums.json", 1, (1,), (0,), replica_id=0)
    raises_on_all_ranks(dc.InvalidKeyError, lambda: dc.save(sd, shared_tmp_path / "ckpt"), match="reserved")
    assert_on_all_ranks(not list((shared_tmp_path / "ckpt").rglob("*")), "the refused save left files")


class _FailsAfterWriting(SafetensorsSaveShardedStrategy):
    """Writes its files, then fails on the last rank (like a full disk at the index)."""

    def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        super().save(sharded_state_dict, checkpoint_dir)
        if rank() == world() - 1:
            raise OSError(28, "No space left on device")


def test_a_failed_save_removes_every_rank_s_files_and_the_location_is_reusable(shared_tmp_path: Path) -> None:
    target = shared_tmp_path / "ckpt"
    # a failed write is a StorageError (an OSError of the family) on every rank
    raises_on_all_ranks(StorageError, lambda: dc.save(state(), target, sharded_strategy=_FailsAfterWriting()))
    assert_on_all_ranks(files(target) == {}, f"the failed save left {sorted(files(target))}")
    dc.save(state(), target)
    loaded, expected = dc.load(state(), target), state()
    same = all(torch.equal(loaded[k], v.data) for k, v in expected.items() if isinstance(v, dc.ShardedTensor))
    assert_on_all_ranks(same and loaded["o"] == {"rank": rank()}, "the retry loads other values")


def test_a_deleted_manifest_is_corruption_on_every_rank(shared_tmp_path: Path) -> None:
    target = shared_tmp_path / "ckpt"
    dc.save(state(), target)
    dist.barrier()
    if rank() == 0:
        records = json.loads((target / "metadata.json").read_text())["integrity_records"]
        assert "objects/checksums.json" in records
        (target / "objects" / "checksums.json").unlink()
    dist.barrier()
    raises_on_all_ranks(dc.CorruptCheckpointError, lambda: dc.load(state(), target), match="objects/checksums.json")


def _out_of_bounds_on_the_last_rank(sd: Dict[str, Any]) -> None:
    """The last rank's shard of ``w`` is moved past the end of the tensor (a layout error only
    that rank can see: its own shard's bounds)."""
    if rank() == world() - 1:
        for sh in sd.values():
            if isinstance(sh, dc.ShardedTensor):
                sh.global_offset = (8 * world() - 4, 0)


def test_a_layout_error_found_on_one_rank_only_raises_on_every_rank(shared_tmp_path: Path) -> None:
    """Save and load: the same InvalidShardedTensorError on every rank, naming the rank and the key,
    never a rank left waiting in a collective (which would end in RankFailedError at the timeout)."""
    target = shared_tmp_path / "ckpt"
    sd = state()
    _out_of_bounds_on_the_last_rank(sd)
    err = raises_on_all_ranks(dc.InvalidShardedTensorError, lambda: dc.save(sd, target), match="exceeds the global")
    assert_on_all_ranks(f"[rank {world() - 1}]" in str(err) and "'w'" in str(err), str(err))
    assert_on_all_ranks(files(target) == {}, f"the refused save left {sorted(files(target))}")
    dc.save(state(), target)
    request = state()
    _out_of_bounds_on_the_last_rank(request)
    err = raises_on_all_ranks(
        dc.InvalidShardedTensorError, lambda: dc.load(request, target), match="exceeds the global"
    )
    assert_on_all_ranks(f"[rank {world() - 1}]" in str(err) and "'w'" in str(err), str(err))
    loaded, expected = dc.load(state(), target), state()  # the ranks are still in step
    same = all(torch.equal(loaded[k], v.data) for k, v in expected.items() if isinstance(v, dc.ShardedTensor))
    assert_on_all_ranks(same, "the load after the refused one differs")
