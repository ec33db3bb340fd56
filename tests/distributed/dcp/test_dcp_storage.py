"""dist_ckpt.dcp's StorageWriter / StorageReader under DCP's save, async_save and load, at 2 and 4 ranks.

FSDP2 model and optimizer state round trips; DTensors saved in one placement and loaded in
another (DCP's planners reshard), also by DCP's own FileSystemReader; a flipped byte of another
rank's file and a write failing on one rank raise on every rank and leave nothing loadable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dist_ckpt.dcp
from dist_ckpt.errors import ChecksumMismatchError
from dist_ckpt.storage import StorageError
from dist_ckpt.storage.local import LocalStorage
from dist_ckpt.testing.layouts import bitwise_equal
from dist_ckpt.testing.training import (
    exact_loss_scale,
    full_state,
    make_model,
    make_optimizer,
    shard_with_fsdp2,
    state_differences,
    train,
)
from tests.distributed.helpers import assert_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)


def _failures(error: BaseException) -> List[BaseException]:
    """Every rank's exception inside DCP's CheckpointException."""
    assert isinstance(error, dcp.api.CheckpointException), repr(error)
    return [failure[0] for failure in error.failures.values()]


def test_fsdp2_model_and_optimizer_round_trip(shared_tmp_path: Path) -> None:
    model = shard_with_fsdp2(make_model(seed=0))
    optim = make_optimizer("adam", model)
    train(model, optim, range(2), exact_loss_scale(rank(), world()))
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, storage_writer=dist_ckpt.dcp.StorageWriter(shared_tmp_path))
    expected = full_state(model, optim)

    target = shard_with_fsdp2(make_model(seed=1))
    target_optim = make_optimizer("adam", target)
    train(target, target_optim, range(1), exact_loss_scale(rank(), world()))  # optimizer state to load into
    tmsd, tosd = get_state_dict(target, target_optim)
    state = {"model": tmsd, "optim": tosd}
    dcp.load(state, storage_reader=dist_ckpt.dcp.StorageReader(shared_tmp_path))
    set_state_dict(target, target_optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    problems = state_differences(expected, full_state(target, target_optim))
    assert_on_all_ranks(not problems, f"FSDP2 state differs after the round trip: {problems[:8]}")


def _layouts() -> List[Any]:
    """(save placements, save mesh, load placements, load mesh) for this world size."""
    w = world()
    layouts = [([Shard(0)], (w,), [Shard(1)], (w,)), ([Shard(1)], (w,), [Replicate()], (w,))]
    if w == 4:  # 4 shards saved, 2 x 2 loaded
        layouts.append(([Shard(0)], (4,), [Shard(1), Shard(0)], (2, 2)))
    return layouts


@pytest.mark.parametrize("index", range(3))
def test_dtensors_reshard_on_load_by_both_readers(index: int, shared_tmp_path: Path) -> None:
    layouts = _layouts()
    if index >= len(layouts):
        pytest.skip("layout needs 4 ranks")
    save_placements, save_mesh, load_placements, load_mesh = layouts[index]
    full = torch.arange(7 * 12, dtype=torch.float32).reshape(7, 12)  # 7 rows: uneven shards
    src = distribute_tensor(full, init_device_mesh("cpu", save_mesh), save_placements)
    dcp.save({"x": src, "step": 5}, storage_writer=dist_ckpt.dcp.StorageWriter(shared_tmp_path))
    for reader in (dist_ckpt.dcp.StorageReader(shared_tmp_path), dcp.FileSystemReader(str(shared_tmp_path))):
        dst = distribute_tensor(torch.zeros(7, 12), init_device_mesh("cpu", load_mesh), load_placements)
        state = {"x": dst, "step": 0}
        dcp.load(state, storage_reader=reader)
        ok = bitwise_equal(dst.full_tensor(), full) and state["step"] == 5
        assert_on_all_ranks(ok, f"{type(reader).__name__}: resharded DTensor differs: {dst.to_local()}")


def test_async_save_with_the_writer(shared_tmp_path: Path) -> None:
    full = torch.arange(9 * 4, dtype=torch.bfloat16).reshape(9, 4)
    mesh = init_device_mesh("cpu", (world(),))
    state = {"x": distribute_tensor(full, mesh, [Shard(0)])}
    future = dcp.async_save(state, storage_writer=dist_ckpt.dcp.StorageWriter(shared_tmp_path, thread_count=2))
    future.result()
    dist.barrier()
    dst = {"x": distribute_tensor(torch.zeros(9, 4, dtype=torch.bfloat16), mesh, [Replicate()])}
    dcp.load(dst, storage_reader=dist_ckpt.dcp.StorageReader(shared_tmp_path))
    assert_on_all_ranks(bitwise_equal(dst["x"].to_local(), full), f"async save differs: {dst['x'].to_local()}")


def test_a_flipped_byte_in_another_ranks_file_fails_every_rank(shared_tmp_path: Path) -> None:
    mesh = init_device_mesh("cpu", (world(),))
    full = torch.arange(world() * 64 * 64, dtype=torch.float32).reshape(world() * 64, 64)
    dcp.save(
        {"x": distribute_tensor(full, mesh, [Shard(0)])}, storage_writer=dist_ckpt.dcp.StorageWriter(shared_tmp_path)
    )
    if rank() == 0:
        victim = shared_tmp_path / f"__{world() - 1}_0.distcp"
        raw = bytearray(victim.read_bytes())
        raw[len(raw) - 100] ^= 0x10  # inside the tensor's data record
        victim.write_bytes(bytes(raw))
    dist.barrier()
    dst = {"x": distribute_tensor(torch.zeros_like(full), mesh, [Replicate()])}  # every rank reads every file
    with pytest.raises(dcp.api.CheckpointException) as caught:
        dcp.load(dst, storage_reader=dist_ckpt.dcp.StorageReader(shared_tmp_path))
    failures = _failures(caught.value)
    named = [f for f in failures if isinstance(f, ChecksumMismatchError) and "'x'" in str(f) and "distcp" in str(f)]
    assert_on_all_ranks(len(named) == world(), f"expected a ChecksumMismatchError on every rank: {failures}")


def test_a_write_failing_on_one_rank_fails_every_rank_and_commits_nothing(
    shared_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if rank() == world() - 1:

        def failing(self: LocalStorage, key: str) -> Any:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(LocalStorage, "open_writer", failing)
    mesh = init_device_mesh("cpu", (world(),))
    state = {"x": distribute_tensor(torch.ones(world() * 2, 3), mesh, [Shard(0)])}
    with pytest.raises(dcp.api.CheckpointException) as caught:
        dcp.save(state, storage_writer=dist_ckpt.dcp.StorageWriter(shared_tmp_path))
    failures = _failures(caught.value)
    dist.barrier()
    ok = any(isinstance(f, StorageError) for f in failures) and not (shared_tmp_path / ".metadata").exists()
    assert_on_all_ranks(ok, f"expected a StorageError and no .metadata: {failures}")
