"""Model + optimizer checkpoints across world sizes: FSDP2 (DTensor) and plain replicated models.

The continuation test trains N steps at this session's world size, saves, and continues M steps
in fresh jobs of another size -- 2 -> 4 and 2 -> 1 in the 2-rank session, 4 -> 2 and 4 -> 1 in
the 4-rank session -- then compares every parameter, buffer, optimizer state and hyperparameter
bit-for-bit with N + M uninterrupted steps of a plain model (see dist_ckpt.testing.training for
why the numerics are layout-independent). The other tests stay in the session's process group.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dist_ckpt.errors import KeyMismatchError
from dist_ckpt.testing import spawn_ranks
from dist_ckpt.testing.layouts import bitwise_equal
from dist_ckpt.testing.training import (
    OPTIMIZERS,
    State,
    exact_loss_scale,
    full_state,
    make_model,
    make_optimizer,
    max_abs_difference,
    reference_run,
    shard_with_fsdp2,
    state_differences,
    train,
)
from dist_ckpt.training.checkpointer import Checkpointer
from dist_ckpt.training.model_optim import (
    load_model_and_optim_state,
    save_model_and_optim_state,
    unshard_model_state,
    unshard_optim_state,
)
from tests.deadlines import scaled

from .helpers import assert_on_all_ranks, raises_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)

N, M = 3, 2
#: fresh-job world sizes to continue in, by session world size (1 = one process, no process group)
CONTINUE_AT = {2: [4, 1], 4: [2, 1]}
SPAWN_TIMEOUT_S = scaled(75.0)  # below the session's collective timeout, so a hang is reported, not waited out


def _continue(model: torch.nn.Module, optimizer: str, ckpt: str, loss_scale: float) -> State:
    """Load ``ckpt`` into a differently initialized model and a misconfigured optimizer, train M."""
    optim = make_optimizer(optimizer, model, lr_scale=7.0)
    load_model_and_optim_state(ckpt, model, optim)
    train(model, optim, range(N, N + M), loss_scale)
    return full_state(model, optim)


def _continue_fsdp2(rank_: int, world_size: int, root: str) -> Optional[Dict[str, State]]:
    """Runs in a fresh job of ``world_size`` ranks."""
    torch.set_num_threads(1)
    out = {}
    for optimizer in OPTIMIZERS:
        model = shard_with_fsdp2(make_model(seed=1))
        out[optimizer] = _continue(model, optimizer, f"{root}/{optimizer}", exact_loss_scale(rank_, world_size))
    return out if rank_ == 0 else None


def _continue_single_process(root: str) -> Dict[str, State]:
    """Runs in a fresh process without any process group, on a plain model."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    torch.set_num_threads(1)
    return {opt: _continue(make_model(seed=1), opt, f"{root}/{opt}", 1.0) for opt in OPTIMIZERS}


def _compare_with_reference(results: Dict[str, State], where: str) -> List[str]:
    problems = []
    for optimizer in OPTIMIZERS:
        reference = reference_run(optimizer, N + M)
        diffs = state_differences(reference, results[optimizer])
        if diffs:
            worst = max_abs_difference(reference, results[optimizer])
            problems.append(f"{where}/{optimizer}: {diffs[:6]} differ (max |diff| {worst})")
    return problems


def test_fsdp2_training_continues_bit_exactly_in_other_world_sizes(shared_tmp_path: Path) -> None:
    # 1. N steps under FSDP2 at this world size; one checkpoint per optimizer
    for optimizer in OPTIMIZERS:
        model = shard_with_fsdp2(make_model(seed=0))
        optim = make_optimizer(optimizer, model)
        train(model, optim, range(N), exact_loss_scale(rank(), world()))
        save_model_and_optim_state(shared_tmp_path / optimizer, model, optim)
    # 2. rank 0 continues in a fresh multi-rank job, rank 1 in a fresh single process, in parallel
    targets = CONTINUE_AT.get(world(), [])
    problems: List[str] = []
    try:
        if rank() == 0 and targets and targets[0] > 1:
            results = spawn_ranks(_continue_fsdp2, targets[0], str(shared_tmp_path), timeout_s=SPAWN_TIMEOUT_S)[0]
            problems = _compare_with_reference(results, f"{world()}->{targets[0]} ranks")
        if rank() == 1 and 1 in targets:
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                results = pool.apply_async(_continue_single_process, (str(shared_tmp_path),)).get(SPAWN_TIMEOUT_S)
            problems = _compare_with_reference(results, f"{world()}->1 process")
    except Exception as e:  # noqa: BLE001 -- every rank must reach the check below
        problems = [f"continuation job failed: {e!r}"]
    # 3. every rank agrees on the outcome
    assert_on_all_ranks(not problems, "; ".join(problems))


