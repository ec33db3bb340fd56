"""Unit tests of dist_ckpt.model.optimizer (optimizer-state sharding helpers)."""

from __future__ import annotations

import logging

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.errors import InvalidShardedTensorError
from dist_ckpt.model.optimizer import (
    get_optim_param_to_id_map,
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)
from dist_ckpt.model.sharded import LocalNonPersistentObject, ShardedTensor, ShardedTensorFactory


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    return model, optim


def _sharded_model_sd(model, tp_rank=0, tp_size=1):
    sd = model.state_dict(keep_vars=True)
    return {k: ShardedTensor.from_rank_offsets(f"model.{k}", v, (0, tp_rank, tp_size)) for k, v in sd.items()}


class TestIdMaps:
    def test_optim_param_to_id_map(self):
        a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
        assert get_optim_param_to_id_map([a, b, a]) == {id(a): 0, id(b): 1}
        assert get_optim_param_to_id_map([]) == {}

    def test_param_id_to_sharded_param_map(self):
        model, optim = _model_and_optimizer()
        msd = _sharded_model_sd(model)
        params = optim.param_groups[0]["params"]
        id_map = get_param_id_to_sharded_param_map(msd, params)
        assert sorted(id_map) == [0, 1, 2, 3]
        for i, p in enumerate(params):
            assert id_map[i].data is p
        assert id_map[0].key == "model.0.weight" and id_map[3].key == "model.1.bias"

    def test_untracked_params_are_skipped(self):
        model, _ = _model_and_optimizer()
        msd = _sharded_model_sd(model)
        id_map = get_param_id_to_sharded_param_map(msd, [model[1].weight])
        assert list(id_map) == [0] and id_map[0].key == "model.1.weight"

    def test_factories_are_found(self):
        p = torch.nn.Parameter(torch.zeros(4))
        fac = ShardedTensorFactory("fac", p, lambda k, d, r: {}, lambda s: s)
        assert get_param_id_to_sharded_param_map({"x": [fac]}, [p]) == {0: fac}

    def test_warns_when_nothing_matches(self, caplog):
        model, optim = _model_and_optimizer()
        sd = {k: ShardedTensor.from_rank_offsets(k, v.detach().clone()) for k, v in model.state_dict().items()}
        with caplog.at_level(logging.WARNING, logger="dist_ckpt"):
            assert get_param_id_to_sharded_param_map(sd, optim.param_groups[0]["params"]) == {}
        assert "keep_vars=True" in caplog.text


class TestMakeShardedOptimizerTensor:
    def test_plain(self):
        model_param = ShardedTensor.from_rank_offsets(
            "w", torch.zeros(2, 3, dtype=torch.bfloat16), (0, 1, 2), replica_id=1
        )
        state = torch.ones(2, 3)
        out = make_sharded_optimizer_tensor(model_param, state, prefix="optimizer.state.exp_avg")
        assert out.key == "optimizer.state.exp_avg.w"
        assert out.data is state
        assert out.dtype == torch.float32  # the optimizer state's dtype, not the parameter's
        assert (out.global_shape, out.global_offset, out.replica_id) == ((4, 3), (2, 0), 1)
        assert model_param.key == "w" and model_param.dtype == torch.bfloat16

    def test_flattened(self):
        model_param = ShardedTensor.from_rank_offsets_flat(
            "w", torch.zeros(5), (3, 4), (0, 1, 2), flattened_range=slice(2, 7)
        )
        out = make_sharded_optimizer_tensor(model_param, torch.ones(5), prefix="p")
        assert out.flattened_range == slice(2, 7) and out.key == "p.w"
        with pytest.raises(InvalidShardedTensorError, match=r"p\.w"):
            make_sharded_optimizer_tensor(model_param, torch.ones(3, 4), prefix="p")

    def test_shape_mismatch_names_key(self):
        model_param = ShardedTensor.from_rank_offsets("layer.w", torch.zeros(2, 3))
        with pytest.raises(InvalidShardedTensorError, match=r"optimizer\.state\.exp_avg\.layer\.w"):
            make_sharded_optimizer_tensor(model_param, torch.ones(3, 2), prefix="optimizer.state.exp_avg")

    def test_factory(self):
        fac = ShardedTensorFactory("fac", torch.zeros(2), lambda k, d, r: {}, lambda s: s, replica_id=2)
        state = torch.ones(2)
        out = make_sharded_optimizer_tensor(fac, state, prefix="opt")
        assert isinstance(out, ShardedTensorFactory)
        assert out.key == "opt.fac" and out.data is state and out.replica_id == 2
        assert fac.key == "fac"


