"""The tiny state every golden checkpoint holds, and the values it must load back as.

Golden checkpoints (``tests/golden/<format>/``) are committed once, by the dist_ckpt version that
introduced a format version, and never rewritten: every later version must still load them.
Each is saved by 2 ranks (``make_golden.py``) so that it holds several files per backend, a
row-split, a column-split, a replicated, a flattened (distributed-optimizer) and a 0-d tensor,
per-rank ShardedObjects and common state.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from dist_ckpt.model.sharded import ShardedObject, ShardedStateDict, ShardedTensor

WORLD = 2
COMMON = {"step": 7, "name": "golden", "lr": 0.5}


def full_tensors() -> Dict[str, torch.Tensor]:
    """Every stored tensor, whole, by key (pure function: the expected content)."""
    return {
        "layer.w": (torch.arange(24, dtype=torch.float32).reshape(4, 6) * 0.25 - 2.0),
        "layer.b": torch.linspace(-1.0, 1.0, 6).to(torch.bfloat16),
        "emb": (torch.arange(12, dtype=torch.int64).reshape(3, 4) * 1000003),
        "opt.exp_avg": (torch.arange(24, dtype=torch.float32).reshape(4, 6) * -0.125),
        "scalar": torch.tensor(3.141592653589793, dtype=torch.float64),
    }


def objects() -> Dict[str, Any]:
    """ShardedObject values by unique key."""
    return {f"rng/shard_{r}_{WORLD}": {"seed": 100 + r, "state": [r, r + 1]} for r in range(WORLD)}


def sharded_state(rank: int, world: int = WORLD) -> ShardedStateDict:
    """What rank ``rank`` of ``world`` saves."""
    full = full_tensors()
    sd: ShardedStateDict = {
        "layer.w": ShardedTensor.from_rank_offsets(
            "layer.w", full["layer.w"].chunk(world, 0)[rank].clone(), (0, rank, world)
        ),
        "layer.b": ShardedTensor.from_rank_offsets("layer.b", full["layer.b"].clone(), replica_id=rank),
        "emb": ShardedTensor.from_rank_offsets("emb", full["emb"].chunk(world, 1)[rank].clone(), (1, rank, world)),
        "scalar": ShardedTensor.from_rank_offsets("scalar", full["scalar"].clone(), replica_id=rank),
        "rng": ShardedObject("rng", objects()[f"rng/shard_{rank}_{world}"], (world,), (rank,)),
    }
    flat = full["opt.exp_avg"].flatten()
    per = flat.numel() // world
    rng = slice(rank * per, (rank + 1) * per)
    sd["opt.exp_avg"] = ShardedTensor.from_rank_offsets_flat(
        "opt.exp_avg", flat[rng].clone(), (4, 6), flattened_range=rng
    )
    sd.update(COMMON)
    return sd


def full_request() -> ShardedStateDict:
    """A one-process request for every tensor whole and every ShardedObject."""
    full = full_tensors()
    sd: ShardedStateDict = {key: ShardedTensor.from_rank_offsets(key, torch.zeros_like(t)) for key, t in full.items()}
    for r in range(WORLD):
        sd[f"rng{r}"] = ShardedObject("rng", None, (WORLD,), (r,))
    return sd
