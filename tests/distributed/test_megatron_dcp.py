"""Megatron-Core's torch_dist save path at 2 and 4 ranks, called as its TorchDistSaveShardedStrategy calls it:
translate (``mcore_to_pyt_state_dict``), plan (``save_state_dict_async_plan`` with ``MCoreSavePlanner`` and
``FileSystemWriterAsync``), write in dist_ckpt's background writer process (``AsyncCallsQueue``), finalize
(``save_state_dict_async_finalize``), then load in another layout with dist_ckpt's torch_dist loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dist_ckpt as dc
from dist_ckpt.asynchronous.queue import AsyncCallsQueue, AsyncRequest
from dist_ckpt.backends.torch_dist.load import TorchDistLoadShardedStrategy
from dist_ckpt.model.sharded import ShardedBase, ShardedObject, ShardedTensor
from dist_ckpt.strategies.filesystem_async import FileSystemWriterAsync
from dist_ckpt.strategies.state_dict_saver import (
    CheckpointWriteError,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
)
from dist_ckpt.strategies.torch import MCoreSavePlanner, mcore_to_pyt_state_dict, sharded_tensor_to_torch_sharded_tensor

from .helpers import assert_on_all_ranks, raises_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)


def _full() -> torch.Tensor:
    return torch.arange(4 * world() * 6, dtype=torch.float32).reshape(4 * world(), 6)


def _rows_state() -> Dict[str, List[ShardedBase]]:
    """Rows split over the ranks; one ShardedObject per rank."""
    rows = _full()[4 * rank() : 4 * rank() + 4].clone()
    return {
        "w": [ShardedTensor.from_rank_offsets("w", rows, (0, rank(), world()))],
        f"rng/shard_{rank()}_{world()}": [ShardedObject("rng", {"rank": rank()}, (world(),), (rank(),))],
    }


def _plan(path: Path, state: Dict[str, List[ShardedBase]]) -> Any:
    writer = FileSystemWriterAsync(path, thread_count=2)
    planner = MCoreSavePlanner(flatten_state_dict=False)
    (finalize_args, *_) = save_state_dict_async_plan(mcore_to_pyt_state_dict(state), writer, None, 0, planner=planner)
    return writer, finalize_args


def _load_columns(path: Path) -> Dict[str, Any]:
    """Columns split over the ranks (another layout than the save's rows)."""
    cols = 6 // 2
    part = rank() % 2
    requests = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(4 * world(), cols), (1, part, 2), replica_id=rank() // 2),
        "rng": ShardedObject("rng", None, (world(),), ((rank() + 1) % world(),)),
    }
    return TorchDistLoadShardedStrategy().load(requests, dc.storage.open_storage(path))


def test_async_plan_background_write_finalize_then_resharded_load(shared_tmp_path: Path) -> None:
    writer, finalize_args = _plan(shared_tmp_path, _rows_state())
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    request = AsyncRequest(
        save_fn, tuple(save_args), [lambda: save_state_dict_async_finalize(*finalize_args)], preload_fn=preload_fn
    )
    queue = AsyncCallsQueue()
    try:
        queue.schedule_async_request(request)
        finalized = queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    loaded = _load_columns(shared_tmp_path)
    part = rank() % 2
    ok = finalized == [0] and torch.equal(loaded["w"], _full()[:, 3 * part : 3 * part + 3])
    ok = ok and loaded["rng"] == {"rank": (rank() + 1) % world()}
    assert_on_all_ranks(ok, f"finalized {finalized}, loaded {loaded}")


def test_a_write_missing_on_one_rank_fails_finalization_on_every_rank(shared_tmp_path: Path) -> None:
    writer, finalize_args = _plan(shared_tmp_path, _rows_state())
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    if rank() != 1:  # rank 1's background write never ran
        save_fn(*save_args[:1], preload_fn(), *save_args[2:])
    error = raises_on_all_ranks(
        CheckpointWriteError, lambda: save_state_dict_async_finalize(*finalize_args), match="the write did not finish"
    )
    ok = "rank 1: " in str(error) and "rank 0: " not in str(error) and list(getattr(error, "failures")) == [1]
    assert_on_all_ranks(ok and isinstance(error, dcp.CheckpointException), str(error))
    assert_on_all_ranks(not (shared_tmp_path / ".metadata").exists(), "committed")


def test_pytorch_sharded_tensors_with_prepended_axes_save_as_torch_dist_chunks(shared_tmp_path: Path) -> None:
    """sharded_tensor_to_torch_sharded_tensor: Megatron-Core's pre-0.14 value for a layer-stacked tensor."""
    layer = torch.full((2, 3), float(rank()))
    sh = ShardedTensor.from_rank_offsets("layers.w", layer, (0, rank(), world()), prepend_axis_num=1)
    torch_sh = sharded_tensor_to_torch_sharded_tensor([sh])
    ok = tuple(torch_sh.size()) == (world(), 2, 3) and torch_sh.key == "layers.w"  # type: ignore[attr-defined]
    ok = ok and torch.equal(torch_sh.local_shards()[0].tensor, layer.view(1, 2, 3))
    dcp.save(
        {"layers.w": torch_sh},
        storage_writer=FileSystemWriterAsync(shared_tmp_path),
        planner=MCoreSavePlanner(flatten_state_dict=False),
    )

    other = (rank() + 1) % world()
    request = ShardedTensor.from_rank_offsets("layers.w", torch.zeros(2, 3), (0, other, world()), prepend_axis_num=1)
    loaded = TorchDistLoadShardedStrategy().load({"w": request}, dc.storage.open_storage(shared_tmp_path))
    assert_on_all_ranks(ok and torch.equal(loaded["w"], torch.full((2, 3), float(other))), f"loaded {loaded}")
