"""Model + optimizer checkpoints of DDP and FSDP1 models: the unwrapped model's names, both ways.

A DistributedDataParallel model (alone and around a torch.compile one) trains N steps and
saves; a plain model on every rank loads the checkpoint and continues M steps, bit for bit as
N + M uninterrupted steps of a plain model; and the reverse (plain saves, DDP continues). DDP
averages gradients over ranks; ``exact_loss_scale`` makes that average exact (see
dist_ckpt.testing.training). FSDP1 models load and save the model state (through their
``load_state_dict``: their ``state_dict()`` holds copies); their optimizer state is refused on
every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_ckpt.engine.load_parts import load_tensors_metadata
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.testing.training import (
    exact_loss_scale,
    full_state,
    make_model,
    make_optimizer,
    reference_run,
    state_differences,
    train,
)
from dist_ckpt.training.model_optim import load_model_and_optim_state, save_model_and_optim_state

from .helpers import assert_on_all_ranks, raises_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)

N, M = 2, 2

WRAPS: Dict[str, Callable[[nn.Module], nn.Module]] = {
    "ddp": DDP,
    "ddp+compile": lambda m: DDP(torch.compile(m, backend="eager")),
}


def _inner(model: nn.Module) -> nn.Module:
    """The plain model inside DDP (and torch.compile): full_state names entries as the plain
    reference run does."""
    model = model.module if isinstance(model, DDP) else model
    return getattr(model, "_orig_mod", model)


@pytest.mark.parametrize("wrap", sorted(WRAPS))
def test_ddp_checkpoint_continues_in_a_plain_model_and_back(wrap: str, shared_tmp_path: Path) -> None:
    scale = exact_loss_scale(rank(), world())
    # 1. DDP trains N steps and saves; the keys are the plain model's
    ddp = WRAPS[wrap](make_model(seed=0))
    optim = make_optimizer("adamw", ddp)
    train(ddp, optim, range(N), scale)
    save_model_and_optim_state(shared_tmp_path / "ddp", ddp, optim)
    keys = sorted(load_tensors_metadata(shared_tmp_path / "ddp"))
    wrapped_keys = [k for k in keys if ".module." in f".{k}" or "_orig_mod" in k]
    assert_on_all_ranks("model.0.weight" in keys and not wrapped_keys, f"keys {keys}")
    # 2. a plain model (on every rank) loads it with wrong values and hyperparameters, continues
    plain = make_model(seed=1)
    plain_optim = make_optimizer("adamw", plain, lr_scale=7.0)
    load_model_and_optim_state(shared_tmp_path / "ddp", plain, plain_optim)
    train(plain, plain_optim, range(N, N + M))
    reference = reference_run("adamw", N + M)
    diffs = state_differences(reference, full_state(plain, plain_optim))
    # 3. the reverse: the plain model saves after N steps, a fresh DDP model loads and continues
    plain = make_model(seed=0)
    plain_optim = make_optimizer("adamw", plain)
    train(plain, plain_optim, range(N))
    save_model_and_optim_state(shared_tmp_path / "plain", plain, plain_optim)
    ddp = WRAPS[wrap](make_model(seed=1))
    optim = make_optimizer("adamw", ddp, lr_scale=7.0)
    load_model_and_optim_state(shared_tmp_path / "plain", ddp, optim)
    train(ddp, optim, range(N, N + M), scale)
    diffs += state_differences(reference, full_state(_inner(ddp), optim))
    assert_on_all_ranks(not diffs, f"differences from the uninterrupted run: {diffs[:8]}")


def test_fsdp1_model_state_round_trips_and_its_optimizer_is_refused(shared_tmp_path: Path) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    plain = make_model(seed=0)
    save_model_and_optim_state(shared_tmp_path / "plain", plain, None)
    # 1. into an FSDP1 model (flat parameters, sharded over the ranks)
    fsdp = FSDP(make_model(seed=1), device_id=torch.device("cpu"))
    load_model_and_optim_state(shared_tmp_path / "plain", fsdp)
    got = fsdp.state_dict()  # full tensors on every rank (FULL_STATE_DICT)
    expected = plain.state_dict()
    same = got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    assert_on_all_ranks(same, f"FSDP1 model after loading: {sorted(got)} vs {sorted(expected)}")
    # 2. saved from FSDP1 (model only), loaded into a plain model
    save_model_and_optim_state(shared_tmp_path / "fsdp1", fsdp, None)
    again = make_model(seed=2)
    load_model_and_optim_state(shared_tmp_path / "fsdp1", again)
    same = all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), expected.values()))
    assert_on_all_ranks(same, "plain model loaded from the FSDP1 checkpoint differs")
    # 3. its optimizer state (flattened per-rank shards) is refused on every rank, before any write
    optim = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    raises_on_all_ranks(
        CheckpointingException,
        lambda: save_model_and_optim_state(shared_tmp_path / "refused", fsdp, optim),
        match="FSDP1",
    )
