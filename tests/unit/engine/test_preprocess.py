"""Megatron-Core's state_dict_utils (save_preprocess, load_preprocess) and content metadata
(save(..., content_metadata=...), load_content_metadata), at world size 1."""

from __future__ import annotations

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt import LocalNonPersistentObject, ShardedTensor, ShardedTensorFactory
from dist_ckpt.core import check_is_distributed_checkpoint
from dist_ckpt.engine.load_parts import load_common_state_dict
from dist_ckpt.engine.preprocess import CONTENT_METADATA_KEY, load_content_metadata, load_preprocess, save_preprocess
from dist_ckpt.errors import ArgumentTypeError, ShardingIntegrityError, StateDictStructureError


def _build(key, data, replica_id):
    return {"x": ShardedTensor.from_rank_offsets(key, data, replica_id=replica_id)}


def _merge(loaded):
    return loaded["x"]


def _state():
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0)),
        "f": ShardedTensorFactory("f", torch.ones(2), _build, _merge),
        "empty": ShardedTensor.from_rank_offsets_flat("e", torch.zeros(0), (2,), flattened_range=slice(1, 1)),
        "local": LocalNonPersistentObject([1, 2]),
        "step": 3,
    }


def test_save_preprocess_splits_applies_factories_and_drops_what_is_not_saved():
    sd = _state()
    sharded, common = save_preprocess(sd)
    assert common == {"step": 3}
    assert sorted(sharded) == ["f", "w"]  # no LocalNonPersistentObject, no empty flattened range
    assert isinstance(sharded["f"]["x"], ShardedTensor) and sharded["f"]["x"].key == "f"
    assert isinstance(sd["f"], dict)  # factories are applied in place, as the save does


def test_save_preprocess_validates_the_sharding_when_asked():
    half = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, 0, 2))}  # the other half: nobody
    with pytest.raises(ShardingIntegrityError, match="'w'"):
        save_preprocess(half)
    half = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, 0, 2))}
    sharded, common = save_preprocess(half, validate_access_integrity=False)
    assert list(sharded) == ["w"] and common == {}


def test_save_preprocess_passes_the_common_state_through_the_preprocess_hook():
    seen = []
    save_preprocess({"step": 1}, preprocess_common_before_consistancy_check=lambda c: seen.append(dict(c)) or c)
    assert seen == [{"step": 1}]


def test_load_preprocess_returns_request_local_values_and_factories_without_touching_input():
    sd = _state()
    request, nonpersistent, factories = load_preprocess(sd)
    assert sorted(request) == ["f", "step", "w"]
    assert request["f"]["x"].key == "f"
    assert nonpersistent == {"local": [1, 2]}
    assert isinstance(factories["f"], ShardedTensorFactory) and factories["f"].data is None
    assert isinstance(sd["f"], ShardedTensorFactory) and sd["f"].data is not None  # input unchanged
    assert isinstance(sd["local"], LocalNonPersistentObject) and "empty" in sd


def test_content_metadata_round_trip_under_megatrons_key(tmp_path):
    meta = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False, "dp_cp_group": object()}
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0)), "step": 3}
    dc.save(sd, tmp_path / "ckpt", content_metadata=meta)
    expected = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False}
    assert load_content_metadata(tmp_path / "ckpt") == expected  # the process group is not saved
    common = load_common_state_dict(tmp_path / "ckpt")
    assert common["content_metadata"] == expected and common["step"] == 3  # Megatron-Core's key
    assert load_content_metadata(preloaded_state_dict=common) == expected
    assert "dp_cp_group" in meta  # the caller's dict is not modified


def test_load_content_metadata_is_none_without_it_and_needs_an_argument(tmp_path):
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, tmp_path / "ckpt")
    assert load_content_metadata(tmp_path / "ckpt") is None
    with pytest.raises(ArgumentTypeError, match="checkpoint_dir or preloaded_state_dict"):
        load_content_metadata()


def test_save_refuses_content_metadata_that_is_not_a_dict_or_would_replace_an_entry(tmp_path):
    with pytest.raises(ArgumentTypeError, match="content_metadata must be a dict"):
        dc.save({"step": 1}, tmp_path / "a", content_metadata=["x"])  # type: ignore[arg-type]
    with pytest.raises(StateDictStructureError, match="already holds 'content_metadata'"):
        dc.save({CONTENT_METADATA_KEY: {"a": 1}}, tmp_path / "b", content_metadata={"a": 2})
    assert not check_is_distributed_checkpoint(tmp_path / "b")
    dc.save({CONTENT_METADATA_KEY: {"a": 1}}, tmp_path / "c", content_metadata={"a": 1})  # the same: fine
    assert load_content_metadata(tmp_path / "c") == {"a": 1}


def test_content_metadata_held_by_the_state_dict_loses_its_process_group_too(tmp_path):
    meta = {"a": 1, "dp_cp_group": object()}
    _, common = save_preprocess({"content_metadata": meta, "step": 1})
    assert common == {"content_metadata": {"a": 1}, "step": 1} and "dp_cp_group" in meta
    dc.save({"content_metadata": meta, "w": ShardedTensor.from_rank_offsets("w", torch.zeros(2))}, tmp_path / "c")
    assert load_content_metadata(tmp_path / "c") == {"a": 1}
