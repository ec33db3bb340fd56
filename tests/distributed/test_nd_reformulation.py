"""Megatron-Core's pre-0.16 N-D reformulation at 2 and 4 ranks: the ranks together ask for every element of
a distributed-optimizer tensor of megatron-core 0.15.3's fixture in another layout (TP on the other axis,
flattened ranges cut elsewhere), through get_reformulation_metadata, apply, dc.load and restore."""

from __future__ import annotations

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.strategies.resharding import (
    apply_nd_flattened_tensors_reformulation,
    restore_nd_flattened_tensors_formulation,
)
from dist_ckpt.strategies.torch import get_reformulation_metadata
from tests.golden.torch_dist import expected as E
from tests.torch_dist_golden import fixture_dir

from .helpers import assert_on_all_ranks, rank, world

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.filterwarnings("ignore")]

FC1 = "optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight"  # [16, 8], saved TP=2 on axis 0


def test_every_element_in_another_layout() -> None:
    column, part, parts = rank() % 2, rank() // 2, world() // 2
    cuts = [0] + [25 + 39 * i // parts for i in range(1, parts)] + [64] if parts > 1 else [0, 64]
    start, stop = cuts[part], cuts[part + 1]
    request = {  # together, the ranks' requests cover the tensor exactly once
        "m": dc.ShardedTensor.from_rank_offsets_flat(
            FC1, torch.zeros(stop - start), (16, 4), (1, column, 2), flattened_range=slice(start, stop)
        )
    }
    reformulated, restore = apply_nd_flattened_tensors_reformulation(
        request, get_reformulation_metadata(request, fixture_dir("flat_legacy_mcore015"))
    )
    # the ranks' reformulated requests overlap (several ask for one stored chunk): Megatron-Core checked the
    # original request before reformulating, inside its load strategy
    partial = dc.load(reformulated, fixture_dir("flat_legacy_mcore015"), validate_access_integrity=False)
    loaded = restore_nd_flattened_tensors_formulation(partial, restore)
    expected = E.full_tensor(FC1, (16, 8), torch.float32)[:, 4 * column : 4 * column + 4].flatten()[start:stop]
    assert_on_all_ranks(torch.equal(loaded["m"], expected), f"rank {rank()}: {loaded['m']} != {expected}")
