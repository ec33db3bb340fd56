"""Megatron-Core's DCP helpers at their Megatron paths (``strategies.torch``, ``strategies.checkpointable``,
``strategies.cached_metadata_filesystem_reader``), used as Megatron-Core's own torch_dist strategy uses
them: flatten, translate with ``mcore_to_pyt_state_dict``, then ``torch.distributed.checkpoint`` with
its planners; in one process (``no_dist``), the multi-rank use is in tests/distributed/test_megatron_dcp.py.
"""

from __future__ import annotations

import io
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.metadata import MetadataIndex

import dist_ckpt as dc
from dist_ckpt.errors import (
    ArgumentTypeError,
    InvalidShardedTensorError,
    KeyMismatchError,
    LoadMismatchError,
    StateDictStructureError,
    UnsafeObjectError,
)
from dist_ckpt.model.sharded import ShardedBase, ShardedObject, ShardedTensor
from dist_ckpt.strategies.cached_metadata_filesystem_reader import CachedMetadataFileSystemReader
from dist_ckpt.strategies.checkpointable import CheckpointableShardedTensor, LocalShardsContainer
from dist_ckpt.strategies.torch import (
    MCoreLoadPlanner,
    MCoreMetadata,
    MCoreSavePlan,
    MCoreSavePlanner,
    flatten_state_dict,
    mcore_to_pyt_state_dict,
)
from tests.torch_dist_golden import fixture_dir

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _grouped(sharded_state_dict: Dict[str, Any]) -> Dict[str, List[ShardedBase]]:
    """Megatron-Core's grouping of a flattened state dict by ShardedBase key."""
    flat, _ = flatten_state_dict(sharded_state_dict)
    grouped: Dict[str, List[ShardedBase]] = {}
    for value in flat.values():
        key = value.unique_key if isinstance(value, ShardedObject) else value.key
        grouped.setdefault(key, []).append(value)
    return grouped


def _dcp_save(state: Dict[str, Any], path: Path) -> None:
    dcp.save(
        state, storage_writer=FileSystemWriter(path), planner=MCoreSavePlanner(flatten_state_dict=False), no_dist=True
    )


def _dcp_load(state: Dict[str, Any], path: Path, **planner: Any) -> None:
    dcp.load(
        state, storage_reader=CachedMetadataFileSystemReader(path), planner=MCoreLoadPlanner(**planner), no_dist=True
    )


def test_local_shards_container_saves_two_shards_and_loads_them_into_another_split(tmp_path: Path) -> None:
    full = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    rows = [ShardedTensor.from_rank_offsets("w", full[2 * i : 2 * i + 2].clone(), (0, i, 2)) for i in range(2)]
    _dcp_save({"w": LocalShardsContainer([CheckpointableShardedTensor.from_sh_ten(s) for s in rows])}, tmp_path)

    cols = [ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4), (1, i, 2)) for i in range(2)]
    _dcp_load({"w": LocalShardsContainer([CheckpointableShardedTensor.from_sh_ten(s) for s in cols])}, tmp_path)
    assert torch.equal(cols[0].data, full[:, :4]) and torch.equal(cols[1].data, full[:, 4:])


def test_checkpointable_sharded_tensor_keeps_prepended_axes_and_refuses_tensor_operations(tmp_path: Path) -> None:
    sh = ShardedTensor.from_rank_offsets("layers.w", torch.arange(6.0).reshape(2, 3), (0, 1, 2), prepend_axis_num=1)
    wrapped = CheckpointableShardedTensor.from_sh_ten(sh)
    assert wrapped.shape == (2, 2, 3)  # layer 1 of 2: the prepended axis
    (item,) = wrapped.__create_write_items__("layers.w", wrapped)
    assert tuple(item.index.offset) == (1, 0, 0) and tuple(item.tensor_data.chunk.sizes) == (1, 2, 3)  # type: ignore[union-attr]
    with pytest.raises(ArgumentTypeError, match="no tensor operation"):
        wrapped.sum()
    flat = ShardedTensor.from_rank_offsets_flat("f", torch.zeros(2), (4,), flattened_range=slice(0, 2))
    with pytest.raises(InvalidShardedTensorError, match="flattened_range"):
        CheckpointableShardedTensor.from_sh_ten(flat)


