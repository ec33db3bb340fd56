"""Unit tests of dist_ckpt.engine.checks: pure checks over synthetic per-rank metadata."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch

from dist_ckpt.engine.checks.common_state import (
    common_state_fingerprints,
    find_common_state_differences,
    validate_common_state_dict,
)
from dist_ckpt.engine.checks.compatibility import validate_sharded_objects_handling
from dist_ckpt.engine.checks.sharding import (
    check_sharding_integrity,
    determine_global_metadata,
    find_sharding_problems,
    validate_sharding_integrity,
)
from dist_ckpt.engine.checks.strict import (
    StrictHandling,
    adjust_non_strict_load,
    determine_missing_and_unexpected_keys,
    maybe_report_missing_and_unexpected_keys,
    parse_strict_flag,
    validate_integrity_and_strict_load,
)
from dist_ckpt.errors import (
    CheckpointingException,
    IncompatibleStrategyError,
    KeyMismatchError,
    NotACheckpointError,
    ShardingIntegrityError,
)
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor


def st(key, local_shape, *rank_offsets, replica_id=0, dtype=torch.float32, prepend_axis_num=0, flat=None):
    """A ShardedTensor without data, as exchanged between ranks."""
    meta = torch.empty(local_shape, dtype=dtype, device="meta")
    sh = ShardedTensor.from_rank_offsets(
        key, meta, *rank_offsets, replica_id=replica_id, prepend_axis_num=prepend_axis_num
    )
    sh = sh.without_data()
    if flat is not None:
        sh.flattened_range = slice(*flat)
        sh.validate_metadata_integrity()
    return sh


def grid_2x2(key="w", replica=0):
    """Rank r holds chunk (r // 2, r % 2) of a (4, 6) tensor."""
    return [[st(key, (2, 3), (0, r // 2, 2), (1, r % 2, 2), replica_id=replica)] for r in range(4)]


# --------------------------------------------------------------------------- sharding integrity


class TestTensorSharding:
    def test_valid_grid(self):
        assert find_sharding_problems(grid_2x2()) == []
        check_sharding_integrity(grid_2x2())

    def test_valid_with_replicas(self):
        meta = [[st("w", (2, 6), (0, r % 2, 2), replica_id=r // 2)] for r in range(4)]
        assert find_sharding_problems(meta) == []

    def test_tuple_replica_ids(self):
        meta = [[st("w", (3,), (0, r % 2, 2), replica_id=(0, r // 2))] for r in range(4)]
        assert find_sharding_problems(meta) == []

    def test_several_shards_per_rank(self):
        meta = [[st("w", (1, 6), (0, i, 4)) for i in range(4)]]
        assert find_sharding_problems(meta) == []

    def test_overlap(self):
        meta = grid_2x2("layer.w")
        meta[3] = [st("layer.w", (2, 3), (0, 0, 2), (1, 0, 2))]  # rank 3 duplicates rank 0's chunk
        problems = find_sharding_problems(meta)
        assert any("'layer.w'" in p and "overlap" in p and "[0, 3]" in p for p in problems)
        assert any("gap" in p and "(2, 3)" in p for p in problems)  # chunk (1, 1) is now missing
        with pytest.raises(ShardingIntegrityError, match=r"'layer\.w'") as info:
            check_sharding_integrity(meta)
        assert "4 ranks" in str(info.value)
        assert isinstance(info.value, CheckpointingException)

    def test_duplicate_main_replica_overlap_only(self):
        meta = grid_2x2() + [[st("w", (2, 3), (0, 1, 2), (1, 1, 2))]]
        problems = find_sharding_problems(meta)
        assert len(problems) == 1 and "overlap" in problems[0] and "[3, 4]" in problems[0]

    def test_gap(self):
        meta = grid_2x2("emb")[:3]
        problems = find_sharding_problems(meta)
        assert len(problems) == 1
        assert "'emb'" in problems[0] and "gap" in problems[0] and "(2, 3)" in problems[0]
        assert "1 of 4" in problems[0]

    def test_gap_when_only_replicas(self):
        meta = [[st("w", (2,), (0, 0, 2))], [st("w", (2,), (0, 1, 2), replica_id=1)]]
        problems = find_sharding_problems(meta)
        assert len(problems) == 1 and "(2,)" in problems[0]

    @pytest.mark.parametrize(
        "attr, other",
        [
            ("global_shape", lambda: st("w", (2, 3), (0, 1, 2), (1, 1, 3))),
            ("dtype", lambda: st("w", (2, 3), (0, 1, 2), (1, 1, 2), dtype=torch.bfloat16)),
            ("full_local_shape", lambda: st("w", (1, 6), (0, 3, 4))),
        ],
    )
    def test_disagreeing_metadata(self, attr, other):
        meta = grid_2x2()
        meta[3] = [other()]
        problems = find_sharding_problems(meta)
        assert len(problems) == 1
        assert "'w'" in problems[0] and attr in problems[0] and "rank 3" in problems[0]

    def test_prepend_axis_num_disagreement(self):
        a = st("w", (1, 4), (0, 0, 2))
        b = st("w", (4,), (0, 1, 2), prepend_axis_num=1)
        problems = find_sharding_problems([[a], [b]])
        assert len(problems) == 1 and "prepend_axis_num" in problems[0]

    def test_prepended_stack(self):
        meta = [[st("layers.w", (4, 5), (0, r, 3), prepend_axis_num=1)] for r in range(3)]
        assert find_sharding_problems(meta) == []
        assert "gap" in find_sharding_problems(meta[:2])[0]

    def test_not_a_regular_grid(self):
        a = ShardedTensor("w", None, torch.float32, (4,), (10,), (0,), None)
        b = ShardedTensor("w", None, torch.float32, (4,), (10,), (4,), None)
        problems = find_sharding_problems([[a], [b]])
        assert len(problems) == 1 and "not a multiple" in problems[0] and "'w'" in problems[0]

    def test_empty_tensor(self):
        meta = [[st("empty", (0, 3))]]
        assert find_sharding_problems(meta) == []

    def test_several_keys_sorted_and_independent(self):
        meta = grid_2x2("b")[:3] + [[st("a", (2,), (0, 0, 2))]]
        problems = find_sharding_problems(meta)
        assert [p.split(":")[0] for p in problems] == ["'a'", "'b'"]


class TestFlattenedSharding:
    @staticmethod
    def flat(rank, chunk, rng, replica_id=0):
        meta = torch.empty((2, 3), device="meta")
        return ShardedTensor.from_rank_offsets_flat(
            "f",
            meta.flatten()[rng[0] : rng[1]],
            (2, 3),
            (0, chunk, 2),
            flattened_range=slice(*rng),
            replica_id=replica_id,
        ).without_data()

    def test_valid(self):
        meta = [
            [self.flat(0, 0, (0, 4))],
            [self.flat(1, 0, (4, 6)), self.flat(1, 1, (0, 1))],
            [self.flat(2, 1, (1, 6))],
        ]
        assert find_sharding_problems(meta) == []

    def test_overlap(self):
        meta = [[self.flat(0, 0, (0, 4))], [self.flat(1, 0, (3, 6))], [self.flat(2, 1, (0, 6))]]
        problems = find_sharding_problems(meta)
        assert len(problems) == 1 and "overlap" in problems[0] and "rank 1" in problems[0] and "'f'" in problems[0]

    def test_inner_gap(self):
        meta = [[self.flat(0, 0, (0, 2))], [self.flat(1, 0, (3, 6))], [self.flat(2, 1, (0, 6))]]
        problems = find_sharding_problems(meta)
        assert len(problems) == 1 and "[2, 3)" in problems[0]
        assert "Flattened ranges dont cover the whole shard" in problems[0]  # Megatron-Core's words

    def test_trailing_gap(self):
        meta = [[self.flat(0, 0, (0, 6))], [self.flat(1, 1, (0, 5))]]
        problems = find_sharding_problems(meta)
        assert len(problems) == 1 and "[5, 6)" in problems[0] and "(2, 0)" in problems[0]
        assert "Flattened ranges dont cover the whole shard" in problems[0]

    def test_missing_chunk(self):
        problems = find_sharding_problems([[self.flat(0, 0, (0, 6))]])
        assert len(problems) == 1 and "gap" in problems[0]

    def test_replicas_ignored(self):
        meta = [[self.flat(0, 0, (0, 6)), self.flat(0, 1, (0, 6))], [self.flat(1, 1, (2, 4), replica_id=1)]]
        assert find_sharding_problems(meta) == []

    def test_mixed_flat_and_whole(self):
        meta = [[self.flat(0, 0, (0, 6))], [st("f", (2, 3), (0, 1, 2))]]
        problems = find_sharding_problems(meta)
        assert len(problems) == 1 and "flattened" in problems[0] and "[0]" in problems[0]


class TestObjectSharding:
    def test_valid(self):
        meta = [[ShardedObject("o", None, (2, 2), (r // 2, r % 2))] for r in range(4)]
        assert find_sharding_problems(meta) == []

    def test_overlap_and_missing(self):
        meta = [
            [ShardedObject("opt.o", None, (3,), (0,))],
            [ShardedObject("opt.o", None, (3,), (0,))],
            [ShardedObject("opt.o", None, (3,), (2,), replica_id=1)],
        ]
        problems = find_sharding_problems(meta)
        assert any("overlap" in p and "[0, 1]" in p and "'opt.o'" in p for p in problems)
        assert any("(1,)" in p and "2 of 3" in p for p in problems)

    def test_shape_disagreement(self):
        meta = [[ShardedObject("o", None, (2,), (0,))], [ShardedObject("o", None, (3,), (1,))]]
        problems = find_sharding_problems(meta)
        assert len(problems) == 1 and "global_shape" in problems[0]

    def test_tensor_and_object_same_key(self):
        meta = [[ShardedObject("x", None, (1,), (0,))], [st("x", (2,))]]
        problems = find_sharding_problems(meta)
        assert len(problems) == 1 and "ShardedTensor on ranks [1]" in problems[0]


def test_many_problems_are_truncated():
    meta = [[st(f"k{i:02d}", (2,), (0, 0, 2))] for i in range(15)]
    assert len(find_sharding_problems(meta)) == 15
    with pytest.raises(ShardingIntegrityError, match=r"and 5 more") as info:
        check_sharding_integrity(meta)
    assert "'k00'" in str(info.value) and "'k14'" not in str(info.value)


def test_validate_sharding_integrity_world_of_one():
    validate_sharding_integrity(grid_2x2())
    with pytest.raises(ShardingIntegrityError, match="gap"):
        validate_sharding_integrity(grid_2x2()[:3])
    with pytest.raises(CheckpointingException, match="global_metadata"):
        validate_sharding_integrity(None)


def test_determine_global_metadata_world_of_one():
    sd = {"a": ShardedTensor.from_rank_offsets("a", torch.ones(2)), "b": [ShardedObject("o", 5, (1,), (0,))], "c": 1}
    local, global_ = determine_global_metadata(sd)
    assert [s.key for s in local] == ["a", "o"] and all(s.data is None for s in local)
    assert len(global_) == 1 and [s.key for s in global_[0]] == ["a", "o"]
    assert global_[0][0].global_shape == (2,) and global_[0][0].dtype == torch.float32
    assert sd["a"].data is not None


# --------------------------------------------------------------------------- strict handling


class TestStrictHandling:
    def test_values(self):
        assert {m.value for m in StrictHandling} == {
            "assume_ok_unexpected",
            "log_unexpected",
            "log_all",
            "raise_unexpected",
            "raise_all",
            "return_unexpected",
            "return_all",
            "ignore_all",
        }

    def test_requires_explicit_check(self):
        for m in StrictHandling:
            assert StrictHandling.requires_explicit_ckpt_mismatch_check(m) is (m != StrictHandling.ASSUME_OK_UNEXPECTED)

    def test_requires_global(self):
        expected = {StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL}
        for m in StrictHandling:
            assert StrictHandling.requires_global_app_metadata(m) is (m in expected)

    def test_requires_returning(self):
        expected = {StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL}
        for m in StrictHandling:
            assert StrictHandling.requires_returning_mismatch_keys(m) is (m in expected)

    @pytest.mark.parametrize("mode", list(StrictHandling))
    def test_parse(self, mode):
        assert parse_strict_flag(mode) is mode
        assert parse_strict_flag(mode.value) is mode

    @pytest.mark.parametrize("bad", ["RAISE_ALL", "strict", "", None, 1])
    def test_parse_invalid(self, bad):
        with pytest.raises(CheckpointingException, match="assume_ok_unexpected") as info:
            parse_strict_flag(bad)
        assert repr(bad) in str(info.value)


class TestKeyMatching:
    def test_determine_missing_and_unexpected(self):
        ckpt = {"a": st("a", (2,)), "b": st("b", (2,)), "o/shard_0_1": ShardedObject("o", None, (1,), (0,))}
        local = [st("a", (2,)), st("c", (2,))]
        missing, unexpected = determine_missing_and_unexpected_keys(ckpt, local)
        assert missing == set() and unexpected == {"c"}
        global_ = [local, [ShardedObject("o", None, (1,), (0,))]]
        missing, unexpected = determine_missing_and_unexpected_keys(ckpt, local, global_)
        assert missing == {"b"} and unexpected == {"c"}

    def test_report_raises(self):
        with pytest.raises(KeyMismatchError) as info:
            maybe_report_missing_and_unexpected_keys({"m1"}, {"u1", "u0"}, raise_error=True)
        err = info.value
        assert err.missing_keys == ["m1"] and err.unexpected_keys == ["u0", "u1"]
        assert "'u0'" in str(err) and "'m1'" in str(err) and str(err).startswith("[rank 0]")
        assert isinstance(err, KeyError) and isinstance(err, CheckpointingException)
        # Megatron-Core's words, followed by the keys
        assert re.search(r"Unexpected keys \(.*\): \['u0', 'u1'\]", str(err)), str(err)
        assert re.search(r"Missing keys \(.*\): \['m1'\]", str(err)), str(err)

    @pytest.mark.parametrize("missing, unexpected", [(set(), {"TenB"}), ({"TenB"}, set())])
    def test_report_names_only_the_kinds_found(self, missing, unexpected, caplog):
        """Megatron-Core's tests check that each kind's words appear only when there are such keys."""
        with pytest.raises(KeyMismatchError) as info:
            maybe_report_missing_and_unexpected_keys(missing, unexpected, raise_error=True)
        with caplog.at_level(logging.WARNING, logger="dist_ckpt"):
            maybe_report_missing_and_unexpected_keys(missing, unexpected, raise_error=False)
        for text in (str(info.value), caplog.text):
            assert "TenB" in text
            assert ("Unexpected keys" in text) == bool(unexpected) and ("Missing keys" in text) == bool(missing)

    def test_report_logs(self, caplog):
        with caplog.at_level(logging.WARNING, logger="dist_ckpt"):
            maybe_report_missing_and_unexpected_keys({"m1"}, set(), raise_error=False)
        assert "'m1'" in caplog.text

    def test_report_nothing(self, caplog):
        with caplog.at_level(logging.WARNING, logger="dist_ckpt"):
            maybe_report_missing_and_unexpected_keys(set(), set(), raise_error=True)
        assert caplog.text == ""

    def test_adjust_non_strict_load(self):
        a, c = ShardedTensor.from_rank_offsets("a", torch.ones(1)), ShardedTensor.from_rank_offsets("c", torch.ones(1))
        o = ShardedObject("o", 1, (1,), (0,))
        sd = {"x": a, "nested": {"y": c, "l": [o, 5]}, "plain": 3}
        out = adjust_non_strict_load(sd, {"c", "o"})
        assert out == {"x": a, "nested": {"l": [5]}, "plain": 3}
        assert sd["nested"]["y"] is c and sd["nested"]["l"][0] is o  # the input is not modified

    def test_adjust_removes_nothing(self):
        a = ShardedTensor.from_rank_offsets("a", torch.ones(1))
        assert adjust_non_strict_load({"x": a}, set()) == {"x": a}


class TestValidateIntegrityAndStrictLoad:
    @staticmethod
    def request():
        return {
            "a": ShardedTensor.from_rank_offsets("a", torch.ones(2)),
            "c": ShardedTensor.from_rank_offsets("c", torch.ones(2)),
        }

    ckpt = {"a": st("a", (2,)), "b": st("b", (2,))}

    @pytest.mark.parametrize(
        "mode, missing, unexpected",
        [
            (StrictHandling.LOG_UNEXPECTED, set(), {"c"}),
            (StrictHandling.LOG_ALL, {"b"}, {"c"}),
            (StrictHandling.RETURN_UNEXPECTED, set(), {"c"}),
            (StrictHandling.RETURN_ALL, {"b"}, {"c"}),
            (StrictHandling.IGNORE_ALL, set(), set()),
        ],
    )
    def test_non_raising_modes(self, mode, missing, unexpected):
        sd, m, u = validate_integrity_and_strict_load(self.request(), mode, True, ckpt_sharded_metadata=self.ckpt)
        assert set(sd) == {"a"}
        assert (m, u) == (missing, unexpected)

    @pytest.mark.parametrize(
        "mode, names", [(StrictHandling.RAISE_UNEXPECTED, ["'c'"]), (StrictHandling.RAISE_ALL, ["'c'", "'b'"])]
    )
    def test_raising_modes(self, mode, names):
        with pytest.raises(KeyMismatchError) as info:
            validate_integrity_and_strict_load(self.request(), mode, False, ckpt_sharded_metadata=self.ckpt)
        for n in names:
            assert n in str(info.value)

    def test_assume_ok_does_not_look(self):
        req = self.request()
        sd, m, u = validate_integrity_and_strict_load(req, StrictHandling.ASSUME_OK_UNEXPECTED, False)
        assert set(sd) == {"a", "c"} and (m, u) == (set(), set())

    def test_needs_checkpoint_metadata(self):
        with pytest.raises(CheckpointingException, match="metadata"):
            validate_integrity_and_strict_load(self.request(), StrictHandling.RAISE_ALL, False)

    def test_integrity_checked(self):
        req = {"half": ShardedTensor.from_rank_offsets("a", torch.ones(1), (0, 0, 2))}
        with pytest.raises(ShardingIntegrityError, match="'a'"):
            validate_integrity_and_strict_load(req, StrictHandling.ASSUME_OK_UNEXPECTED, True)
        validate_integrity_and_strict_load(req, StrictHandling.ASSUME_OK_UNEXPECTED, False)


def test_validate_sharded_objects_handling():
    class S:
        def __init__(self, flag):
            self.can_handle_sharded_objects = flag

        def __str__(self):
            return f"S({self.can_handle_sharded_objects})"

    validate_sharded_objects_handling(S(True), S(False))
    validate_sharded_objects_handling(S(False), S(True))
    with pytest.raises(IncompatibleStrategyError, match="ShardedObjects"):
        validate_sharded_objects_handling(S(False), S(False))


def test_verify_checkpoint_on_empty_dir(tmp_path):
    from dist_ckpt.engine.checks.compatibility import verify_checkpoint_and_load_strategy

    with pytest.raises(NotACheckpointError, match="metadata.json"):
        verify_checkpoint_and_load_strategy(tmp_path)


# --------------------------------------------------------------------------- common state


class TestCommonStateFingerprints:
    def test_paths(self):
        fp = common_state_fingerprints({"a": 1, "b": {"c": [1, 2], "d": {}}, "e": []})
        assert set(fp) == {(), ("a",), ("b",), ("b", "c"), ("b", "c", 0), ("b", "c", 1), ("b", "d"), ("e",)}
        assert fp[("a",)][0] == "<class 'int'>" and fp[("b",)] == ("<class 'dict'>", "dict")

    def test_scalar_root(self):
        assert set(common_state_fingerprints(5)) == {()}

    def test_equal_states_equal_fingerprints(self):
        def make():
            return {
                "t": torch.arange(4.0),
                "n": np.arange(3),
                "s": {1, 2},
                "tup": (1, "x"),
                "f": 1.5,
                "none": None,
                "b": b"raw",
                "obj": {"lr": 0.1},
            }

        assert common_state_fingerprints(make()) == common_state_fingerprints(make())

    @pytest.mark.parametrize(
        "a, b",
        [
            (torch.arange(4.0), torch.arange(4.0) + 1),
            (torch.zeros(4), torch.zeros(2, 2)),
            (torch.zeros(4), torch.zeros(4, dtype=torch.float64)),
            (np.arange(3), np.arange(3) * 2),
            (1, 2),
            (1, 1.0 + 1e-9),
            ("x", "y"),
            ((1, 2), (1, 3)),
            ({1, 2}, {1, 3}),
            (1, True),
        ],
    )
    def test_different_values_differ(self, a, b):
        assert common_state_fingerprints({"k": a}) != common_state_fingerprints({"k": b})

    def test_nan_tensor_equal_to_itself(self):
        t = torch.tensor([float("nan"), 1.0])
        assert common_state_fingerprints({"k": t}) == common_state_fingerprints({"k": t.clone()})

    def test_fingerprints_are_compact_strings(self):
        _, fp = common_state_fingerprints({"t": torch.zeros(100000)})[("t",)]
        assert isinstance(fp, str) and len(fp) < 100

    def test_find_differences(self):
        r0 = common_state_fingerprints({"a": 1, "b": 2, "c": 3})
        r1 = common_state_fingerprints({"a": 1, "b": "x", "d": 4})
        r2 = common_state_fingerprints({"a": 1, "b": 2, "c": 3})
        diffs = find_common_state_differences([r0, r1, r2])
        # Megatron-Core's structure: rank -> (only on rank 0, only on that rank, [(key, type 0, type r)])
        assert repr(diffs) == "{1: ([('c',)], [('d',)], [(('b',), <class 'int'>, <class 'str'>)])}"
        assert find_common_state_differences([r0]) == {}

    def test_differences_name_the_topmost_absent_key(self):
        """As Megatron-Core's dict_utils.diff: a subtree only one rank has is one key, and a
        changed leaf deep inside is named by its full path (list indices as ints)."""
        r0 = common_state_fingerprints({"opt": {"groups": [{"lr": 1}, {"step": 1}]}, "sub": {"x": {"y": 1}}})
        r1 = common_state_fingerprints({"opt": {"groups": [{"lr": 1}, {"step": 2}]}, "other": {"z": [1]}})
        assert repr(find_common_state_differences([r0, r1])) == (
            "{1: ([('sub',)], [('other',)], [(('opt', 'groups', 1, 'step'), <class 'int'>, <class 'int'>)])}"
        )

    def test_validate_common_state_dict_world_of_one(self, caplog):
        with caplog.at_level(logging.WARNING, logger="dist_ckpt"):
            validate_common_state_dict({"a": torch.ones(2), "b": [1, {"c": "x"}]})
        assert caplog.text == ""
