"""Megatron-Core's pre-0.16 resharding of flattened N-D tensors (``strategies.resharding`` and
``strategies.torch.get_reformulation_metadata``), used as its loaders did: read the stored shapes,
reformulate the request, load, restore -- on megatron-core 0.15.3's distributed-optimizer fixture,
asking for flattened ranges of chunks of another TP layout."""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.errors import KeyMismatchError
from dist_ckpt.strategies.resharding import (
    TensorReformulationMetadata,
    apply_nd_flattened_tensors_reformulation,
    is_nd_flattened_tensor,
    nd_flattened_tensor_reformulated_global_shape,
    restore_nd_flattened_tensors_formulation,
)
from dist_ckpt.strategies.torch import get_reformulation_metadata
from tests.golden.torch_dist import expected as E
from tests.torch_dist_golden import fixture_dir

pytestmark = pytest.mark.filterwarnings("ignore")

FIXTURE = "flat_legacy_mcore015"
FC1 = "optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight"  # [16, 8], saved TP=2 on axis 0
QKV = "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight"  # [2, 24, 8] stacked, TP axis 1


def _requests() -> Dict[str, Any]:
    return {
        # columns 4..8 (TP=2 on axis 1 instead of axis 0), elements [5, 50) of that chunk
        "fc1": dc.ShardedTensor.from_rank_offsets_flat(
            FC1, torch.zeros(45), (16, 4), (1, 1, 2), flattened_range=slice(5, 50)
        ),
        # layer 1, rows 16..24 (TP=3 instead of 2), elements [10, 60)
        "qkv": dc.ShardedTensor.from_rank_offsets_flat(
            QKV, torch.zeros(50), (8, 8), (0, 1, 2), (1, 2, 3), prepend_axis_num=1, flattened_range=slice(10, 60)
        ),
    }


def test_reformulate_load_restore_gives_flattened_ranges_of_another_layout() -> None:
    requests = _requests()
    metadata = get_reformulation_metadata(requests, fixture_dir(FIXTURE))
    assert metadata == {
        FC1: TensorReformulationMetadata((16, 8), (2, 1, 64)),
        QKV: TensorReformulationMetadata((2, 24, 8), (2, 2, 1, 96)),
    }
    request, restore = apply_nd_flattened_tensors_reformulation(requests, metadata)
    assert [p.global_offset for p in request["fc1"]] == [(0, 0), (8, 0)]  # both stored row chunks
    assert [p.global_offset for p in request["qkv"]] == [(1, 12, 0)]  # one stored chunk covers rows 16..24
    partial = dc.load(request, fixture_dir(FIXTURE), validate_access_integrity=False)  # one rank's part
    loaded = restore_nd_flattened_tensors_formulation(partial, restore)

    fc1 = E.full_tensor(FC1, (16, 8), torch.float32)
    qkv = E.full_tensor(QKV, (2, 24, 8), torch.float32)
    assert torch.equal(loaded["fc1"], fc1[:, 4:8].flatten()[5:50])
    assert torch.equal(loaded["qkv"], qkv[1, 16:24].flatten()[10:60])


def test_a_request_in_the_stored_layout_is_left_as_it_is() -> None:
    same = dc.ShardedTensor.from_rank_offsets_flat(
        FC1, torch.zeros(10), (8, 8), (0, 1, 2), flattened_range=slice(0, 10)
    )
    assert is_nd_flattened_tensor(same) and nd_flattened_tensor_reformulated_global_shape(same) == (2, 1, 64)
    metadata = get_reformulation_metadata({"x": same}, fixture_dir(FIXTURE))
    request, restore = apply_nd_flattened_tensors_reformulation({"x": same}, metadata)
    assert request["x"] is same and restore == {}


def test_a_flattened_nd_tensor_without_metadata_is_refused_a_1d_one_is_left() -> None:
    requests = _requests()
    with pytest.raises(KeyMismatchError, match="get_reformulation_metadata"):
        apply_nd_flattened_tensors_reformulation(requests, {})
    flat_1d = dc.ShardedTensor.from_rank_offsets_flat("b", torch.zeros(2), (4,), flattened_range=slice(0, 2))
    assert apply_nd_flattened_tensors_reformulation({"b": flat_1d}, {})[0]["b"] is flat_1d
    with pytest.raises(KeyMismatchError, match="records no original shape"):
        get_reformulation_metadata(
            {"w": dc.ShardedTensor.from_rank_offsets_flat("nope", torch.zeros(2), (2, 2), flattened_range=slice(0, 2))},
            fixture_dir(FIXTURE),
        )
