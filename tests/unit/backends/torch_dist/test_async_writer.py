"""Megatron-Core's split DCP save at its paths (``strategies.filesystem_async``, ``strategies.state_dict_saver``),
in one process, called as Megatron-Core's TorchDistSaveShardedStrategy.async_save calls it: plan with
``save_state_dict_async_plan``, write with the writer's save function, finalize with
``save_state_dict_async_finalize``, then load back. The background process and 2 ranks are in
tests/distributed/test_megatron_dcp.py.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

import dist_ckpt as dc
from dist_ckpt.asynchronous.queue import AsyncRequest
from dist_ckpt.backends.torch_dist.async_writer import split_by_size_and_type
from dist_ckpt.backends.torch_dist.load import TorchDistLoadShardedStrategy
from dist_ckpt.backends.torch_dist.metadata import read_metadata
from dist_ckpt.errors import ArgumentTypeError, CheckpointingException
from dist_ckpt.model.sharded import ShardedBase, ShardedObject, ShardedTensor
from dist_ckpt.strategies.filesystem_async import FileSystemWriterAsync
from dist_ckpt.strategies.state_dict_saver import (
    CheckpointWriteError,
    save_state_dict_async_finalize,
    save_state_dict_async_plan,
    verify_global_md_reuse,
)
from dist_ckpt.strategies.torch import MCoreSavePlanner, mcore_to_pyt_state_dict

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled", "ignore:Detected an existing checkpoint"
)


def _state(scale: float = 1.0) -> Dict[str, List[ShardedBase]]:
    flat_buffer = torch.arange(100, dtype=torch.float32) * scale  # a view into it is saved: its own bytes only
    return {
        "decoder.w": [ShardedTensor.from_rank_offsets("decoder.w", flat_buffer[10:30].view(4, 5))],
        "optimizer.m": [ShardedTensor.from_rank_offsets("optimizer.m", torch.ones(3, 2).t() * scale)],  # strided
        "rng/shard_0_1": [ShardedObject("rng", {"seed": int(scale)}, (1,), (0,))],
    }


def _plan(path: Path, state: Dict[str, List[ShardedBase]], **kwargs: Any) -> Tuple[Any, ...]:
    writer = FileSystemWriterAsync(
        path, thread_count=kwargs.pop("thread_count", 2), separation_hint=kwargs.pop("hint", None)
    )
    planner = MCoreSavePlanner(flatten_state_dict=False)
    return writer, save_state_dict_async_plan(
        mcore_to_pyt_state_dict(state), writer, None, 0, planner=planner, **kwargs
    )


def _request(writer: FileSystemWriterAsync, finalize_args: Tuple[Any, ...]) -> AsyncRequest:
    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    return AsyncRequest(
        save_fn, tuple(save_args), [lambda: save_state_dict_async_finalize(*finalize_args)], preload_fn=preload_fn
    )


def _load(path: Path, scale: float = 1.0) -> Dict[str, Any]:
    requests = {
        "w": ShardedTensor.from_rank_offsets("decoder.w", torch.zeros(4, 5)),
        "m": ShardedTensor.from_rank_offsets("optimizer.m", torch.zeros(2, 3)),
        "rng": ShardedObject("rng", None, (1,), (0,)),
    }
    loaded = TorchDistLoadShardedStrategy().load(requests, dc.storage.open_storage(path))
    assert torch.equal(loaded["w"], (torch.arange(100, dtype=torch.float32) * scale)[10:30].view(4, 5))
    assert torch.equal(loaded["m"], torch.full((2, 3), scale))
    return loaded


def test_plan_write_finalize_then_load_back(tmp_path: Path) -> None:
    writer, (finalize_args, central_plan, local_plan, cache_hit, md_reuse) = _plan(tmp_path, _state())
    assert central_plan.storage_data.prefix == "__0_" and not cache_hit and not md_reuse
    assert finalize_args[1] is not None  # the coordinator's global metadata
    assert not (tmp_path / ".metadata").exists()  # planning writes nothing
    _request(writer, finalize_args).execute_sync()

    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0_0.distcp", "__0_1.distcp"]  # no results left behind
    assert _load(tmp_path)["rng"] == {"seed": 1}
    stored = read_metadata(tmp_path).storage_data[MetadataIndex("decoder.w", (0, 0))]
    whole = io.BytesIO()
    torch.save(torch.arange(100, dtype=torch.float32)[10:30].view(4, 5), whole)  # torch.save writes whole storages
    assert stored.length <= len(whole.getvalue()) - 80 * 4  # the 20 elements of the view, not the buffer's 100


def test_separation_hint_writes_the_hinted_keys_to_files_of_their_own(tmp_path: Path) -> None:
    writer, (finalize_args, *_) = _plan(tmp_path, _state(), thread_count=2, hint="optimizer.")
    names = {
        name: [i.index.fqn for i, _ in raw] + [i.index.fqn for i, _ in tensors]
        for _, name, (raw, tensors) in writer.write_buckets
    }
    assert names == {"__0_0.distcp": ["rng/shard_0_1", "decoder.w"], "optimizer.__0_1.distcp": ["optimizer.m"]}
    _request(writer, finalize_args).execute_sync()
    _load(tmp_path)
    with pytest.raises(ArgumentTypeError, match="thread_count >= 2"):
        FileSystemWriterAsync(tmp_path, thread_count=1, separation_hint="optimizer.")


def test_a_rank_whose_write_never_finished_fails_the_finalization(tmp_path: Path) -> None:
    writer, (finalize_args, *_) = _plan(tmp_path, _state())
    with pytest.raises(CheckpointWriteError, match=r"rank 0: .*did not finish") as raised:
        save_state_dict_async_finalize(*finalize_args)  # the save function never ran
    assert isinstance(raised.value, dcp.CheckpointException) and list(raised.value.failures) == [0]
    assert not (tmp_path / ".metadata").exists()


def test_a_failed_write_raises_before_finalization_and_commits_nothing(tmp_path: Path) -> None:
    writer, (finalize_args, *_) = _plan(tmp_path, _state())
    (tmp_path / "__0_0.distcp").mkdir()  # the file cannot be created
    with pytest.raises(CheckpointingException, match="__0_0.distcp"):
        _request(writer, finalize_args).execute_sync()
    with pytest.raises(CheckpointWriteError, match="rank 0: .*failed"):
        save_state_dict_async_finalize(*finalize_args)  # the failure was recorded for finalization too
    assert not (tmp_path / ".metadata").exists()


def test_the_writer_is_an_ordinary_dcp_writer_too(tmp_path: Path) -> None:
    state = mcore_to_pyt_state_dict(_state(2.0))
    dcp.save(
        state,
        storage_writer=FileSystemWriterAsync(tmp_path),
        planner=MCoreSavePlanner(flatten_state_dict=False),
        no_dist=True,
    )
    assert _load(tmp_path, 2.0)["rng"] == {"seed": 2}


def test_cached_structure_skips_planning_and_reuses_the_coordinators_metadata(tmp_path: Path) -> None:
    """Megatron-Core's use_cached_ckpt_structure: the second save of the same structure plans nothing."""
    writer, (first_args, central, local, _, _) = _plan(tmp_path / "a", _state())
    _request(writer, first_args).execute_sync()

    writer, (args, central2, _, cache_hit, _) = _plan(
        tmp_path / "b", _state(3.0), cached_ckpt_structure=(central, local, True)
    )
    assert cache_hit and central2 == central and args[1] is None  # no metadata made: nothing gathered
    _request(writer, (args[0], first_args[1], args[2])).execute_sync()  # the cached metadata
    _load(tmp_path / "b", 3.0)


