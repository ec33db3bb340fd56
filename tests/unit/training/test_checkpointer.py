"""Unit tests of the model + optimizer API and the Checkpointer, in one process (no process group)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dist_ckpt.backends.base import LoadShardedStrategy
from dist_ckpt.engine.checks.compatibility import verify_checkpoint_and_load_strategy
from dist_ckpt.errors import (
    ArgumentTypeError,
    CheckpointExistsError,
    CheckpointingException,
    KeyMismatchError,
    LoadMismatchError,
    NotACheckpointError,
    ShardingIntegrityError,
)
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor, StateDict
from dist_ckpt.testing.layouts import bitwise_equal
from dist_ckpt.testing.training import (
    OPTIMIZERS,
    full_state,
    make_model,
    make_optimizer,
    reference_run,
    state_differences,
    train,
)
from dist_ckpt.training.checkpointer import Checkpointer, TensorMetadata
from dist_ckpt.training.model_optim import (
    load_model_and_optim_state,
    save_model_and_optim_state,
    unshard_model_state,
    unshard_optim_state,
)

N, M = 3, 2


def _trained(optimizer: str, steps: int = N):
    model = make_model(seed=0)
    optim = make_optimizer(optimizer, model)
    train(model, optim, range(steps))
    return model, optim


@pytest.fixture
def saved(tmp_path: Path):
    """An AdamW model trained N steps and saved: (model, optim, checkpoint dir)."""
    model, optim = _trained("adamw")
    save_model_and_optim_state(tmp_path / "ckpt", model, optim)
    return model, optim, tmp_path / "ckpt"


# --------------------------------------------------------------------------- continuation


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_training_continues_bit_exactly(optimizer: str, tmp_path: Path) -> None:
    model, optim = _trained(optimizer)
    save_model_and_optim_state(tmp_path / "ckpt", model, optim)
    # another init and wrong hyperparameters: only a complete load can match the reference
    model2 = make_model(seed=1)
    optim2 = make_optimizer(optimizer, model2, lr_scale=7.0)
    load_model_and_optim_state(tmp_path / "ckpt", model2, optim2)
    train(model2, optim2, range(N, N + M))
    reference = reference_run(optimizer, N + M)
    assert state_differences(reference, full_state(model2, optim2)) == []


def test_model_only_load_does_not_restore_the_optimizer(tmp_path: Path) -> None:
    """The control of the test above: without the optimizer state the run diverges."""
    model, optim = _trained("adam")
    save_model_and_optim_state(tmp_path / "ckpt", model, optim)
    model2 = make_model(seed=1)
    optim2 = make_optimizer("adam", model2)
    load_model_and_optim_state(tmp_path / "ckpt", model2)
    assert state_differences(full_state(model, None), full_state(model2, None)) == []
    train(model2, optim2, range(N, N + M))
    diffs = state_differences(reference_run("adam", N + M), full_state(model2, optim2))
    assert "model.0.weight" in diffs and "optim.0.weight.step" in diffs


def test_hyperparameters_come_from_the_checkpoint(saved) -> None:
    _, optim, ckpt = saved
    model2 = make_model(seed=1)
    optim2 = make_optimizer("adamw", model2, lr_scale=7.0)
    load_model_and_optim_state(ckpt, model2, optim2)
    assert [g["lr"] for g in optim2.param_groups] == [g["lr"] for g in optim.param_groups] == [1e-2, 3e-2]
    assert [g["weight_decay"] for g in optim2.param_groups] == [0.1, 0.0]


def test_step_tensors_are_not_shared_between_parameters(saved) -> None:
    _, _, ckpt = saved
    model2 = make_model(seed=1)
    optim2 = make_optimizer("adamw", model2)
    load_model_and_optim_state(ckpt, model2, optim2)
    steps = [optim2.state[p]["step"] for p in model2.parameters()]
    assert len({id(s) for s in steps}) == len(steps) and all(float(s) == N for s in steps)


def test_load_is_in_place(saved) -> None:
    _, _, ckpt = saved
    model2 = make_model(seed=1)
    before = {n: p.data_ptr() for n, p in model2.named_parameters()}
    load_model_and_optim_state(ckpt, model2)
    assert {n: p.data_ptr() for n, p in model2.named_parameters()} == before


def test_integer_buffers_are_loaded(saved) -> None:
    model, _, ckpt = saved
    model2 = make_model(seed=1)
    load_model_and_optim_state(ckpt, model2)
    assert int(model2[1].num_batches_tracked) == int(model[1].num_batches_tracked) == N


def test_stored_dtype_is_cast_to_the_live_one(saved) -> None:
    model, _, ckpt = saved
    model2 = make_model(seed=1).to(torch.bfloat16)
    load_model_and_optim_state(ckpt, model2)
    assert model2[0].weight.dtype == torch.bfloat16
    assert torch.equal(model2[0].weight, model[0].weight.detach().to(torch.bfloat16))


# --------------------------------------------------------------------------- validate


class _SkippingLoader(LoadShardedStrategy):
    """Wraps the checkpoint's own loader but silently leaves one tensor unloaded (the hole
    validate must catch)."""

    def __init__(self, checkpoint_dir: Path, skip: str) -> None:
        self.base = verify_checkpoint_and_load_strategy(checkpoint_dir)[0]
        self.skip = skip

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        self.base.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        self.base.check_version_compatibility(loaded_version)

    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        return self.base.load_tensors_metadata(checkpoint_dir)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        kept = {k: v for k, v in sharded_state_dict.items() if v.key != self.skip}
        loaded = self.base.load(kept, checkpoint_dir)
        return {k: loaded[k] if k in loaded else v.data for k, v in sharded_state_dict.items()}


def test_validate_names_a_tensor_left_unloaded(saved) -> None:
    _, _, ckpt = saved
    model2 = make_model(seed=1)
    optim2 = make_optimizer("adamw", model2)
    with pytest.raises(ShardingIntegrityError, match=r"'optim.state.3.weight.exp_avg' \(407 of 407"):
        load_model_and_optim_state(
            ckpt, model2, optim2, load_strategy=_SkippingLoader(ckpt, "optim.state.3.weight.exp_avg")
        )


def test_without_validate_the_hole_goes_unnoticed(saved) -> None:
    _, _, ckpt = saved
    model2 = make_model(seed=1)
    load_model_and_optim_state(ckpt, model2, validate=False, load_strategy=_SkippingLoader(ckpt, "model.0.bias"))
    assert not torch.isnan(model2[0].bias).any()  # the old value stayed: nothing reported


def test_validate_flags_nan_stored_in_the_checkpoint(tmp_path: Path) -> None:
    """The documented false positive: NaN in the checkpoint looks like a hole."""
    model, optim = _trained("sgd")
    with torch.no_grad():
        model[5].bias[1] = float("nan")
    save_model_and_optim_state(tmp_path / "ckpt", model, optim)
    with pytest.raises(ShardingIntegrityError, match=r"'model.5.bias' \(1 of 3"):
        load_model_and_optim_state(tmp_path / "ckpt", make_model(seed=1))
    model2 = make_model(seed=1)
    load_model_and_optim_state(tmp_path / "ckpt", model2, validate=False)
    assert bitwise_equal(model2[5].bias.detach(), model[5].bias.detach())


# --------------------------------------------------------------------------- mismatches


def test_model_entry_missing_from_checkpoint(saved) -> None:
    _, _, ckpt = saved
    bigger = torch.nn.Sequential(*make_model(seed=1), torch.nn.Linear(3, 2))
    with pytest.raises(
        KeyMismatchError, match=r"\[rank 0\].*absent from the checkpoint: \['6.bias', '6.weight'\]"
    ) as info:
        load_model_and_optim_state(ckpt, bigger)
    assert info.value.unexpected_keys == ["model.6.bias", "model.6.weight"]


def test_checkpoint_entry_missing_from_model(saved) -> None:
    _, _, ckpt = saved
    smaller = torch.nn.Sequential(*list(make_model(seed=1))[:5])
    with pytest.raises(KeyMismatchError, match=r"the model does not have: \['5.bias', '5.weight'\]") as info:
        load_model_and_optim_state(ckpt, smaller)
    assert info.value.missing_keys == ["model.5.bias", "model.5.weight"]


def test_shape_mismatch_names_key_and_shapes(saved) -> None:
    _, _, ckpt = saved
    model2 = make_model(seed=1)
    model2[5] = torch.nn.Linear(11, 4)
    with pytest.raises(LoadMismatchError, match=r"\[rank 0\] model entry '5.weight'.*\(4, 11\).*\(3, 11\)"):
        load_model_and_optim_state(ckpt, model2)


def test_optimizer_over_other_parameters(saved) -> None:
    _, _, ckpt = saved
    model2 = make_model(seed=1)
    optim2 = torch.optim.AdamW([model2[0].weight], lr=1.0)
    with pytest.raises(KeyMismatchError, match="this optimizer does not hold: .*'0.bias'"):
        load_model_and_optim_state(ckpt, model2, optim2)


def test_regrouped_parameters_are_refused(saved) -> None:
    _, _, ckpt = saved
    model2 = make_model(seed=1)
    optim2 = torch.optim.AdamW(model2.parameters(), lr=1.0)  # one group; the checkpoint has two
    with pytest.raises(LoadMismatchError, match=r"param group 0 .* different groups \[0, 1\]"):
        load_model_and_optim_state(ckpt, model2, optim2)


def test_not_a_model_checkpoint(tmp_path: Path) -> None:
    Checkpointer().save(tmp_path / "flat", {"w": torch.ones(2)})
    with pytest.raises(NotACheckpointError, match="save_model_and_optim_state"):
        load_model_and_optim_state(tmp_path / "flat", make_model(seed=0))


# --------------------------------------------------------------------------- unshard


def test_unshard_model_state_is_the_state_dict(saved) -> None:
    model, _, ckpt = saved
    full = unshard_model_state(ckpt)
    assert set(full) == set(model.state_dict())
    assert all(bitwise_equal(full[k], v) for k, v in model.state_dict().items())
    fresh = make_model(seed=1)
    fresh.load_state_dict(unshard_model_state(ckpt, no_dist=True))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_unshard_optim_state_is_keyed_by_fqn(saved) -> None:
    model, optim, ckpt = saved
    osd = unshard_optim_state(ckpt, device=torch.device("cpu"), rank0_only=True)
    names = {id(p): n for n, p in model.named_parameters()}
    assert set(osd["state"]) == set(names.values())
    for p, state in optim.state.items():
        got = osd["state"][names[id(p)]]
        assert set(got) == set(state)
        assert all(bitwise_equal(got[k], v) for k, v in state.items())
    assert [g["params"] for g in osd["param_groups"]] == [
        [names[id(p)] for p in g["params"]] for g in optim.param_groups
    ]
    assert [g["lr"] for g in osd["param_groups"]] == [1e-2, 3e-2]


def test_unshard_model_does_not_read_the_optimizer(saved, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, ckpt = saved
    requested: list = []
    loader_class = type(verify_checkpoint_and_load_strategy(ckpt)[0])  # whatever backend is the default
    original = loader_class.load

    def spy(self: Any, sd: ShardedStateDict, path: Path) -> StateDict:
        requested.extend(sd)
        return original(self, sd, path)

    monkeypatch.setattr(loader_class, "load", spy)
    unshard_model_state(ckpt)
    assert requested and all(k.startswith("model.") for k in requested)


# --------------------------------------------------------------------------- Checkpointer


def test_checkpointer_round_trip_and_metadata(tmp_path: Path) -> None:
    w, b = torch.randn(5, 3), torch.arange(4, dtype=torch.int32)
    sh = ShardedTensor.from_rank_offsets("sharded.x", torch.randn(6))
    ckpt = Checkpointer()
    meta = ckpt.save(tmp_path / "c", {"w": w, "b": b, "x": sh})
    assert meta.tensors == {
        "b": TensorMetadata((4,), torch.int32),
        "sharded.x": TensorMetadata((6,), torch.float32),
        "w": TensorMetadata((5, 3), torch.float32),
    }
    assert ckpt.get_metadata(tmp_path / "c") == meta
    w2, b2, x2 = torch.zeros(5, 3), torch.zeros(4, dtype=torch.int32), torch.zeros(6)
    ckpt.load(tmp_path / "c", {"w": w2, "b": b2, "x": ShardedTensor.from_rank_offsets("sharded.x", x2)}, validate=True)
    assert bitwise_equal(w2, w) and bitwise_equal(b2, b) and sh.data is not None and bitwise_equal(x2, sh.data)
    full = ckpt.unshard(tmp_path / "c", no_dist=True)
    assert set(full) == {"w", "b", "sharded.x"} and bitwise_equal(full["w"], w)


def test_checkpointer_no_dist_load_into_non_contiguous_tensor(tmp_path: Path) -> None:
    w = torch.randn(4, 6)
    Checkpointer().save(tmp_path / "c", {"w": w})
    dest = torch.zeros(6, 4).t()  # non-contiguous view, filled in place
    Checkpointer().load(tmp_path / "c", {"w": dest}, no_dist=True)
    assert bitwise_equal(dest.contiguous(), w)


def test_checkpointer_load_errors(tmp_path: Path) -> None:
    Checkpointer().save(tmp_path / "c", {"w": torch.ones(2, 2)})
    with pytest.raises(CheckpointingException, match="'v' is not in checkpoint"):
        Checkpointer().load(tmp_path / "c", {"v": torch.ones(2, 2)})
    with pytest.raises(LoadMismatchError, match=r"'w' has shape \(4,\)"):
        Checkpointer().load(tmp_path / "c", {"w": torch.ones(4)})
    with pytest.raises(CheckpointingException, match="tensors only"):
        Checkpointer().save(tmp_path / "d", {"w": [1, 2]})


def test_arguments_by_keyword_in_either_order(tmp_path: Path) -> None:
    w = torch.randn(3)
    ckpt = Checkpointer()
    ckpt.save(state_dict={"w": w}, dir=tmp_path / "c")
    w2 = torch.zeros(3)
    ckpt.load(state_dict={"w": w2}, dir=str(tmp_path / "c"))
    assert bitwise_equal(w2, w)


@pytest.mark.parametrize("method", ["save", "save_sharded", "async_save_request", "load"])
def test_swapped_arguments_say_which_is_which(tmp_path: Path, method: str) -> None:
    """``dist_ckpt.save(state_dict, dir)`` habits: the reversed order is named, nothing is written."""
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}
    with pytest.raises(ArgumentTypeError) as info:
        getattr(Checkpointer(), method)(state, str(tmp_path / "c"))
    message = str(info.value)
    assert isinstance(info.value, TypeError) and isinstance(info.value, CheckpointingException)
    assert f"Checkpointer.{method}(dir, state_dict)" in message and "swapped" in message, message
    assert "[rank 0]" in message and str(tmp_path / "c") in message and "dist_ckpt.save(state_dict" in message
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "dir, state_dict, match",
    [
        (["ckpt"], {}, r"dir must be a path \(str or os.PathLike\), got list"),
        ("ckpt", [torch.ones(1)], r"state_dict must be a mapping of key -> tensor, got list"),
    ],
)
def test_wrong_argument_types_are_named(tmp_path: Path, dir: Any, state_dict: Any, match: str) -> None:
    with pytest.raises(ArgumentTypeError, match=match):
        Checkpointer().save(dir, state_dict)


def test_save_overwrite(tmp_path: Path) -> None:
    model, optim = _trained("sgd", steps=1)
    save_model_and_optim_state(tmp_path / "c", model, optim)
    with pytest.raises(CheckpointExistsError):
        save_model_and_optim_state(tmp_path / "c", model, optim)
    train(model, optim, range(1, 2))
    save_model_and_optim_state(tmp_path / "c", model, optim, save_overwrite=True)
    assert bitwise_equal(unshard_model_state(tmp_path / "c")["0.weight"], model[0].weight.detach())


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x))


def test_tied_parameters_keep_one_optimizer_entry(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Tied()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.arange(5)).sum().backward()
    optim.step()
    save_model_and_optim_state(tmp_path / "c", model, optim)
    torch.manual_seed(1)
    model2 = _Tied()
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.3)
    load_model_and_optim_state(tmp_path / "c", model2, optim2)
    assert set(unshard_model_state(tmp_path / "c")) == {"emb.weight", "head.weight"}
    assert list(unshard_optim_state(tmp_path / "c")["state"]) == ["emb.weight"]  # the first name
    assert model2.head.weight is model2.emb.weight and torch.equal(model2.emb.weight, model.emb.weight)
    assert bitwise_equal(optim2.state[model2.emb.weight]["exp_avg"], optim.state[model.emb.weight]["exp_avg"])


def test_checkpointer_progress_and_watchdog_options_reach_save_and_load(tmp_path: Path) -> None:
    from dist_ckpt.engine.report import Operation, ProgressEvent

    events: list[ProgressEvent] = []
    ckpt = Checkpointer(progress=events.append, watchdog_timeout_s=None)
    w = torch.arange(6.0)
    ckpt.save(tmp_path / "c", {"w": w})
    target = torch.zeros(6)
    ckpt.load(tmp_path / "c", {"w": target})
    assert torch.equal(target, w)
    operations = [e.operation for e in events if e.done]
    assert Operation.SAVE in operations and Operation.LOAD in operations
    assert [e.phase for e in events if e.operation == Operation.SAVE and e.done][-1] == "committing metadata.json"


def test_a_value_that_is_not_a_tensor_is_named_with_its_article(tmp_path: Path) -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(CheckpointingException, match=r"'optim' is an AdamW; Checkpointer saves tensors only"):
        Checkpointer().save(tmp_path / "c", {"optim": optimizer})  # type: ignore[dict-item]
