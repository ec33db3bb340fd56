"""An async save persists exactly the state at the moment it was scheduled (issue 35 item 3).

Every tensor -- parameters, optimizer moments, Adam's ``step`` (a CPU tensor: NVRx found CPU
tensors handed to the writer without a copy), common state and ShardedObjects -- is changed in
place right after the save is scheduled, and training goes on for several steps while the writer
process sits at a gate (`writer_gate.GatedQueue`), so it has read nothing yet. The checkpoint must
equal the state at schedule time bit for bit, for every backend and for the one-call API.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterator, Tuple

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.registry import StrategyAction, get_alternative_strategy
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor
from dist_ckpt.testing.training import full_state, make_model, make_optimizer, state_differences, train
from dist_ckpt.training.checkpointer import Checkpointer
from dist_ckpt.training.model_optim import async_save_model_and_optim_state, load_model_and_optim_state
from tests.unit.asynchronous.writer_gate import GatedQueue

STEPS_WHILE_WRITING = 3


@pytest.fixture(scope="module")
def queue(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatedQueue]:
    q = GatedQueue(tmp_path_factory.mktemp("gate"))
    yield q
    q.close()


@pytest.fixture()
def gated(queue: GatedQueue) -> Iterator[GatedQueue]:
    """The module's queue with its gate closed for this test."""
    queue.gate.unlink(missing_ok=True)
    queue.reached.unlink(missing_ok=True)
    yield queue
    queue.open_gate()  # a failing test must not leave the writer waiting
    queue.maybe_finalize_async_calls(blocking=True)


def _strategy(backend: str) -> Any:
    if backend == "tensorstore":
        pytest.importorskip("tensorstore")
        return get_alternative_strategy(StrategyAction.SAVE_SHARDED, "zarr", 1, "tensorstore")
    if backend == "zarr":
        pytest.importorskip("zarr")
        return ("zarr", 1)
    return (backend, 1)


def _state() -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """A sharded state dict of every kind of entry, and a deep copy of its values."""
    gen = torch.Generator().manual_seed(3)
    sd: Dict[str, Any] = {
        "w": ShardedTensor.from_rank_offsets("w", torch.randn(32, 8, generator=gen)),
        "b": ShardedTensor.from_rank_offsets("b", torch.randn(8, generator=gen).to(torch.bfloat16)),
        "exp_avg": ShardedTensor.from_rank_offsets("exp_avg", torch.randn(32, 8, generator=gen)),
        "opt_step": ShardedTensor.from_rank_offsets("opt_step", torch.tensor([5.0])),
        "obj": ShardedObject("obj", {"t": torch.arange(6), "l": [1, 2]}, (1,), (0,), replica_id=0),
        "common": {"step": torch.tensor(5.0), "rng": torch.arange(4), "epoch": [5]},
    }
    return sd, _values(sd)


def _values(sd: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "w": sd["w"].data.clone(),
        "b": sd["b"].data.clone(),
        "exp_avg": sd["exp_avg"].data.clone(),
        "opt_step": sd["opt_step"].data.clone(),
        "obj.t": sd["obj"].data["t"].clone(),
        "obj.l": list(sd["obj"].data["l"]),
        "common.step": sd["common"]["step"].clone(),
        "common.rng": sd["common"]["rng"].clone(),
        "common.epoch": list(sd["common"]["epoch"]),
    }


def _train_in_place(sd: Dict[str, Any]) -> None:
    """What training does to the state between the save being scheduled and written: in place."""
    sd["w"].data.mul_(-3.0).add_(1.0)
    sd["b"].data.add_(1.0)
    sd["exp_avg"].data.mul_(0.9).add_(0.5)
    sd["opt_step"].data.add_(1.0)
    sd["obj"].data["t"].add_(10)
    sd["obj"].data["l"].append(3)
    sd["common"]["step"].add_(1.0)
    sd["common"]["rng"].add_(7)
    sd["common"]["epoch"][0] += 1


def _template() -> Dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.empty(32, 8)),
        "b": ShardedTensor.from_rank_offsets("b", torch.empty(8, dtype=torch.bfloat16)),
        "exp_avg": ShardedTensor.from_rank_offsets("exp_avg", torch.empty(32, 8)),
        "opt_step": ShardedTensor.from_rank_offsets("opt_step", torch.empty(1)),
        "obj": ShardedObject("obj", None, (1,), (0,), replica_id=0),
    }


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_holds(path: Path, expected: Dict[str, Any]) -> None:
    loaded = dc.load(_template(), path)
    for key in ("w", "b", "exp_avg", "opt_step"):
        assert _bits(loaded[key]) == _bits(expected[key]), key
    assert _bits(loaded["obj"]["t"]) == _bits(expected["obj.t"]) and loaded["obj"]["l"] == expected["obj.l"]
    common = dc.load_common_state_dict(path)["common"]
    assert _bits(common["step"]) == _bits(expected["common.step"])
    assert _bits(common["rng"]) == _bits(expected["common.rng"])
    assert common["epoch"] == expected["common.epoch"]