def test_loaded_metadata_is_reused_when_every_rank_plans_the_same(tmp_path: Path) -> None:
    writer, (first_args, *_) = _plan(tmp_path / "a", _state())
    _request(writer, first_args).execute_sync()
    loaded_plans = getattr(first_args[1], "all_local_plans")

    writer, (args, _, local, _, md_reuse) = _plan(tmp_path / "b", _state(4.0), loaded_all_plans=loaded_plans)
    assert md_reuse and args[1] is None
    assert verify_global_md_reuse(loaded_plans, local, 0, args[2])
    _request(writer, (args[0], first_args[1], args[2])).execute_sync()
    _load(tmp_path / "b", 4.0)

    other = SavePlan([WriteItem(MetadataIndex("x"), WriteItemType.BYTE_IO)])
    assert not verify_global_md_reuse([other], local, 0, args[2])
    assert not verify_global_md_reuse([], local, 0, args[2])


def _chunk(key: str, numel: int) -> WriteItem:
    size = torch.Size([numel])
    data = TensorWriteData(ChunkStorageMetadata(torch.Size([0]), size), TensorProperties(dtype=torch.float32), size)
    return WriteItem(index=MetadataIndex(key, (0,)), type=WriteItemType.SHARD, tensor_data=data)


def test_split_by_size_balances_the_bytes_of_the_chunks() -> None:
    items = [_chunk(f"t{n}", n) for n in (10, 1, 7, 3, 5, 4)] + [
        WriteItem(MetadataIndex(f"b{i}"), WriteItemType.BYTE_IO) for i in range(3)
    ]
    bins = split_by_size_and_type(2, items)
    sizes = [sum(i.tensor_data.chunk.sizes[0] for i in b if i.tensor_data is not None) for b in bins]
    assert sorted(sizes) == [15, 15] and sum(len(b) for b in bins) == len(items)
    assert [len([i for i in b if i.type == WriteItemType.BYTE_IO]) for b in bins] == [2, 1]
    assert split_by_size_and_type(1, items) == [items]


def test_unsupported_writer_options_are_refused(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ArgumentTypeError, match="single_file_per_rank"):
            FileSystemWriterAsync(tmp_path, single_file_per_rank=False)
        with pytest.raises(ArgumentTypeError, match="use_msc"):
            FileSystemWriterAsync(tmp_path, use_msc=True)