def test_plain_replicated_model_continues_under_fsdp2_and_back(shared_tmp_path: Path) -> None:
    """A plain model on every rank (rank 0 writes it) -> FSDP2 at the same world size, and an
    FSDP2 checkpoint -> plain models on every rank; both continue bit-exactly."""
    model = make_model(seed=0)
    optim = make_optimizer("adamw", model)
    train(model, optim, range(N))
    save_model_and_optim_state(shared_tmp_path / "plain", model, optim)
    sharded = _continue(
        shard_with_fsdp2(make_model(seed=1)), "adamw", str(shared_tmp_path / "plain"), exact_loss_scale(rank(), world())
    )

    model = shard_with_fsdp2(make_model(seed=0))
    optim = make_optimizer("adamw", model)
    train(model, optim, range(N), exact_loss_scale(rank(), world()))
    save_model_and_optim_state(shared_tmp_path / "fsdp2", model, optim)
    plain = _continue(make_model(seed=1), "adamw", str(shared_tmp_path / "fsdp2"), 1.0)

    reference = reference_run("adamw", N + M)
    diffs = state_differences(reference, sharded) + state_differences(reference, plain)
    assert_on_all_ranks(not diffs, f"differences from the uninterrupted run: {diffs[:8]}")


def test_mismatch_on_one_rank_is_raised_on_every_rank(shared_tmp_path: Path) -> None:
    model = make_model(seed=0)
    save_model_and_optim_state(shared_tmp_path / "c", model, make_optimizer("sgd", model))
    target = make_model(seed=1)
    if rank() == world() - 1:
        target = torch.nn.Sequential(*target, torch.nn.Linear(3, 2))
    error = raises_on_all_ranks(KeyMismatchError, lambda: load_model_and_optim_state(shared_tmp_path / "c", target))
    assert_on_all_ranks(f"[rank {world() - 1}]" in str(error) and "'6.weight'" in str(error), str(error))


def test_unshard_from_fsdp2_checkpoint(shared_tmp_path: Path) -> None:
    model = shard_with_fsdp2(make_model(seed=0))
    optim = make_optimizer("adam", model)
    train(model, optim, range(2), exact_loss_scale(rank(), world()))
    save_model_and_optim_state(shared_tmp_path / "c", model, optim)
    expected = full_state(model, optim)

    everywhere = unshard_model_state(shared_tmp_path / "c")
    rank0 = unshard_model_state(shared_tmp_path / "c", rank0_only=True)
    osd = unshard_optim_state(shared_tmp_path / "c", rank0_only=True)
    got = {f"model.{k}": v.numpy() for k, v in everywhere.items()}
    problems = state_differences({k: v for k, v in expected.items() if k.startswith("model.")}, got)
    if rank() == 0:
        optim_got = {f"optim.{fqn}.{n}": v.numpy() for fqn, s in osd["state"].items() for n, v in s.items()}
        problems += state_differences({k: v for k, v in expected.items() if k.startswith("optim.")}, optim_got)
        problems += [] if set(rank0) == set(everywhere) else ["rank0_only: rank 0 lacks tensors"]
    elif rank0 or osd["state"] or osd["param_groups"]:
        problems.append("rank0_only: a rank other than 0 received state")
    assert_on_all_ranks(not problems, f"unsharded state differs: {problems[:8]}")


def _layouts() -> List[Any]:
    """(save placements, save mesh, load placements, load mesh) for this world size."""
    w = world()
    layouts = [([Shard(0)], (w,), [Replicate()], (w,)), ([Replicate()], (w,), [Shard(1)], (w,))]
    if w == 4:
        layouts.append(([Replicate(), Shard(0)], (2, 2), [Shard(0), Shard(1)], (2, 2)))
    return layouts


@pytest.mark.parametrize("index", range(3))
def test_checkpointer_reshards_dtensors(index: int, shared_tmp_path: Path) -> None:
    layouts = _layouts()
    if index >= len(layouts):
        pytest.skip("layout needs 4 ranks")
    save_placements, save_mesh, load_placements, load_mesh = layouts[index]
    full = torch.arange(7 * 8, dtype=torch.float32).reshape(7, 8)  # 7 rows: uneven dim-0 shards
    src = distribute_tensor(full, init_device_mesh("cpu", save_mesh), save_placements)
    Checkpointer().save(shared_tmp_path / "c", {"x": src})
    dst = distribute_tensor(torch.zeros(7, 8), init_device_mesh("cpu", load_mesh), load_placements)
    Checkpointer().load(shared_tmp_path / "c", {"x": dst}, validate=True)
    assert_on_all_ranks(bitwise_equal(dst.full_tensor(), full), f"resharded DTensor differs: {dst.to_local()}")


@pytest.mark.parametrize("method", ["save", "save_sharded", "load"])
def test_arguments_swapped_on_one_rank_are_raised_on_every_rank(method: str, shared_tmp_path: Path) -> None:
    """Only the last rank passes ``dist_ckpt.save``'s order: every rank raises, none hangs."""
    from dist_ckpt.errors import ArgumentTypeError
    from dist_ckpt.model.sharded import ShardedTensor

    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2), replica_id=rank())}
    path = str(shared_tmp_path / "c")
    args = (state, path) if rank() == world() - 1 else (path, state)
    err = raises_on_all_ranks(ArgumentTypeError, lambda: getattr(Checkpointer(), method)(*args), "swapped")
    assert f"rank {world() - 1}" in str(err)
