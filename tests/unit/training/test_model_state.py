"""Unit tests of the DTensor-to-ShardedTensor mapping and the FQN key scheme (one process)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import dist_ckpt as dc
from dist_ckpt.errors import CheckpointingException, InvalidShardedTensorError, KeyMismatchError
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.testing.layouts import bitwise_equal
from dist_ckpt.testing.training import make_model, make_optimizer, train
from dist_ckpt.training.dtensor_shards import (
    LocalBox,
    chunk_range,
    local_box,
    sharded_tensor_from_box,
    to_sharded_tensor,
)
from dist_ckpt.training.model_state import FORMAT, model_optim_state_dict

# --------------------------------------------------------------------------- torch.chunk semantics


@pytest.mark.parametrize("size", range(0, 13))
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 5])
def test_chunk_range_follows_torch_chunk(size: int, chunks: int) -> None:
    pieces = torch.arange(size).chunk(chunks) if size else ()
    for i in range(chunks):
        a, b = chunk_range(size, chunks, i)
        expected = pieces[i].tolist() if i < len(pieces) else []  # torch.chunk may return fewer
        assert list(range(a, b)) == expected
        assert 0 <= a <= b <= size


def test_chunk_range_rejects_a_bad_index() -> None:
    with pytest.raises(InvalidShardedTensorError):
        chunk_range(4, 2, 2)


# --------------------------------------------------------------------------- local boxes


def test_fsdp_box_is_a_row_range_with_empty_last_shard() -> None:
    boxes = [local_box("w", (3, 7), [Shard(0)], (4,), (c,)) for c in range(4)]
    assert [(b.start[0], b.stop[0]) for b in boxes] == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert all(b.start[1] == 0 and b.stop[1] == 7 and b.replica_id == 0 for b in boxes)


def test_replicate_dims_give_replica_ids() -> None:
    # HSDP: replicate over mesh dim 0, shard over mesh dim 1
    box = local_box("w", (8, 2), [Replicate(), Shard(0)], (3, 2), (2, 1))
    assert (box.start, box.stop, box.replica_id) == ((4, 0), (8, 2), 2)
    box = local_box("w", (8,), [Replicate(), Replicate()], (2, 2), (1, 0))
    assert box.replica_id == (1, 0) and box.stop == (8,)


def test_nested_shards_of_one_dim_split_the_local_range_again() -> None:
    # DTensor applies mesh dims in order: dim 0 of size 10 -> [0, 5) / [5, 10), then chunks of those
    assert local_box("w", (10,), [Shard(0), Shard(0)], (2, 2), (1, 1)).start == (8,)
    assert local_box("w", (10,), [Shard(0), Shard(0)], (2, 2), (1, 1)).stop == (10,)
    assert local_box("w", (10,), [Shard(0), Shard(0)], (2, 2), (0, 1)).start == (3,)


def test_unsupported_placements_and_foreign_ranks_are_named() -> None:
    with pytest.raises(InvalidShardedTensorError, match="'w'.*Partial"):
        local_box("w", (4,), [Partial()], (2,), (0,))
    with pytest.raises(InvalidShardedTensorError, match="not part of the DTensor's device mesh"):
        local_box("w", (4,), [Shard(0)], (2,), None)


def test_uneven_split_of_a_later_dim_is_refused() -> None:
    box = local_box("w", (4, 7), [Shard(1)], (2,), (0,))
    with pytest.raises(InvalidShardedTensorError, match="dim 1 of size 7"):
        sharded_tensor_from_box("w", torch.zeros(box.local_shape), box)


def test_box_and_data_shapes_must_agree() -> None:
    box = local_box("w", (4, 2), [Shard(0)], (2,), (0,))
    with pytest.raises(InvalidShardedTensorError, match="local tensor has shape"):
        sharded_tensor_from_box("w", torch.zeros(3, 2), box)


def test_whole_tensor_is_a_plain_chunk_and_rows_are_a_flat_range() -> None:
    whole = sharded_tensor_from_box("w", torch.zeros(3, 7), local_box("w", (3, 7), [Shard(0)], (1,), (0,)))
    assert whole.flattened_range is None and whole.global_shape == (3, 7)
    rows = sharded_tensor_from_box("w", torch.zeros(2, 7), local_box("w", (7, 7), [Shard(0)], (4,), (1,)))
    assert rows.flattened_range == slice(14, 28) and rows.local_shape == (7, 7) and rows.data is not None
    assert rows.data.shape == (14,)


def test_plain_tensor_is_a_whole_replica() -> None:
    t = torch.randn(3, 2)
    sh = to_sharded_tensor("model.w", t)
    assert sh.key == "model.w" and sh.global_shape == (3, 2) and sh.replica_id == 0 and sh.data is not None
    assert sh.data.data_ptr() == t.data_ptr()


def _participant_shards(
    full: torch.Tensor, placements: Sequence[object], mesh: Sequence[int], empty: bool
) -> Dict[str, ShardedTensor]:
    """Every mesh coordinate's shard of ``full``, as one process's state dict."""
    out = {}
    coords: List[tuple] = [()]
    for n in mesh:
        coords = [c + (i,) for c in coords for i in range(n)]
    for c in coords:
        box = local_box("w", tuple(full.shape), placements, mesh, c)
        region = full[tuple(slice(a, b) for a, b in zip(box.start, box.stop))]
        data = torch.full_like(region, float("nan")) if empty else region.clone()
        out[f"w@{c}"] = sharded_tensor_from_box("w", data.contiguous(), box)
    return out


@pytest.mark.parametrize(
    "save_layout,load_layout",
    [
        (([Shard(0)], (4,)), ([Shard(0)], (3,))),
        (([Shard(0)], (2,)), ([Shard(0), Shard(1)], (3, 2))),  # FSDP2 x TP(dim 1)
        (([Replicate(), Shard(0)], (2, 4)), ([Shard(0)], (1,))),  # HSDP saved, whole loaded
        (([Shard(1)], (2,)), ([Shard(0), Shard(0)], (2, 3))),
    ],
)
def test_dtensor_layouts_reshard_through_a_checkpoint(save_layout, load_layout, tmp_path: Path) -> None:
    full = torch.randn(11, 6)
    dc.save(_participant_shards(full, *save_layout, empty=False), tmp_path / "c")
    request = _participant_shards(full, *load_layout, empty=True)
    loaded = dc.load(request, tmp_path / "c")
    placements, mesh = load_layout
    for name, sh in request.items():
        coord = tuple(int(v) for v in name.split("@")[1].strip("()").split(",") if v.strip())
        box = local_box("w", (11, 6), placements, mesh, coord)
        expected = full[tuple(slice(a, b) for a, b in zip(box.start, box.stop))].reshape(-1)
        assert bitwise_equal(loaded[name].reshape(-1), expected), name


# --------------------------------------------------------------------------- key scheme


def _trained(optimizer: str = "adamw"):
    model = make_model(seed=0)
    optim = make_optimizer(optimizer, model)
    train(model, optim, range(2))
    return model, optim


def test_model_keys_are_state_dict_names() -> None:
    model, optim = _trained()
    sd = model_optim_state_dict(model, optim)
    assert sd["format"] == FORMAT
    assert set(sd["model"]) == set(model.state_dict())
    assert all(sh.key == f"model.{name}" for name, sh in sd["model"].items())
    assert sd["model"]["1.num_batches_tracked"].dtype == torch.int64


def test_optimizer_state_is_keyed_by_fqn_not_position() -> None:
    model, optim = _trained("adam")
    osd = model_optim_state_dict(model, optim)["optim"]
    fqns = [n for n, _ in model.named_parameters()]
    assert osd["class"] == "Adam"
    assert set(osd["state"]) == set(fqns)
    sh = osd["state"]["0.weight"]["exp_avg"]
    assert isinstance(sh, ShardedTensor) and sh.key == "optim.state.0.weight.exp_avg" and sh.global_shape == (37, 13)
    assert sh.data is not None and sh.data.data_ptr() == optim.state[model[0].weight]["exp_avg"].data_ptr()
    step = osd["state"]["0.weight"]["step"]
    assert isinstance(step, torch.Tensor) and step.ndim == 0 and float(step) == 2.0  # a scalar: common state
    assert osd["tensor_state"]["0.weight"] == ["exp_avg", "exp_avg_sq"]
    groups = osd["param_groups"]
    assert [g["params"] for g in groups] == [
        ["0.weight", "3.weight", "5.weight"],
        ["0.bias", "1.weight", "1.bias", "3.bias", "5.bias"],
    ]
    assert groups[1]["betas"] == (0.8, 0.99) and groups[0]["betas"] == (0.9, 0.999)


def test_sgd_momentum_is_sharded_state() -> None:
    model, optim = _trained("sgd")
    osd = model_optim_state_dict(model, optim)["optim"]
    assert set(osd["state"]["5.bias"]) == {"momentum_buffer"}
    assert osd["tensor_state"]["5.bias"] == ["momentum_buffer"]


def test_optimizer_without_steps_has_no_state() -> None:
    model = make_model(seed=0)
    osd = model_optim_state_dict(model, make_optimizer("adam", model))["optim"]
    assert osd["state"] == {} and osd["tensor_state"] == {} and len(osd["param_groups"]) == 2


def test_foreign_optimizer_parameter_is_an_error() -> None:
    model = make_model(seed=0)
    stray = torch.nn.Parameter(torch.zeros(2))
    optim = torch.optim.SGD(list(model.parameters()) + [stray], lr=0.1)
    with pytest.raises(KeyMismatchError, match="parameter 8 of param group 0"):
        model_optim_state_dict(model, optim)


def test_non_tensor_model_state_is_refused() -> None:
    class WithExtra(torch.nn.Linear):
        def get_extra_state(self) -> object:
            return {"note": 1}

    with pytest.raises(CheckpointingException, match="'_extra_state'"):
        model_optim_state_dict(WithExtra(2, 2), None)


def test_local_box_dataclass_shape() -> None:
    box = LocalBox((5, 3), (1, 0), (4, 3), (2, 1), 0)
    assert box.local_shape == (3, 3)