class TestOptimStateToShardingState:
    def test_adam(self):
        model, optim = _model_and_optimizer()
        msd = _sharded_model_sd(model)
        id_map = get_param_id_to_sharded_param_map(msd, optim.param_groups[0]["params"])
        osd = optim.state_dict()
        original_groups = osd["param_groups"]
        original_params = list(original_groups[0]["params"])
        exp_avg_0 = osd["state"][0]["exp_avg"]
        optim_state_to_sharding_state(osd, id_map, exclude_keys=("step",))
        assert sorted(osd["state"]) == [0, 1, 2, 3]
        entry = osd["state"][0]
        assert set(entry) == {"exp_avg", "exp_avg_sq"}  # "step" excluded
        assert entry["exp_avg"].key == "optimizer.state.exp_avg.model.0.weight"
        assert entry["exp_avg"].data is exp_avg_0
        assert entry["exp_avg_sq"].key == "optimizer.state.exp_avg_sq.model.0.weight"
        wrapped = osd["param_groups"][0]["params"]
        assert isinstance(wrapped, LocalNonPersistentObject) and wrapped.unwrap() == original_params
        assert osd["param_groups"][0]["lr"] == 0.1
        assert original_groups[0]["params"] == original_params  # the caller's groups are not mutated

    def test_without_exclude_keys_every_state_is_sharded(self):
        model = torch.nn.Linear(3, 2)
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(2, 3)).sum().backward()
        optim.step()
        id_map = get_param_id_to_sharded_param_map(_sharded_model_sd(model), optim.param_groups[0]["params"])
        osd = optim.state_dict()
        optim_state_to_sharding_state(osd, id_map)
        assert set(osd["state"][1]) == {"momentum_buffer"}
        assert osd["state"][1]["momentum_buffer"].key == "optimizer.state.momentum_buffer.model.bias"

    def test_scalar_step_must_be_excluded(self):
        # Adam's 0-d "step" cannot take its parameter's sharding: the error names the key
        model, optim = _model_and_optimizer()
        id_map = get_param_id_to_sharded_param_map(_sharded_model_sd(model), optim.param_groups[0]["params"])
        with pytest.raises(InvalidShardedTensorError, match=r"optimizer\.state\.step\.model\.0\.weight"):
            optim_state_to_sharding_state(optim.state_dict(), id_map)

    def test_unknown_param_id(self):
        model, optim = _model_and_optimizer()
        id_map = get_param_id_to_sharded_param_map(_sharded_model_sd(model), optim.param_groups[0]["params"])
        del id_map[2]
        with pytest.raises(InvalidShardedTensorError, match="2"):
            optim_state_to_sharding_state(optim.state_dict(), id_map, exclude_keys=("step",))

    def test_save_and_load_resharded(self, tmp_path):
        """Optimizer state saved as 2 tensor-parallel 'ranks' loads back as one."""
        model, optim = _model_and_optimizer()
        full_osd = optim.state_dict()
        expected = {i: {k: v.clone() for k, v in s.items()} for i, s in full_osd["state"].items()}
        params = optim.param_groups[0]["params"]
        sd = {}
        for rank in range(2):
            msd = {}
            rank_params = []
            for name, p in model.state_dict(keep_vars=True).items():
                chunk = torch.nn.Parameter(p.detach().chunk(2)[rank].clone())
                msd[name] = ShardedTensor.from_rank_offsets(f"model.{name}", chunk, (0, rank, 2))
                rank_params.append(chunk)
            id_map = get_param_id_to_sharded_param_map(msd, rank_params)
            osd = {
                "state": {
                    i: {k: v.chunk(2)[rank].clone() for k, v in s.items() if k != "step"}
                    for i, s in full_osd["state"].items()
                },
                "param_groups": [dict(g) for g in full_osd["param_groups"]],
            }
            optim_state_to_sharding_state(osd, id_map)
            sd[f"rank{rank}"] = osd
        dc.save(sd, tmp_path / "ckpt")

        id_map = get_param_id_to_sharded_param_map(_sharded_model_sd(model), params)
        target = optim.state_dict()
        for s in target["state"].values():
            for k in ("exp_avg", "exp_avg_sq"):
                s[k] = torch.full_like(s[k], float("nan"))
        optim_state_to_sharding_state(target, id_map, exclude_keys=("step",))
        loaded = dc.load(target, tmp_path / "ckpt")
        for i, s in expected.items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(loaded["state"][i][k], s[k])
        assert loaded["param_groups"][0]["params"] == full_osd["param_groups"][0]["params"]