def test_local_shards_container_finds_shards_by_offset_even_with_a_wrong_hint() -> None:
    shards = [ShardedTensor.from_rank_offsets("w", torch.full((2,), float(i)), (0, i, 3)) for i in range(3)]
    container = LocalShardsContainer([CheckpointableShardedTensor.from_sh_ten(s) for s in shards])
    assert torch.equal(container.__get_tensor_shard__(MetadataIndex("w", (4,), index=0)), torch.full((2,), 2.0))
    with pytest.raises(InvalidShardedTensorError, match=r"no shard at offset \(1,\)"):
        container.__get_tensor_shard__(MetadataIndex("w", (1,)))
    with pytest.raises(ArgumentTypeError):
        LocalShardsContainer([])


def test_flatten_state_dict_joins_paths_with_dots_and_unflattens_back() -> None:
    w, m = (ShardedTensor.from_rank_offsets(k, torch.zeros(1)) for k in ("w", "m"))
    obj = ShardedObject("rng", 7, (1,), (0,))
    state = {"model": {"w": w, 3: obj}, "optim": [m, {"step": 2}], "plain": [1, 2]}
    flat, paths = flatten_state_dict(state)
    assert flat == {"model.w": w, "model.3": obj, "optim.0": m, "optim.1.step": 2, "plain": [1, 2]}
    assert paths["optim.1.step"] == ("optim", 1, "step")
    rebuilt = unflatten_state_dict(flat, paths)
    assert rebuilt["optim"][0] is m and rebuilt["model"]["3"] is obj and rebuilt["plain"] == [1, 2]
    with pytest.raises(StateDictStructureError, match="'a.b'"):
        flatten_state_dict({"a.b": 1, "a": {"b": 2}})


def test_a_dist_ckpt_torch_dist_save_loads_through_megatrons_translation_and_planners(tmp_path: Path) -> None:
    """What Megatron-Core's TorchDistLoadShardedStrategy does, on a checkpoint dc.save wrote."""
    full = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    saved = {
        "decoder": {"w": ShardedTensor.from_rank_offsets("decoder.w", full.clone())},
        "rng": ShardedObject("rng", {"seed": 5}, (1,), (0,)),
    }
    dc.save(saved, tmp_path, sharded_strategy=("torch_dist", 1))

    target = ShardedTensor.from_rank_offsets("decoder.w", torch.zeros(4, 3, dtype=torch.bfloat16), (1, 1, 2))
    requested = {"decoder": {"w": target}, "rng": ShardedObject("rng", None, (1,), (0,))}
    state = mcore_to_pyt_state_dict(_grouped(requested), is_loading=True)
    _dcp_load(state, tmp_path, shapes_validation_sharded_tensors=[target])
    assert torch.equal(target.data, full[:, 3:])
    assert state["rng/shard_0_1"] == [{"seed": 5}]  # the list Megatron-Core saves per unique key


def test_megatrons_save_path_is_read_by_dist_ckpts_loader(tmp_path: Path) -> None:
    """MCoreSavePlanner + the translated state: the torch_dist loader reads the DCP files back."""
    full = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    sh = ShardedTensor.from_rank_offsets("w", full.clone(), prepend_axis_num=1)
    _dcp_save(mcore_to_pyt_state_dict(_grouped({"w": sh, "o": ShardedObject("o", [1, 2], (1,), (0,))})), tmp_path)

    from dist_ckpt.backends.torch_dist.load import TorchDistLoadShardedStrategy

    loaded = TorchDistLoadShardedStrategy().load(
        {
            "w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4), prepend_axis_num=1),
            "o": ShardedObject("o", None, (1,), (0,)),
        },
        dc.storage.open_storage(tmp_path),
    )
    assert torch.equal(loaded["w"], full) and loaded["o"] == [1, 2]


def test_mcore_to_pyt_state_dict_prepares_loads_and_refuses_saves_without_data() -> None:
    missing = ShardedTensor.from_rank_offsets("a", torch.ones(2)).without_data()
    mismatched = ShardedTensor.from_rank_offsets("b", torch.ones(2), allow_shape_mismatch=True)
    state = mcore_to_pyt_state_dict({"a": [missing], "b": [mismatched]}, is_loading=True)
    assert missing.data is not None and missing.data.shape == (2,)
    assert torch.equal(mismatched.data, torch.zeros(2))  # the checkpoint may not cover all of it
    assert isinstance(state["a"], CheckpointableShardedTensor)
    with pytest.raises(InvalidShardedTensorError, match="'c'.*no data"):
        mcore_to_pyt_state_dict({"c": [ShardedTensor.from_rank_offsets("c", torch.ones(1)).without_data()]})
    with pytest.raises(ArgumentTypeError, match="'d'"):
        mcore_to_pyt_state_dict({"d": [ShardedObject("d", 1, (1,), (0,)), missing]})


