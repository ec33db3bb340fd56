"""dist_ckpt -> torch_dist -> megatron-core: a checkpoint saved by dist_ckpt at 2 ranks (TP=2, stacked
layers, ShardedObjects, common state) loads with megatron-core's own ``dist_checkpointing.load`` --
saved synchronously, saved asynchronously, and converted there from another backend (a team
leaving dist_ckpt: ``dist-ckpt convert --to torch_dist`` of its safetensors checkpoint).

megatron-core runs in a subprocess (``megatron_load.py``): importing it registers extra classes
as safe for ``torch.load(weights_only=True)`` process-wide, which would mask dist_ckpt's own safety
checks in the tests that follow. The interpreter is this one when megatron-core is installed here
(the ``test`` extra pins megatron-core 0.16.1), else ``/opt/mcore-venv`` when it exists; otherwise
the test is skipped (the golden fixtures still check the format against what megatron-core wrote).
"""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Optional

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.asynchronous.queue import AsyncCallsQueue
from dist_ckpt.testing import spawn_ranks
from dist_ckpt.tools.convert import convert
from tests.deadlines import scaled

SCRIPT = Path(__file__).with_name("megatron_load.py")
VENV_PYTHON = Path("/opt/mcore-venv/bin/python")
LAYERS, TP = 4, 2


def _megatron_python() -> Optional[str]:
    if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
        return sys.executable
    return str(VENV_PYTHON) if VENV_PYTHON.exists() else None


def _full(key: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float64) * 0.25 + len(key)).to(dtype).reshape(shape)


def _save_rank(rank: int, world: int, ckpt: str, backend: str = "torch_dist", asynchronous: bool = False) -> None:
    emb = _full("emb", (8, 6), torch.bfloat16)
    qkv = _full("layers.qkv", (LAYERS, 12, 6), torch.float32)
    sd: Dict[str, Any] = {
        "emb": dc.ShardedTensor.from_rank_offsets("emb", emb.chunk(world)[rank].clone(), (0, rank, world)),
        "norm": dc.ShardedTensor.from_rank_offsets("norm", torch.ones(6), replica_id=rank),
        "rng": dc.ShardedObject("rng_state", {"seed": rank, "extra": io.BytesIO(b"te")}, (world,), (rank,)),
        "opt": dc.ShardedObject("optimizer", {"param_groups": [{"lr": 0.1}]}, (1,), (0,), replica_id=rank),
        "iteration": 3,
        "args": {"tensor_model_parallel_size": world},
    }
    for layer in range(LAYERS):  # stacked layers, each split over TP on its rows
        local = qkv[layer].chunk(world)[rank].clone()
        sd[f"qkv{layer}"] = dc.ShardedTensor.from_rank_offsets(
            "layers.qkv", local, (0, layer, LAYERS), (1, rank, world), prepend_axis_num=1
        )
    if not asynchronous:
        dc.save(sd, ckpt, sharded_strategy=(backend, 1))
        return
    queue = AsyncCallsQueue(persistent=False)
    request = dc.save(sd, ckpt, sharded_strategy=(backend, 1), async_sharded_save=True)
    assert request is not None
    queue.schedule_async_request(request)
    queue.close()


def test_megatron_core_loads_what_dist_ckpt_saved(tmp_path: Path) -> None:
    python = _megatron_python()
    if python is None:
        pytest.skip("megatron-core is not installed here (pip install 'dist_ckpt[test]') and /opt/mcore-venv is absent")
    ckpts = {"sync": tmp_path / "sync", "async": tmp_path / "async", "converted": tmp_path / "converted"}
    spawn_ranks(_save_rank, TP, str(ckpts["sync"]), timeout_s=scaled(300))
    spawn_ranks(_save_rank, TP, str(ckpts["async"]), "torch_dist", True, timeout_s=scaled(300))
    spawn_ranks(_save_rank, TP, str(tmp_path / "safetensors"), "safetensors", timeout_s=scaled(300))
    convert(tmp_path / "safetensors", ckpts["converted"], to="torch_dist")
    spec = {
        "tensors": {"emb": [[8, 6], "bfloat16"], "norm": [[6], "float32"], "layers.qkv": [[LAYERS, 12, 6], "float32"]},
        "objects": [["rng_state", [TP], [r]] for r in range(TP)] + [["optimizer", [1], [0]]],
    }
    out = tmp_path / "loaded.pt"
    done = subprocess.run(
        [python, "-W", "ignore", str(SCRIPT), json.dumps(spec), str(out), *map(str, ckpts.values())],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.serialization.safe_globals([io.BytesIO]):
        results = torch.load(out, weights_only=True)
    for name, ckpt in ckpts.items():
        _check(results[str(ckpt)], name)


def _check(loaded: Dict[str, Any], name: str) -> None:
    assert torch.equal(loaded["tensors"]["emb"], _full("emb", (8, 6), torch.bfloat16)), name
    assert torch.equal(loaded["tensors"]["norm"], torch.ones(6)), name
    assert torch.equal(loaded["tensors"]["layers.qkv"], _full("layers.qkv", (LAYERS, 12, 6), torch.float32)), name
    for r in range(TP):
        value = loaded["objects"][f"object:rng_state:[{r}]"]
        assert value["seed"] == r and value["extra"].getvalue() == b"te", name
    assert loaded["objects"]["object:optimizer:[0]"] == {"param_groups": [{"lr": 0.1}]}, name
    assert loaded["common"] == {"iteration": 3, "args": {"tensor_model_parallel_size": TP}}, name
    assert loaded["metadata"] == {"emb": [8, 6], "norm": [6], "layers.qkv": [LAYERS, 12, 6]}, name
