"""A tiny training run whose results are bit-identical at any world size, plain or FSDP2.

Used to test that a model + optimizer checkpoint continues training exactly: train N steps,
save, load in another layout, train M more, and compare every parameter and optimizer state
bit-for-bit with N + M uninterrupted steps.

Why the numerics do not depend on the layout:

* Every rank computes the loss of the same batch on the whole (all-gathered) parameters, so the
  local gradient is the same on every rank, equal to the single-process one.
* FSDP2 sums gradients over ranks (reduce-scatter, in an unspecified order) and divides by the
  world size W. `exact_loss_scale()` makes rank 0's loss count W times and the others' zero
  times: the sum is ``W * g + 0 + ... + 0`` (exact in any order) and the division by a power of
  two gives back ``g`` exactly, for W in {1, 2, 4, ...}.
* Adam, AdamW and SGD update each element from that element alone, so a shard's update equals
  the same elements of the whole tensor's update.
* ``torch.set_num_threads(1)`` everywhere, so kernels do not split work differently.

A plain (unsharded) model on several ranks needs no communication: every rank computes the
same update (use a loss scale of 1).

Example:

```python
model, optim = make_model(seed=0), None
optim = make_optimizer("adamw", model)
train(model, optim, range(0, 3))
state = full_state(model, optim)      # {"model.0.weight": ndarray, "optim.0.weight.exp_avg": ...}
```
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import numpy as np
import torch
from torch import nn

OPTIMIZERS = ("adam", "adamw", "sgd")

#: one comparable snapshot: checkpoint-like keys -> arrays (and hyperparameters as strings)
State = Dict[str, Any]


def make_model(seed: int) -> nn.Sequential:
    """Linear layers of awkward sizes (uneven and empty FSDP2 shards at 2 and 4 ranks) and a
    BatchNorm (float buffers and an int64 one)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(13, 37), nn.BatchNorm1d(37), nn.Tanh(), nn.Linear(37, 11), nn.Tanh(), nn.Linear(11, 3)
    )


def make_optimizer(name: str, model: nn.Module, lr_scale: float = 1.0) -> torch.optim.Optimizer:
    """``name`` in `OPTIMIZERS`, with two param groups (weights; biases and norms) of
    different hyperparameters. ``lr_scale`` != 1 builds a wrongly configured optimizer, to
    check that loading restores the saved hyperparameters."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.ndim > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.ndim > 1)]
    lr = 1e-2 * lr_scale
    groups: List[Dict[str, Any]] = [{"params": decay}, {"params": rest, "lr": 3e-2 * lr_scale}]
    if name == "adam":
        groups[1]["betas"] = (0.8, 0.99)
        return torch.optim.Adam(groups, lr=lr)
    if name == "adamw":
        groups[1]["weight_decay"] = 0.0
        return torch.optim.AdamW(groups, lr=lr, weight_decay=0.1)
    if name == "sgd":
        groups[1]["nesterov"] = False
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


def batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The batch of training step ``step`` (the same on every rank)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 13, generator=gen), torch.randn(8, 3, generator=gen)


def exact_loss_scale(rank: int, world_size: int) -> float:
    """Loss multiplier under FSDP2 that makes the averaged gradient exact (module docstring)."""
    if world_size & (world_size - 1):
        raise ValueError(f"exact FSDP2 gradients need a power-of-two world size, got {world_size}")
    return float(world_size) if rank == 0 else 0.0


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: Iterable[int], loss_scale: float = 1.0) -> None:
    """One optimizer step per batch of ``steps``."""
    torch.set_num_threads(1)
    model.train()
    for step in steps:
        x, y = batch(step)
        optim.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        (loss * loss_scale).backward()
        optim.step()


def shard_with_fsdp2(model: nn.Module) -> nn.Module:
    """``fully_shard`` every Linear and the root over a 1-D CPU mesh of all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dist_ckpt.collectives.distributed import get_world_size

    mesh = init_device_mesh("cpu", (get_world_size(),))
    for layer in model.children():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(t: torch.Tensor) -> np.ndarray:
    from torch.distributed.tensor import DTensor

    whole = t.full_tensor() if isinstance(t, DTensor) else t
    return whole.detach().cpu().clone().numpy()


def full_state(model: nn.Module, optim: Optional[torch.optim.Optimizer]) -> State:
    """Whole parameters, buffers and optimizer state as numpy arrays, keyed by name, plus the
    param groups' hyperparameters. Collective under FSDP2 (``full_tensor``)."""
    state: State = {f"model.{k}": _full(v) for k, v in model.state_dict().items()}
    if optim is None:
        return state
    names = {id(p): n for n, p in model.named_parameters()}
    for g, group in enumerate(optim.param_groups):
        state[f"group.{g}"] = repr(sorted((k, v) for k, v in group.items() if k != "params"))
        for p in group["params"]:
            for key, value in optim.state.get(p, {}).items():
                state[f"optim.{names[id(p)]}.{key}"] = _full(value) if isinstance(value, torch.Tensor) else value
    return state


def state_differences(expected: Mapping[str, Any], got: Mapping[str, Any]) -> List[str]:
    """Keys whose values differ (bit-exactly for arrays), or that only one side has."""
    diffs = sorted(set(expected) ^ set(got))
    for key in sorted(set(expected) & set(got)):
        a, b = expected[key], got[key]
        if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
            same = a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        else:
            same = a == b
        if not same:
            diffs.append(key)
    return diffs


def reference_run(optimizer: str, steps: int) -> State:
    """``steps`` uninterrupted steps of a plain model in this process."""
    model = make_model(seed=0)
    optim = make_optimizer(optimizer, model)
    train(model, optim, range(steps))
    return full_state(model, optim)


def max_abs_difference(expected: Mapping[str, Any], got: Mapping[str, Any]) -> float:
    """Largest elementwise difference over the float arrays both sides have (for messages)."""
    worst = 0.0
    for key in set(expected) & set(got):
        a, b = expected[key], got[key]
        if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape and a.dtype.kind == "f":
            diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))
            worst = diff if math.isnan(diff) else max(worst, diff)
    return worst
