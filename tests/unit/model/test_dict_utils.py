"""Unit tests of dist_ckpt.model.dict_utils (nested dict/list helpers)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from dist_ckpt.errors import CheckpointingException, StateDictStructureError
from dist_ckpt.model.dict_utils import (
    dict_list_map_inplace,
    dict_list_map_outplace,
    dict_map,
    dict_map_with_key,
    diff,
    extract_matching_values,
    inspect_types,
    map_reduce,
    merge,
    nested_items_iter,
    nested_values,
    zip_strict,
)


def is_int(v):
    return isinstance(v, int)


class TestExtractMatchingValues:
    def test_flat_dict(self):
        assert extract_matching_values({"a": 1, "b": "x", "c": 2}, is_int) == ({"a": 1, "c": 2}, {"b": "x"})

    def test_nested_keeps_structure(self):
        x = {"a": {"b": 1, "c": "s"}, "d": [1, "t", {"e": 2, "f": None}], "g": (1, 2)}
        match, rest = extract_matching_values(x, is_int)
        assert match == {"a": {"b": 1}, "d": [1, {"e": 2}]}
        assert rest == {"a": {"c": "s"}, "d": ["t", {"f": None}], "g": (1, 2)}  # tuples are leaves

    def test_lists_as_dicts_keep_positions(self):
        x = {"l": ["a", 1, "b", [2, "c"]]}
        match, rest = extract_matching_values(x, is_int, return_lists_as_dicts=True)
        assert match == {"l": {1: 1, 3: {0: 2}}}
        assert rest == {"l": {0: "a", 2: "b", 3: {1: "c"}}}

    def test_top_level_list(self):
        assert extract_matching_values([1, "a", 2], is_int) == ([1, 2], ["a"])
        assert extract_matching_values([1, "a", 2], is_int, True) == ({0: 1, 2: 2}, {1: "a"})

    def test_empty_containers_stay_in_nonmatching(self):
        match, rest = extract_matching_values({"a": {}, "b": [], "c": 1}, is_int)
        assert match == {"c": 1}
        assert rest == {"a": {}, "b": []}

    def test_input_not_modified(self):
        x = {"a": {"b": 1, "c": "s"}, "l": [1, "x"]}
        extract_matching_values(x, is_int)
        assert x == {"a": {"b": 1, "c": "s"}, "l": [1, "x"]}

    def test_leaf_values_are_not_copied(self):
        t = torch.zeros(2)
        match, _ = extract_matching_values({"t": t}, lambda v: isinstance(v, torch.Tensor))
        assert match["t"] is t

    @pytest.mark.parametrize("x", [5, (1, 2), "str", None])
    def test_top_level_leaf_raises(self, x):
        with pytest.raises(StateDictStructureError, match=type(x).__name__):
            extract_matching_values(x, is_int)


class TestDiff:
    def test_equal(self):
        x = {"a": 1, "b": [1, 2, {"c": torch.arange(3)}], "d": (1, 2)}
        y = {"a": 1, "b": [1, 2, {"c": torch.arange(3)}], "d": (1, 2)}
        assert diff(x, y) == ([], [], [])

    def test_only_left_right_and_mismatch(self):
        x = {"a": 1, "b": {"c": 2, "d": 3}, "l": [1, 2, 3]}
        y = {"b": {"c": 5, "e": 3}, "f": 0, "l": [1, 2]}
        only_left, only_right, mismatch = diff(x, y)
        assert sorted(only_left) == [("a",), ("b", "d"), ("l", 2)]
        assert sorted(only_right) == [("b", "e"), ("f",)]
        assert mismatch == [(("b", "c"), int, int)]

    def test_list_longer_on_right(self):
        assert diff([1], [1, 2, 3]) == ([], [(1,), (2,)], [])

    def test_tensors(self):
        assert diff(torch.ones(3), torch.ones(3)) == ([], [], [])
        assert diff({"t": torch.ones(3)}, {"t": torch.zeros(3)})[2] == [(("t",), torch.Tensor, torch.Tensor)]
        assert diff(torch.ones(3), torch.ones(4))[2]  # shape differs
        assert diff(torch.ones(3), torch.ones(3, dtype=torch.float64))[2]  # dtype differs
        assert diff(torch.ones(3), [1.0, 1.0, 1.0])[2]  # tensor vs non-tensor

    def test_nan_in_same_place_is_equal(self):
        a = torch.tensor([1.0, float("nan")])
        assert diff(a, a.clone()) == ([], [], [])
        assert diff(a, torch.tensor([float("nan"), 1.0]))[2]
        assert diff(torch.tensor([0.0, float("nan")]), torch.tensor([0.0, 0.0]))[2]

    def test_bfloat16_and_ints(self):
        assert diff(torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16)) == ([], [], [])
        assert diff(torch.tensor([1, 2]), torch.tensor([1, 3]))[2]

    def test_numpy_arrays(self):
        assert diff(np.arange(3), np.arange(3)) == ([], [], [])
        assert diff(np.arange(3), np.array([0, 1, 5]))[2]

    def test_tuple_vs_list_differ(self):
        assert diff((1, 2), [1, 2])[2] == [((), tuple, list)]

    def test_prefix(self):
        assert diff({"a": 1}, {"a": 2}, prefix=("root",))[2] == [(("root", "a"), int, int)]

    def test_uncomparable_objects_are_different(self):
        class Weird:
            def __ne__(self, other):
                raise RuntimeError("no")

        assert diff(Weird(), Weird())[2]


class TestInspectTypes:
    def test_writes_types(self):
        out = io.StringIO()
        inspect_types({"a": torch.zeros(2, 3), "b": [1, "x" * 50]}, file=out)
        text = out.getvalue()
        assert "> a: Tensor of shape (2, 3), dtype torch.float32" in text
        assert "- 0: [int]: 1" in text
        assert "(truncated)" in text

    def test_default_is_stdout(self, capsys):
        inspect_types({"k": 1.5})
        assert "[float]: 1.5" in capsys.readouterr().out


class TestIteration:
    def test_nested_values(self):
        x = {"a": 1, "b": [2, {"c": 3, "d": (4, 5)}], "e": {}}
        assert list(nested_values(x)) == [1, 2, 3, (4, 5)]
        assert list(nested_values([1, [2]])) == [1, 2]

    def test_nested_items_iter(self):
        x = {"a": 1, "b": [2, {"c": 3}]}
        items = list(nested_items_iter(x))
        assert [(k, v) for _, k, v in items] == [("a", 1), (0, 2), ("c", 3)]
        assert items[0][0] is x and items[1][0] is x["b"] and items[2][0] is x["b"][1]

    def test_dict_map(self):
        x = {"a": 1, "b": [2, {"c": 3}]}
        inner = x["b"]
        assert dict_map(lambda v: v * 10, x) is None
        assert x == {"a": 10, "b": [20, {"c": 30}]}
        assert x["b"] is inner

    def test_dict_map_with_key(self):
        x = {"a": 1, "b": [2, {"c": 3}]}
        dict_map_with_key(lambda k, v: (k, v), x)
        assert x == {"a": ("a", 1), "b": [(0, 2), {"c": ("c", 3)}]}

    def test_dict_list_map_inplace(self):
        x = {"a": 1, "b": [2, {"c": 3}]}
        inner_list = x["b"]
        out = dict_list_map_inplace(lambda v: v + 1, x)
        assert out is x and x["b"] is inner_list
        assert x == {"a": 2, "b": [3, {"c": 4}]}
        assert dict_list_map_inplace(lambda v: v * 2, 21) == 42

    def test_dict_list_map_outplace(self):
        x = {"a": 1, "b": [2, {"c": 3}]}
        out = dict_list_map_outplace(lambda v: v + 1, x)
        assert out == {"a": 2, "b": [3, {"c": 4}]}
        assert x == {"a": 1, "b": [2, {"c": 3}]}
        assert out["b"] is not x["b"]
        assert dict_list_map_outplace(str, 5) == "5"


class TestMerge:
    def test_dicts(self):
        x1 = {"a": 1, "n": {"b": 2}}
        out = merge(x1, {"c": 3, "n": {"d": 4}})
        assert out is x1
        assert x1 == {"a": 1, "c": 3, "n": {"b": 2, "d": 4}}

    def test_lists_elementwise(self):
        x1 = {"l": [{"a": 1}, {}]}
        merge(x1, {"l": [{"b": 2}, {"c": 3}]})
        assert x1 == {"l": [{"a": 1, "b": 2}, {"c": 3}]}

    def test_list_length_mismatch(self):
        with pytest.raises(StateDictStructureError, match="'lst'"):
            merge({"lst": [{}, {}]}, {"lst": [{}]})

    def test_leaf_conflict_names_key(self):
        with pytest.raises(StateDictStructureError, match="'clash'") as info:
            merge({"n": {"clash": 1}}, {"n": {"clash": 2}})
        assert isinstance(info.value, CheckpointingException)

    def test_dict_vs_leaf(self):
        with pytest.raises(StateDictStructureError, match="'k'"):
            merge({"k": {"a": 1}}, {"k": 5})


class TestMapReduce:
    def test_default_groups(self):
        assert map_reduce([1, 2, 1]) == {1: [1, 1], 2: [2]}

    def test_key_value_reduce(self):
        words = ["apple", "avocado", "banana", "blueberry", "cherry"]
        out = map_reduce(words, key_fn=lambda w: w[0], value_fn=len, reduce_fn=sum)
        assert out == {"a": 5 + 7, "b": 6 + 9, "c": 6}

    def test_empty(self):
        assert map_reduce([]) == {}


def test_zip_strict_zips_equal_lengths_and_names_unequal_ones():
    assert list(zip_strict([1, 2], "ab", iter((True, False)))) == [(1, "a", True), (2, "b", False)]
    assert list(zip_strict()) == []
    with pytest.raises(StateDictStructureError, match=r"unequal lengths \[2, 3\]"):
        zip_strict([1, 2], [1, 2, 3])
    with pytest.raises(ValueError):  # also the builtin a caller of zip(strict=True) catches
        zip_strict([1], [])
