"""Small checkpoints of 4 virtual ranks for the conversion, inspection and command-line tests.

One process saves what 4 ranks would: tensor-parallel splits, distributed-optimizer flattened
ranges, stacked layers, bf16, a tensor of random bit patterns (NaN payloads included, so a
conversion that goes through floats would show), an empty tensor, a common state and
ShardedObjects. :func:`stored_tensors` reads every tensor back whole, for bit-exact comparisons.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Tuple, Union

import torch

import dist_ckpt as dc
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor
from dist_ckpt.testing.layouts import flat_shards, full_tensor, random_bits_tensor, tp_shards

COMMON = {"step": 1000, "config": {"hidden": 16, "name": "tiny"}}


def sample_tensors() -> Dict[str, torch.Tensor]:
    """The global tensors of the sample checkpoint, by key."""
    return {
        "embedding.weight": full_tensor("embedding.weight", (64, 16), torch.bfloat16),
        "decoder.fc2.weight": full_tensor("decoder.fc2.weight", (16, 32)),
        "optimizer.exp_avg": full_tensor("optimizer.exp_avg", (24, 10)),
        "layers": full_tensor("layers", (4, 6), torch.int32),
        "bits": random_bits_tensor(torch.float32, (8, 8), seed=3),
        "empty": torch.zeros(0, 5),
    }


def save_sample(path: Union[str, Path], backend: Tuple[str, int] = ("safetensors", 1)) -> Dict[str, torch.Tensor]:
    """Save the sample checkpoint at ``path`` with ``backend``; return its global tensors."""
    fulls = sample_tensors()
    sd: Dict[str, Any] = {}
    sd.update(tp_shards("embedding.weight", fulls["embedding.weight"], 0, 4, 0, 1))
    sd.update(tp_shards("decoder.fc2.weight", fulls["decoder.fc2.weight"], 1, 4, 0, 1))
    sd.update(flat_shards("optimizer.exp_avg", fulls["optimizer.exp_avg"], 0, 2, 2, 0, 1))
    for i in range(4):
        sd[f"L{i}"] = ShardedTensor.from_rank_offsets(
            "layers", fulls["layers"][i].clone(), (0, i, 4), prepend_axis_num=1
        )
    sd["bits"] = ShardedTensor.from_rank_offsets("bits", fulls["bits"].clone())
    sd["empty"] = ShardedTensor.from_rank_offsets("empty", fulls["empty"].clone())
    sd["rng"] = [ShardedObject("rng_state", {"rank": i, "seed": 100 + i}, (2,), (i,)) for i in range(2)]
    sd.update(COMMON)
    dc.save(sd, str(path), sharded_strategy=backend)
    return fulls


def stored_tensors(path: Union[str, Path]) -> Dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (or HF folder) at ``path``, whole."""
    return dc.unshard(str(path))