def _train_while_writing(queue: GatedQueue, sd: Dict[str, Any], path: Path) -> None:
    queue.wait_until_writer_waits()  # the writer runs and has read no byte of the snapshot
    for _ in range(STEPS_WHILE_WRITING):
        _train_in_place(sd)
        assert queue.maybe_finalize_async_calls(blocking=False) == []
    assert not (path / "metadata.json").exists()
    queue.open_gate()
    queue.maybe_finalize_async_calls(blocking=True)


#: zarr has no async save strategy yet (either engine): an async save of it is refused at the call
#: (IncompatibleStrategyError). Strict, so the test fails once zarr saves asynchronously -- then drop the mark.
_NO_ASYNC_ZARR = pytest.mark.xfail(reason="zarr has no AsyncSaveShardedStrategy yet (issue 35 item 1)", strict=True)


@pytest.mark.parametrize(
    "backend",
    [
        "safetensors",
        pytest.param("zarr", marks=_NO_ASYNC_ZARR),
        pytest.param("tensorstore", marks=_NO_ASYNC_ZARR),
        "torch_dist",
    ],
)
def test_every_backend_persists_the_state_at_schedule_time(tmp_path: Path, gated: GatedQueue, backend: str) -> None:
    sd, expected = _state()
    request = dc.save(sd, tmp_path / "c", _strategy(backend), async_sharded_save=True)
    assert request is not None
    gated.schedule_async_request(request)
    _train_while_writing(gated, sd, tmp_path / "c")
    _assert_holds(tmp_path / "c", expected)


def test_dc_async_save_persists_the_state_at_schedule_time(tmp_path: Path, gated: GatedQueue) -> None:
    sd, expected = _state()
    future = dc.async_save(sd, tmp_path / "c", queue=gated)
    gated.wait_until_writer_waits()
    for _ in range(STEPS_WHILE_WRITING):
        _train_in_place(sd)
    assert not future.done()
    gated.open_gate()
    future.result()
    _assert_holds(tmp_path / "c", expected)


def _adam_state() -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model(seed=0)
    optim = make_optimizer("adam", model)
    train(model, optim, range(2))
    steps = [s["step"] for s in optim.state.values()]
    assert steps and all(isinstance(s, torch.Tensor) and s.device.type == "cpu" for s in steps)  # the NVRx case
    return model, optim


def _assert_resumes(path: Path, expected: Dict[str, Any]) -> None:
    model = make_model(seed=1)
    optim = make_optimizer("adam", model, lr_scale=5.0)
    load_model_and_optim_state(path, model, optim)
    assert state_differences(expected, full_state(model, optim)) == []


def test_async_save_model_and_optim_state_persists_the_state_at_schedule_time(
    tmp_path: Path, gated: GatedQueue
) -> None:
    model, optim = _adam_state()
    request = async_save_model_and_optim_state(tmp_path / "c", model, optim)
    expected = full_state(model, optim)
    gated.schedule_async_request(request)
    gated.wait_until_writer_waits()
    train(model, optim, range(2, 2 + STEPS_WHILE_WRITING))  # moments, step and weights change in place
    assert state_differences(expected, full_state(model, optim)) != []
    gated.open_gate()
    gated.maybe_finalize_async_calls(blocking=True)
    _assert_resumes(tmp_path / "c", expected)


def test_checkpointer_async_save_persists_the_state_at_schedule_time(tmp_path: Path, gated: GatedQueue) -> None:
    sd, expected = _state()
    ckpt = Checkpointer()
    ckpt._pending._queue = gated  # its own queue, gated (the queue is created on first use otherwise)
    try:
        flat = {"w": sd["w"].data, "b": sd["b"].data, "step": sd["opt_step"].data}
        ckpt.save(tmp_path / "c", flat, async_save=True)
        gated.wait_until_writer_waits()
        for _ in range(STEPS_WHILE_WRITING):
            _train_in_place(sd)
        gated.open_gate()
        assert ckpt.maybe_finalize_async_saves(blocking=True) == [str(tmp_path / "c")]
    finally:
        ckpt._pending._queue = None
    loaded = {"w": torch.empty(32, 8), "b": torch.empty(8, dtype=torch.bfloat16), "step": torch.empty(1)}
    ckpt.load(tmp_path / "c", loaded)
    for key, name in (("w", "w"), ("b", "b"), ("step", "opt_step")):
        assert _bits(loaded[key]) == _bits(expected[name]), key