def test_mcore_load_planner_checks_global_shapes_and_loads_what_overlaps(tmp_path: Path) -> None:
    _dcp_save(mcore_to_pyt_state_dict({"w": [ShardedTensor.from_rank_offsets("w", torch.ones(2, 2))]}), tmp_path)
    metadata = CachedMetadataFileSystemReader(tmp_path).read_metadata()

    def plan(target: ShardedTensor, **planner: Any) -> None:
        p = MCoreLoadPlanner(**planner)
        p.set_up_planner(mcore_to_pyt_state_dict({target.key: [target]}, is_loading=True), metadata)
        p.create_local_plan()

    wider = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))
    with pytest.raises(LoadMismatchError, match=r"'w'.*\(2, 2\).*\(2, 3\)"):
        plan(wider, shapes_validation_sharded_tensors=[wider])
    absent = ShardedTensor.from_rank_offsets("v", torch.zeros(2, 2))
    with pytest.raises(KeyMismatchError, match="'v'"):
        plan(absent, shapes_validation_sharded_tensors=[absent])

    grown = ShardedTensor.from_rank_offsets("w", torch.full((3, 2), 7.0), allow_shape_mismatch=True)
    _dcp_load(
        mcore_to_pyt_state_dict({"w": [grown]}, is_loading=True),
        tmp_path,
        allow_shape_mismatch_sharded_tensors={"w": grown},
    )
    assert torch.equal(grown.data, torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]))
    assert tuple(metadata.state_dict_metadata["w"].size) == (2, 2)  # type: ignore[union-attr]  # restored


@dataclass
class Opaque:
    """A user's class: unpickling it needs full pickle."""

    value: int


def test_mcore_load_planner_runs_no_code_from_a_bytes_entry_unless_allowed(tmp_path: Path) -> None:
    payload = io.BytesIO()
    torch.save([Opaque(3)], payload)  # a class weights_only refuses
    _dcp_save({"o/shard_0_1": payload}, tmp_path)
    with pytest.raises(CheckpointException, match=r"UnsafeObjectError.*'o/shard_0_1'.*allow_pickle=True"):
        _dcp_load({"o/shard_0_1": io.BytesIO()}, tmp_path)
    state: Dict[str, Any] = {"o/shard_0_1": io.BytesIO()}
    _dcp_load(state, tmp_path, allow_pickle=True)
    assert state["o/shard_0_1"] == [Opaque(3)]


def test_mcore_load_planner_loads_into_a_non_contiguous_target(tmp_path: Path) -> None:
    full = torch.arange(6.0).reshape(2, 3)
    _dcp_save({"w": full.clone()}, tmp_path)
    target = torch.zeros(3, 2).t()
    _dcp_load({"w": target}, tmp_path)
    assert torch.equal(target, full)


def test_cached_reader_reads_metadata_once_and_runs_no_code_from_it(tmp_path: Path) -> None:
    _dcp_save({"w": torch.ones(2)}, tmp_path)
    reader = CachedMetadataFileSystemReader(tmp_path)
    first = reader.read_metadata()
    (tmp_path / ".metadata").write_bytes(b"not a pickle")
    assert reader.read_metadata() is first

    class Evil:
        def __reduce__(self) -> Any:
            return (print, ("ran",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UnsafeObjectError):
        CachedMetadataFileSystemReader(tmp_path).read_metadata()


def test_mcore_metadata_and_save_plan_are_the_classes_megatron_0_15_metadata_unpickles_into() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        md = CachedMetadataFileSystemReader(fixture_dir("flat_legacy_mcore015")).read_metadata()
    assert isinstance(md, MCoreMetadata)
    plans = getattr(md, "all_local_plans")
    assert plans and all(isinstance(p, MCoreSavePlan) for p in plans)
