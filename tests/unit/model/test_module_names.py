"""Canonical names of wrapped modules (dist_ckpt.model.module_names), as DCP's get_state_dict makes them.

DDP and FSDP1 need a process group and are covered in tests/distributed/test_wrapped_models.py;
here torch.compile, DataParallel (which wraps under ``module.`` like DDP, without a process
group) and the activation-checkpoint wrapper, at the top and nested.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from dist_ckpt.errors import CheckpointingException
from dist_ckpt.model.module_names import (
    ModuleNames,
    canonical_state_dict,
    has_fsdp1,
    match_stored_names,
    raw_names,
    strip_wrapper_prefixes,
    wrapped_attribute,
)

PLAIN_KEYS = ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))


def test_compile_and_data_parallel_at_the_top_are_dropped() -> None:
    net = _net()
    wrapped = torch.compile(nn.DataParallel(net), backend="eager")
    assert sorted(wrapped.state_dict())[0].startswith("_orig_mod.module.")  # what torch names them
    sd, raw = canonical_state_dict(wrapped)
    assert list(sd) == PLAIN_KEYS
    assert raw["0.weight"] == "_orig_mod.module.0.weight"
    assert sd["0.weight"] is not None and sd["0.weight"].data_ptr() == net[0].weight.data_ptr()  # no copies
    assert wrapped_attribute(wrapped) == "_orig_mod" and wrapped_attribute(net) is None


def test_nested_wrappers_are_dropped_where_they_sit() -> None:
    model = nn.Sequential(nn.Linear(2, 2), torch.compile(nn.Linear(2, 2), backend="eager"))
    model.append(checkpoint_wrapper(nn.Linear(2, 2)))
    names = ModuleNames(model)
    params = {names.canonical(n) for n, _ in model.named_parameters()}
    assert params == {f"{i}.{p}" for i in range(3) for p in ("weight", "bias")}
    assert names.canonical("1._orig_mod.weight") == "1.weight"
    assert names.canonical("2._checkpoint_wrapped_module.bias") == "2.bias"
    assert names.submodule("1") is model[1]._orig_mod  # the innermost module: it holds the parameters


def test_a_plain_submodule_called_module_keeps_its_name() -> None:
    holder = nn.Module()
    holder.module = _net()
    sd, _ = canonical_state_dict(holder)
    assert list(sd) == [f"module.{k}" for k in PLAIN_KEYS]
    assert ModuleNames(holder).submodule("module") is holder.module


def test_names_that_are_not_module_paths_are_unchanged() -> None:
    # e.g. the keys of an FSDP1 state_dict(), already cleaned by FSDP's hooks
    names = ModuleNames(torch.compile(_net(), backend="eager"))
    assert names.canonical("0.weight") == "0.weight"
    assert names.canonical("weight") == "weight"
    assert names.canonical("nope.weight") == "nope.weight"


def test_two_entries_with_one_canonical_name_are_refused() -> None:
    model = nn.Module()
    model.inner = torch.compile(nn.Linear(2, 2), backend="eager")
    names = ModuleNames(model)
    with pytest.raises(CheckpointingException, match="'inner.weight'.*rename one"):
        names.canonical_map(["inner._orig_mod.weight", "inner.weight"])


def test_raw_names_give_back_the_models_own_keys() -> None:
    wrapped = torch.compile(_net(), backend="eager")
    sd, _ = canonical_state_dict(wrapped)
    assert sorted(raw_names(wrapped, sd)) == sorted(wrapped.state_dict())
    wrapped.load_state_dict(raw_names(wrapped, {k: torch.zeros_like(v) for k, v in sd.items()}))
    assert not wrapped._orig_mod[0].weight.any()


@pytest.mark.parametrize(
    "stored, stripped",
    [
        ("module.fc.weight", "fc.weight"),
        ("module._orig_mod.fc.weight", "fc.weight"),
        ("_orig_mod.module.fc.weight", "fc.weight"),
        ("layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.w", "layers.0.w"),
        ("enc.module.weight", "enc.module.weight"),  # ``module`` only where DDP puts it
        ("module", "module"),  # a top-level tensor called module
        ("fc._orig_mod", "fc._orig_mod"),  # the last atom is the tensor's own name
    ],
)
def test_strip_wrapper_prefixes(stored: str, stripped: str) -> None:
    assert strip_wrapper_prefixes(stored) == stripped


def test_match_stored_names_prefers_the_exact_name() -> None:
    assert match_stored_names(["fc.weight"], ["module.fc.weight"]) == {"fc.weight": "module.fc.weight"}
    assert match_stored_names(["fc.weight"], ["fc.weight", "module.fc.weight"]) == {"fc.weight": "fc.weight"}
    # two stored names strip to the same one: ambiguous, left unmatched for the caller to report
    assert match_stored_names(["fc.weight"], ["module.fc.weight", "_orig_mod.fc.weight"]) == {}
    assert match_stored_names(["fc.bias"], ["module.fc.weight"]) == {}


def test_has_fsdp1_is_false_without_fsdp1() -> None:
    assert not has_fsdp1(torch.compile(_net(), backend="eager"))
