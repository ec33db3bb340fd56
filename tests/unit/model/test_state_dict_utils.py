"""Unit tests of dist_ckpt.model.state_dict_utils (splitting sharded state dicts, renaming sharded keys)."""

from __future__ import annotations

import pytest
import torch

from dist_ckpt.errors import InvalidShardedTensorError
from dist_ckpt.model.dict_utils import nested_values
from dist_ckpt.model.sharded import LocalNonPersistentObject, ShardedObject, ShardedTensor, ShardedTensorFactory
from dist_ckpt.model.state_dict_utils import (
    add_prefix_for_sharding,
    apply_prefix_mapping,
    extract_nonpersistent,
    extract_sharded_base,
    extract_sharded_tensors,
    extract_sharded_tensors_and_factories,
    extract_sharded_tensors_or_nonpersistent,
    filter_out_empty_flatten_tensor,
    replace_prefix_for_sharding,
)


def _build(key, data, replica_id):
    return {"x": ShardedTensor.from_rank_offsets(key, data, replica_id=replica_id)}


@pytest.fixture
def state():
    return {
        "t": ShardedTensor.from_rank_offsets("model.t", torch.zeros(2)),
        "nested": {
            "o": ShardedObject("model.o", {"v": 1}, (1,), (0,)),
            "f": ShardedTensorFactory("model.f", torch.zeros(2), _build, lambda d: d["x"]),
            "lst": [ShardedTensor.from_rank_offsets("model.l0", torch.zeros(1)), 7],
        },
        "np": LocalNonPersistentObject([1, 2]),
        "common": 3,
    }


def leaf_types(x):
    return sorted(type(v).__name__ for v in nested_values(x))


class TestExtract:
    def test_sharded_tensors(self, state):
        match, rest = extract_sharded_tensors(state)
        assert match == {"t": state["t"], "nested": {"lst": [state["nested"]["lst"][0]]}}
        assert leaf_types(rest) == sorted(
            ["ShardedObject", "ShardedTensorFactory", "int", "LocalNonPersistentObject", "int"]
        )

    def test_sharded_tensors_and_factories(self, state):
        match, rest = extract_sharded_tensors_and_factories(state)
        assert leaf_types(match) == ["ShardedTensor", "ShardedTensor", "ShardedTensorFactory"]
        assert match["nested"]["f"] is state["nested"]["f"]
        assert leaf_types(rest) == sorted(["ShardedObject", "int", "int", "LocalNonPersistentObject"])

    def test_sharded_tensors_or_nonpersistent(self, state):
        match, rest = extract_sharded_tensors_or_nonpersistent(state)
        assert leaf_types(match) == sorted(
            ["ShardedTensor", "ShardedTensor", "ShardedTensorFactory", "LocalNonPersistentObject"]
        )
        assert rest == {"nested": {"o": state["nested"]["o"], "lst": [7]}, "common": 3}

    def test_sharded_base(self, state):
        match, rest = extract_sharded_base(state)
        assert leaf_types(match) == sorted(["ShardedTensor", "ShardedTensor", "ShardedObject", "ShardedTensorFactory"])
        assert leaf_types(rest) == ["LocalNonPersistentObject", "int", "int"]
        assert rest["common"] == 3 and rest["nested"]["lst"] == [7]

    def test_nonpersistent(self, state):
        match, rest = extract_nonpersistent(state)
        assert match == {"np": state["np"]}
        assert "np" not in rest and rest["common"] == 3
        assert rest["t"] is state["t"]

    def test_input_unchanged(self, state):
        before = [id(v) for v in nested_values(state)]
        for fn in (
            extract_sharded_base,
            extract_nonpersistent,
            extract_sharded_tensors,
            extract_sharded_tensors_and_factories,
            extract_sharded_tensors_or_nonpersistent,
        ):
            fn(state)
        assert [id(v) for v in nested_values(state)] == before
        assert set(state) == {"t", "nested", "np", "common"} and len(state["nested"]["lst"]) == 2


class TestPrefixes:
    def test_add_prefix(self, state):
        add_prefix_for_sharding(state, "dec.")
        keys = sorted(x.key for x in nested_values(state) if hasattr(x, "key"))
        assert keys == ["dec.model.f", "dec.model.l0", "dec.model.o", "dec.model.t"]
        assert state["common"] == 3

    def test_replace_prefix(self, state):
        replace_prefix_for_sharding(state, "model.", "enc.")
        keys = sorted(x.key for x in nested_values(state) if hasattr(x, "key"))
        assert keys == ["enc.f", "enc.l0", "enc.o", "enc.t"]

    def test_replace_prefix_error_names_key(self, state):
        state["odd"] = ShardedTensor.from_rank_offsets("other.w", torch.zeros(1))
        with pytest.raises(InvalidShardedTensorError, match="'other.w'"):
            replace_prefix_for_sharding(state, "model.", "enc.")

    def test_apply_prefix_mapping_first_match_wins(self):
        sd = {
            "a": ShardedTensor.from_rank_offsets("model.layers.0.w", torch.zeros(1)),
            "b": ShardedObject("model.emb", None, (1,), (0,)),
            "c": ShardedTensor.from_rank_offsets("opt.x", torch.zeros(1)),
            "d": [ShardedTensorFactory("model.f", torch.zeros(1), _build, lambda d: d["x"])],
        }
        apply_prefix_mapping(sd, {"model.layers.": "dec.layers.", "model.": "m.", "model.layers.0": "never."})
        assert sd["a"].key == "dec.layers.0.w"
        assert sd["b"].key == "m.emb"
        assert sd["c"].key == "opt.x"  # no matching prefix: unchanged
        assert sd["d"][0].key == "m.f"


def test_filter_out_empty_flatten_tensor_drops_only_empty_flattened_ranges():
    empty = ShardedTensor.from_rank_offsets_flat("w", torch.zeros(0), (2, 2), flattened_range=slice(3, 3))
    part = ShardedTensor.from_rank_offsets_flat("v", torch.zeros(2), (2, 2), flattened_range=slice(1, 3))
    whole = ShardedTensor.from_rank_offsets("u", torch.zeros(0))  # empty but not flattened: kept
    sd = {"w": empty, "nested": {"v": part, "u": whole, "lst": [empty, 5]}, "step": 1}
    out = filter_out_empty_flatten_tensor(sd)
    assert out == {"nested": {"v": part, "u": whole, "lst": [5]}, "step": 1}
    assert sd["w"] is empty and sd["nested"]["lst"] == [empty, 5]  # input untouched
