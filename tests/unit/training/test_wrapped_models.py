"""save/load_model_and_optim_state with wrapped models: keys are the unwrapped model's names.

One process: torch.compile and DataParallel (``module.``, as DDP) wrappers, both directions,
the optimizer state keyed by the same names, and checkpoints that stored wrapped names. DDP and
FSDP1 at 2 and 4 ranks: tests/distributed/test_wrapped_models.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict

import pytest
import torch
from torch import nn

import dist_ckpt as dc
from dist_ckpt.errors import KeyMismatchError
from dist_ckpt.testing.training import full_state, make_model, make_optimizer, reference_run, state_differences, train
from dist_ckpt.training.model_state import model_optim_state_dict

N, M = 2, 2


def _compiled(model: nn.Module) -> nn.Module:
    return torch.compile(model, backend="eager")  # type: ignore[return-value]


def _container(model: nn.Module) -> nn.Module:
    """A plain module holding the model under ``module``: saves the keys an older dist_ckpt
    wrote for a DDP model (``model.module.0.weight``, ``optim.state.module.0.weight.exp_avg``)."""
    holder = nn.Module()
    holder.module = model
    holder.forward = model.forward  # type: ignore[method-assign]
    return holder


WRAPPERS: Dict[str, Callable[[nn.Module], nn.Module]] = {
    "plain": lambda m: m,
    "compile": _compiled,
    "data_parallel": nn.DataParallel,
    "data_parallel+compile": lambda m: nn.DataParallel(_compiled(m)),
}


def _inner(model: nn.Module) -> nn.Module:
    """The model inside the wrappers (full_state names entries as the plain reference does)."""
    while isinstance(model, (nn.DataParallel, torch._dynamo.eval_frame.OptimizedModule)):
        model = model.module if isinstance(model, nn.DataParallel) else model._orig_mod
    return model


@pytest.mark.parametrize("save_as, load_as", [("compile", "plain"), ("plain", "compile"),
                                              ("data_parallel", "plain"), ("plain", "data_parallel+compile"),
                                              ("data_parallel+compile", "compile")])  # fmt: skip
def test_wrapped_and_plain_models_load_each_others_checkpoints(save_as: str, load_as: str, tmp_path: Path) -> None:
    # 1. N steps with one wrapping, saved
    model = WRAPPERS[save_as](make_model(seed=0))
    optim = make_optimizer("adamw", model)
    train(model, optim, range(N))
    dc.save_model_and_optim_state(tmp_path / "c", model, optim)
    # 2. the keys are the plain model's, for the model and the optimizer state
    keys = sorted(dc.load_tensors_metadata(tmp_path / "c"))
    assert "model.0.weight" in keys and "optim.state.0.weight.exp_avg" in keys
    assert not [k for k in keys if "module" in k or "_orig_mod" in k]
    groups = dc.load_common_state_dict(tmp_path / "c")["optim"]["param_groups"]
    assert groups[0]["params"] == ["0.weight", "3.weight", "5.weight"]
    # 3. another wrapping loads it (wrong hyperparameters and values first) and continues exactly
    other = WRAPPERS[load_as](make_model(seed=1))
    other_optim = make_optimizer("adamw", other, lr_scale=7.0)
    dc.load_model_and_optim_state(tmp_path / "c", other, other_optim)
    train(other, other_optim, range(N, N + M))
    assert state_differences(reference_run("adamw", N + M), full_state(_inner(other), other_optim)) == []


@pytest.mark.parametrize("load_as", ["plain", "compile", "data_parallel"])
def test_a_checkpoint_that_stored_wrapped_names_still_loads(load_as: str, tmp_path: Path) -> None:
    model = _container(make_model(seed=0))
    optim = make_optimizer("sgd", model)
    train(model, optim, range(N))
    dc.save_model_and_optim_state(tmp_path / "old", model, optim)
    assert "model.module.0.weight" in dc.load_tensors_metadata(tmp_path / "old")  # as DDP's used to be
    other = WRAPPERS[load_as](make_model(seed=1))
    other_optim = make_optimizer("sgd", other, lr_scale=3.0)
    dc.load_model_and_optim_state(tmp_path / "old", other, other_optim)
    train(other, other_optim, range(N, N + M))
    assert state_differences(reference_run("sgd", N + M), full_state(_inner(other), other_optim)) == []


def test_a_real_submodule_called_module_is_not_mistaken_for_a_wrapper(tmp_path: Path) -> None:
    # a plain module with a submodule named ``module`` saves and loads under that name (loading
    # such a checkpoint into the bare model is the test above)
    model = _container(make_model(seed=0))
    dc.save_model_and_optim_state(tmp_path / "c", model, None)
    same = _container(make_model(seed=1))
    dc.load_model_and_optim_state(tmp_path / "c", same)
    assert all(torch.equal(a, b) for a, b in zip(same.state_dict().values(), model.state_dict().values()))


def test_a_different_model_still_fails_naming_the_keys(tmp_path: Path) -> None:
    model = _compiled(make_model(seed=0))
    dc.save_model_and_optim_state(tmp_path / "c", model, make_optimizer("sgd", model))
    bigger = _compiled(nn.Sequential(*make_model(seed=1), nn.Linear(3, 2)))
    with pytest.raises(KeyMismatchError, match=r"'6\.weight'") as info:
        dc.load_model_and_optim_state(tmp_path / "c", bigger)
    assert "_orig_mod" not in str(info.value)  # the model's names, as the checkpoint has them


def test_the_sharded_state_dict_of_a_wrapped_model_has_plain_keys() -> None:
    model = nn.DataParallel(_compiled(make_model(seed=0)))
    optim = make_optimizer("adam", model)
    train(model, optim, range(1))
    sd = model_optim_state_dict(model, optim)
    assert sorted(sd["model"]) == sorted(make_model(seed=0).state_dict())
    assert sorted(sd["optim"]["state"]) == [n for n, _ in sorted(make_model(seed=0).named_parameters())]
