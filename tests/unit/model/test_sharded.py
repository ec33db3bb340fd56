"""Unit tests of dist_ckpt.model.sharded: ShardedTensor, ShardedObject, factories, helpers."""

from __future__ import annotations

import math
import re
from dataclasses import fields

import numpy as np
import pytest
import torch

import dist_ckpt
from dist_ckpt.errors import CheckpointingException, InvalidShardedTensorError, StateDictStructureError
from dist_ckpt.model.sharded import (
    LocalNonPersistentObject,
    LocalNonpersistentObject,
    LocalNonpersitentObject,
    ShardedBase,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)


def raises_naming(exc, key):
    """pytest.raises(exc) whose message must mention ``key`` (quoted, as the library does)."""
    return pytest.raises(exc, match=re.escape(repr(key)))


def make_st(
    key="k",
    data=None,
    dtype=torch.float32,
    local_shape=(2, 3),
    global_shape=(4, 3),
    global_offset=(2, 0),
    axis_fragmentations=(2, 1),
    **kw,
):
    return ShardedTensor(key, data, dtype, local_shape, global_shape, global_offset, axis_fragmentations, **kw)


# --------------------------------------------------------------------------- ShardedTensor fields


class TestShardedTensorFields:
    def test_every_field_is_stored(self):
        data = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        sh = ShardedTensor(
            "layer.w",
            data,
            torch.float32,
            (2, 3),
            (4, 3),
            (2, 0),
            (2, 1),
            replica_id=(0, 1),
            prepend_axis_num=0,
            allow_shape_mismatch=True,
            flattened_range=None,
        )
        assert sh.key == "layer.w"
        assert sh.data is data
        assert sh.dtype == torch.float32
        assert sh.local_shape == (2, 3)
        assert sh.global_shape == (4, 3)
        assert sh.global_offset == (2, 0)
        assert sh.axis_fragmentations == (2, 1)
        assert sh.replica_id == (0, 1)
        assert sh.prepend_axis_num == 0
        assert sh.allow_shape_mismatch is True
        assert sh.flattened_range is None
        assert isinstance(sh, ShardedBase)
        names = [f.name for f in fields(ShardedTensor)]
        assert names == [
            "key",
            "data",
            "dtype",
            "local_shape",
            "global_shape",
            "global_offset",
            "axis_fragmentations",
            "replica_id",
            "prepend_axis_num",
            "allow_shape_mismatch",
            "flattened_range",
        ]

    def test_defaults(self):
        sh = make_st()
        assert sh.replica_id == 0
        assert sh.prepend_axis_num == 0
        assert sh.allow_shape_mismatch is False
        assert sh.flattened_range is None

    def test_shapes_are_normalised_to_int_tuples(self):
        sh = ShardedTensor(
            "k", None, torch.float32, [2, np.int64(3)], torch.Size([4, 3]), [2, 0], [2, 1], replica_id=[0, 0]
        )
        assert sh.local_shape == (2, 3) and type(sh.local_shape[1]) is int
        assert sh.global_shape == (4, 3) and isinstance(sh.global_shape, tuple)
        assert sh.global_offset == (2, 0)
        assert sh.axis_fragmentations == (2, 1)
        assert sh.replica_id == (0, 0)

    def test_axis_fragmentations_may_be_none(self):
        assert make_st(axis_fragmentations=None).axis_fragmentations is None

    def test_str_names_key(self):
        assert "my.key" in str(make_st(key="my.key"))

    def test_errors_are_value_errors_in_the_family(self):
        with pytest.raises(InvalidShardedTensorError) as info:
            make_st(global_shape=(1, 3))
        assert isinstance(info.value, CheckpointingException)
        assert isinstance(info.value, ValueError)


class TestShardedTensorValidation:
    @pytest.mark.parametrize(
        "field, value",
        [("local_shape", (2, True)), ("global_offset", (2, -1)), ("global_shape", (4, 3.0))],
        ids=["bool", "negative", "float"],
    )
    def test_plain_tuples_are_checked_like_any_sequence(self, field, value):
        # tuples of ints take a fast path; a bool, a negative or a float in a tuple must not
        with pytest.raises(InvalidShardedTensorError, match=field):
            make_st(**{field: value})

    @pytest.mark.parametrize("key", ["", None, 5])
    def test_bad_key(self, key):
        with pytest.raises(InvalidShardedTensorError, match="non-empty str"):
            make_st(key=key)

    def test_bad_dtype(self):
        with raises_naming(InvalidShardedTensorError, "bad.dtype"):
            make_st(key="bad.dtype", dtype="float32")

    @pytest.mark.parametrize(
        "field_name, value",
        [
            ("local_shape", 3),
            ("global_shape", None),
            ("global_offset", (0, -1)),
            ("local_shape", (2, -3)),
            ("axis_fragmentations", 7),
            ("global_shape", ("a", "b")),
            ("local_shape", (2.5, 3)),
        ],
    )
    def test_bad_int_sequences(self, field_name, value):
        with raises_naming(InvalidShardedTensorError, "seq.key"):
            make_st(key="seq.key", **{field_name: value})

    @pytest.mark.parametrize("replica_id", [-1, (0, -1), "0", True, 1.0, (0, True)])
    def test_bad_replica_id(self, replica_id):
        with raises_naming(InvalidShardedTensorError, "rep.key"):
            make_st(key="rep.key", replica_id=replica_id)

    @pytest.mark.parametrize("prepend", [-1, 1.5, "1"])
    def test_bad_prepend_axis_num(self, prepend):
        with raises_naming(InvalidShardedTensorError, "pre.key"):
            make_st(key="pre.key", prepend_axis_num=prepend)

    def test_offset_length_mismatch(self):
        with raises_naming(InvalidShardedTensorError, "off.key"):
            make_st(key="off.key", global_offset=(0,))

    def test_local_shape_plus_prepend_must_match_global_ndim(self):
        with raises_naming(InvalidShardedTensorError, "nd.key"):
            make_st(key="nd.key", local_shape=(2, 3, 1))
        with raises_naming(InvalidShardedTensorError, "nd.key"):
            make_st(key="nd.key", prepend_axis_num=1)

    def test_axis_fragmentations_length(self):
        with raises_naming(InvalidShardedTensorError, "fr.key"):
            make_st(key="fr.key", axis_fragmentations=(2,))

    def test_shard_must_lie_inside_global_tensor(self):
        with raises_naming(InvalidShardedTensorError, "out.key"):
            make_st(key="out.key", global_offset=(4, 0))
        with raises_naming(InvalidShardedTensorError, "out.key"):
            make_st(key="out.key", global_shape=(4, 2), global_offset=(0, 0))

    def test_offset_must_be_multiple_of_local_size(self):
        with raises_naming(InvalidShardedTensorError, "grid.key"):
            make_st(key="grid.key", global_shape=(5, 3), global_offset=(1, 0))

    def test_uneven_last_shard_is_allowed(self):
        sh = make_st(global_shape=(5, 3), global_offset=(2, 0), axis_fragmentations=None)
        assert sh.global_shape == (5, 3)

    @pytest.mark.parametrize("rng", [slice(0, 4, 2), slice(-1, 3), slice(2, 1), slice(0, 7), slice(None, 3), (0, 3)])
    def test_bad_flattened_range(self, rng):
        with raises_naming(InvalidShardedTensorError, "flat.key"):
            make_st(key="flat.key", flattened_range=rng)

    def test_data_must_be_a_tensor(self):
        with raises_naming(InvalidShardedTensorError, "data.key"):
            make_st(key="data.key", data=np.zeros((2, 3), dtype=np.float32))

    def test_data_dtype_must_match(self):
        with raises_naming(InvalidShardedTensorError, "data.key"):
            make_st(key="data.key", data=torch.zeros(2, 3, dtype=torch.float64))

    def test_data_shape_must_match(self):
        with raises_naming(InvalidShardedTensorError, "data.key"):
            make_st(key="data.key", data=torch.zeros(3, 2))

    def test_flat_data_must_match_range(self):
        ok = make_st(data=torch.zeros(4), flattened_range=slice(1, 5))
        assert ok.flattened_range == slice(1, 5)
        with raises_naming(InvalidShardedTensorError, "flat.key"):
            make_st(key="flat.key", data=torch.zeros(3), flattened_range=slice(1, 5))
        with raises_naming(InvalidShardedTensorError, "flat.key"):
            make_st(key="flat.key", data=torch.zeros(2, 2), flattened_range=slice(1, 5))

    def test_validate_metadata_integrity_after_mutation(self):
        sh = make_st(key="mut.key")
        sh.validate_metadata_integrity()  # valid as constructed
        sh.global_offset = (3, 0)
        with raises_naming(InvalidShardedTensorError, "mut.key"):
            sh.validate_metadata_integrity()
        sh.global_offset = (2, 0)
        sh.data = torch.zeros(2, 3, dtype=torch.int32)
        with raises_naming(InvalidShardedTensorError, "mut.key"):
            sh.validate_metadata_integrity()


# --------------------------------------------------------------------------- constructors


class TestFromRankOffsets:
    def test_no_offsets_is_the_whole_tensor(self):
        data = torch.zeros(3, 4, dtype=torch.bfloat16)
        sh = ShardedTensor.from_rank_offsets("w", data)
        assert sh.data is data
        assert sh.dtype == torch.bfloat16
        assert sh.local_shape == sh.global_shape == (3, 4)
        assert sh.global_offset == (0, 0)
        assert sh.axis_fragmentations == (1, 1)
        assert sh.replica_id == 0

    def test_two_axes(self):
        data = torch.zeros(3, 4)
        sh = ShardedTensor.from_rank_offsets("w", data, (0, 2, 5), (1, 1, 2), replica_id=3)
        assert sh.global_shape == (15, 8)
        assert sh.global_offset == (6, 4)
        assert sh.axis_fragmentations == (5, 2)
        assert sh.replica_id == 3

    def test_prepend_axis_num(self):
        data = torch.zeros(3, 4)
        sh = ShardedTensor.from_rank_offsets("w", data, (0, 2, 4), (2, 1, 2), prepend_axis_num=1)
        assert sh.prepend_axis_num == 1
        assert sh.local_shape == (3, 4)
        assert sh.full_local_shape == (1, 3, 4)
        assert sh.global_shape == (4, 3, 8)
        assert sh.global_offset == (2, 0, 4)
        assert sh.axis_fragmentations == (4, 1, 2)

    def test_prepend_axis_without_offset_has_size_one(self):
        sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2), prepend_axis_num=2)
        assert sh.global_shape == (1, 1, 2)
        assert sh.global_offset == (0, 0, 0)

    def test_init_kwargs_pass_through(self):
        sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2), allow_shape_mismatch=True)
        assert sh.allow_shape_mismatch is True

    @pytest.mark.parametrize("offsets", [((2, 0, 2),), ((-1, 0, 2),)])
    def test_bad_axis(self, offsets):
        with raises_naming(InvalidShardedTensorError, "bad.axis"):
            ShardedTensor.from_rank_offsets("bad.axis", torch.zeros(2, 2), *offsets)

    def test_prepended_axis_counts_as_axis(self):
        ShardedTensor.from_rank_offsets("w", torch.zeros(2, 2), (2, 0, 2), prepend_axis_num=1)
        with raises_naming(InvalidShardedTensorError, "bad.axis"):
            ShardedTensor.from_rank_offsets("bad.axis", torch.zeros(2, 2), (3, 0, 2), prepend_axis_num=1)

    @pytest.mark.parametrize("offset", [(0, 2, 2), (0, -1, 2), (0, 0, 0), (0, 3, 1)])
    def test_bad_offset(self, offset):
        with raises_naming(InvalidShardedTensorError, "bad.off"):
            ShardedTensor.from_rank_offsets("bad.off", torch.zeros(2, 2), offset)

    def test_duplicate_axis(self):
        with raises_naming(InvalidShardedTensorError, "dup.axis"):
            ShardedTensor.from_rank_offsets("dup.axis", torch.zeros(2, 2), (0, 0, 2), (0, 1, 2))

    def test_bad_tuple_length(self):
        with raises_naming(InvalidShardedTensorError, "len.key"):
            ShardedTensor.from_rank_offsets("len.key", torch.zeros(2, 2), (0, 1))

    @pytest.mark.parametrize(
        "offsets, kwargs",
        [
            (((0, "x", 2),), {}),
            (((None, 0, 2),), {}),
            ((5,), {}),
            (((0, 0.5, 2),), {}),
            ((), {"prepend_axis_num": 1.5}),
            ((), {"prepend_axis_num": -1}),
        ],
        ids=["str-offset", "none-axis", "not-a-tuple", "float-offset", "float-prepend", "negative-prepend"],
    )
    def test_malformed_arguments(self, offsets, kwargs):
        with raises_naming(InvalidShardedTensorError, "mal.key"):
            ShardedTensor.from_rank_offsets("mal.key", torch.zeros(2, 2), *offsets, **kwargs)

    def test_data_must_be_a_tensor(self):
        with raises_naming(InvalidShardedTensorError, "np.key"):
            ShardedTensor.from_rank_offsets("np.key", np.zeros(2))

    def test_flattened_range_is_refused(self):
        with raises_naming(InvalidShardedTensorError, "flat.key"):
            ShardedTensor.from_rank_offsets("flat.key", torch.zeros(4), flattened_range=slice(0, 2))

    def test_bad_key(self):
        with pytest.raises(InvalidShardedTensorError):
            ShardedTensor.from_rank_offsets("", torch.zeros(2))


class TestFromRankOffsetsFlat:
    def test_fields(self):
        data = torch.arange(5, dtype=torch.float64)
        sh = ShardedTensor.from_rank_offsets_flat(
            "f", data, (3, 4), (0, 1, 2), flattened_range=slice(5, 10), replica_id=1
        )
        assert sh.data is data
        assert sh.dtype == torch.float64
        assert sh.local_shape == (3, 4)
        assert sh.global_shape == (6, 4)
        assert sh.global_offset == (3, 0)
        assert sh.axis_fragmentations == (2, 1)
        assert sh.flattened_range == slice(5, 10)
        assert sh.replica_id == 1

    def test_prepend(self):
        sh = ShardedTensor.from_rank_offsets_flat(
            "f", torch.zeros(2), (3, 4), (0, 1, 3), flattened_range=slice(0, 2), prepend_axis_num=1
        )
        assert sh.global_shape == (3, 3, 4)
        assert sh.global_offset == (1, 0, 0)

    def test_needs_flattened_range(self):
        with raises_naming(InvalidShardedTensorError, "f.key"):
            ShardedTensor.from_rank_offsets_flat("f.key", torch.zeros(2), (3, 4))

    def test_data_must_be_1d(self):
        with raises_naming(InvalidShardedTensorError, "f.key"):
            ShardedTensor.from_rank_offsets_flat("f.key", torch.zeros(1, 2), (3, 4), flattened_range=slice(0, 2))

    def test_range_must_fit(self):
        with raises_naming(InvalidShardedTensorError, "f.key"):
            ShardedTensor.from_rank_offsets_flat("f.key", torch.zeros(3), (3, 4), flattened_range=slice(11, 14))
        with raises_naming(InvalidShardedTensorError, "f.key"):
            ShardedTensor.from_rank_offsets_flat("f.key", torch.zeros(3), (3, 4), flattened_range=slice(0, 2))

    @pytest.mark.parametrize("shape", ["ab", (-2,), (2.5,)])
    def test_bad_non_flat_shape(self, shape):
        with raises_naming(InvalidShardedTensorError, "f.key"):
            ShardedTensor.from_rank_offsets_flat("f.key", torch.zeros(2), shape, flattened_range=slice(0, 2))

    def test_bad_offsets_name_key(self):
        with raises_naming(InvalidShardedTensorError, "f.key"):
            ShardedTensor.from_rank_offsets_flat(
                "f.key", torch.zeros(2), (3, 4), (5, 0, 2), flattened_range=slice(0, 2)
            )


# --------------------------------------------------------------------------- geometry methods


def _global_of(sh: ShardedTensor, full_local: torch.Tensor) -> torch.Tensor:
    """A global tensor (NaN elsewhere) with ``full_local`` placed at the shard's position."""
    g = torch.full(sh.global_shape, float("nan"), dtype=torch.float64)
    g[sh.global_slice()] = full_local
    return g


class TestGlobalSlice:
    def test_plain(self):
        sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 1, 3), (1, 2, 4))
        assert sh.global_slice() == (slice(2, 4), slice(6, 9))

    def test_prepended_axes_are_ints(self):
        sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 3, 5), (2, 1, 2), prepend_axis_num=1)
        assert sh.global_slice() == (3, slice(0, 2), slice(3, 6))

    def test_indexes_the_local_data(self):
        full = torch.arange(5 * 4 * 6, dtype=torch.float64).reshape(5, 4, 6)
        for stage in range(5):
            for part in range(2):
                local = full[stage, :, part * 3 : (part + 1) * 3].clone()
                sh = ShardedTensor.from_rank_offsets("w", local, (0, stage, 5), (2, part, 2), prepend_axis_num=1)
                assert torch.equal(full[sh.global_slice()], local)

    def test_zero_d(self):
        sh = ShardedTensor.from_rank_offsets("s", torch.tensor(3.0))
        assert sh.global_slice() == ()
        assert sh.global_shape == ()


class TestCoordinates:
    @staticmethod
    def brute_local(local_shape, rng):
        mask = np.zeros(math.prod(local_shape), dtype=bool)
        mask[rng] = True
        return np.nonzero(mask.reshape(local_shape))

    @pytest.mark.parametrize(
        "local_shape, rng",
        [
            ((3, 4), slice(5, 10)),
            ((3, 4), slice(0, 12)),
            ((3, 4), slice(4, 4)),
            ((2, 3, 4), slice(3, 21)),
            ((7,), slice(2, 5)),
        ],
    )
    @pytest.mark.parametrize("prepend", [0, 1])
    def test_against_numpy(self, local_shape, rng, prepend):
        data = torch.zeros(rng.stop - rng.start)
        ndim = len(local_shape) + prepend
        rank_offsets = [(prepend, 1, 2)] + ([(0, 2, 3)] if prepend else [])
        sh = ShardedTensor.from_rank_offsets_flat(
            "f", data, local_shape, *rank_offsets, flattened_range=rng, prepend_axis_num=prepend
        )
        expected_local = self.brute_local(local_shape, rng)
        got_local = sh.local_coordinates()
        assert len(got_local) == len(local_shape)
        for a, b in zip(got_local, expected_local):
            np.testing.assert_array_equal(a, b)
        got_global = sh.global_coordinates()
        assert len(got_global) == ndim
        # brute force: mark the held elements in a full local tensor, place it globally, find them
        full_local = np.zeros(local_shape, dtype=bool)
        full_local.reshape(-1)[rng] = True
        glob = np.zeros(sh.global_shape, dtype=bool)
        idx = tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sh.full_local_shape))
        glob[idx] = full_local.reshape(sh.full_local_shape)
        expected_global = np.nonzero(glob)
        for a, b in zip(got_global, expected_global):
            np.testing.assert_array_equal(a, b)

    def test_coordinates_index_the_data(self):
        full = torch.arange(6 * 4, dtype=torch.float64).reshape(6, 4)
        local = full[3:6]
        rng = slice(2, 9)
        sh = ShardedTensor.from_rank_offsets_flat("f", local.flatten()[rng], (3, 4), (0, 1, 2), flattened_range=rng)
        assert torch.equal(full[tuple(torch.from_numpy(c) for c in sh.global_coordinates())], sh.data)
        assert torch.equal(local[tuple(torch.from_numpy(c) for c in sh.local_coordinates())], sh.data)

    def test_undefined_without_flattened_range(self):
        sh = make_st(key="nf.key")
        with raises_naming(InvalidShardedTensorError, "nf.key"):
            sh.local_coordinates()
        with raises_naming(InvalidShardedTensorError, "nf.key"):
            sh.global_coordinates()


class TestChunks:
    def test_local_chunk_offset_in_global(self):
        sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 2, 4), (1, 1, 3))
        assert sh.local_chunk_offset_in_global() == (2, 1)

    def test_local_chunk_offset_with_prepend(self):
        sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 3, 5), (1, 1, 2), prepend_axis_num=1)
        assert sh.local_chunk_offset_in_global() == (3, 1, 0)

    def test_local_chunk_offset_brute_force(self):
        for i in range(3):
            for j in range(2):
                sh = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 5), (0, i, 3), (1, j, 2))
                grid_index = tuple(o // s for o, s in zip(sh.global_offset, sh.local_shape))
                assert sh.local_chunk_offset_in_global() == grid_index == (i, j)

    def test_max_allowed_chunks(self):
        sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 1, 4), (1, 0, 3))
        assert sh.max_allowed_chunks() == (2, 3)

    def test_max_allowed_chunks_needs_fragmentations(self):
        with raises_naming(InvalidShardedTensorError, "mc.key"):
            make_st(key="mc.key", axis_fragmentations=None).max_allowed_chunks()

    def test_max_allowed_chunks_indivisible(self):
        sh = make_st(key="mc.key", global_shape=(5, 3), axis_fragmentations=(2, 1))
        with raises_naming(InvalidShardedTensorError, "mc.key"):
            sh.max_allowed_chunks()
        loose = make_st(key="mc.key", global_shape=(5, 3), axis_fragmentations=(2, 1), allow_shape_mismatch=True)
        assert loose.max_allowed_chunks() == (2, 3)

    def test_max_allowed_chunks_zero_fragments(self):
        sh = make_st(key="mc.key", axis_fragmentations=(0, 1))
        with raises_naming(InvalidShardedTensorError, "mc.key"):
            sh.max_allowed_chunks()


class TestInitAndWithoutData:
    def test_init_data_allocates(self):
        sh = make_st(dtype=torch.bfloat16)
        sh.init_data("cpu")
        assert isinstance(sh.data, torch.Tensor)
        assert sh.data.shape == (2, 3) and sh.data.dtype == torch.bfloat16 and sh.data.device.type == "cpu"

    def test_init_data_uses_init_fn(self):
        calls = []

        def init_fn(shape, dtype, device):
            calls.append((tuple(shape), dtype, torch.device(device)))
            return torch.full(tuple(shape), 5, dtype=dtype, device=device)

        sh = make_st(dtype=torch.int32)
        sh.init_data(torch.device("cpu"), init_fn)
        assert calls == [((2, 3), torch.int32, torch.device("cpu"))]
        assert torch.equal(sh.data, torch.full((2, 3), 5, dtype=torch.int32))

    def test_init_data_flat(self):
        sh = make_st(flattened_range=slice(1, 5))
        sh.init_data("cpu", torch.zeros)
        assert sh.data.shape == (4,)
        sh.validate_metadata_integrity()

    def test_init_data_keeps_existing(self):
        data = torch.ones(2, 3)
        sh = make_st(data=data)
        sh.init_data("cpu", torch.zeros)
        assert sh.data is data
        assert torch.equal(sh.data, torch.ones(2, 3))

    def test_without_data(self):
        data = torch.ones(2, 3)
        sh = make_st(data=data, replica_id=(1, 0), allow_shape_mismatch=True)
        meta = sh.without_data()
        assert meta.data is None
        assert sh.data is data
        for f in fields(ShardedTensor):
            if f.name != "data":
                assert getattr(meta, f.name) == getattr(sh, f.name)

    def test_without_data_flat(self):
        sh = make_st(data=torch.zeros(4), flattened_range=slice(1, 5))
        assert sh.without_data().flattened_range == slice(1, 5)


# --------------------------------------------------------------------------- narrow


class TestNarrow:
    def test_non_flat(self):
        full = torch.arange(12 * 4, dtype=torch.float32).reshape(12, 4)
        local = full[6:12]
        sh = ShardedTensor.from_rank_offsets("qkv", local, (0, 1, 2), replica_id=1)
        (out,) = sh.narrow(0, 2, 2)
        assert out.key == "qkv"
        assert out.local_shape == (2, 4)
        assert out.global_shape == (4, 4)
        assert out.global_offset == (2, 0)
        assert out.replica_id == 1
        assert torch.equal(out.data, local[2:4])
        assert out.data.data_ptr() == local[2:4].data_ptr()  # a view, no copy
        assert sh.local_shape == (6, 4)  # the original is unchanged

    def test_non_flat_matches_narrowing_every_rank(self):
        # narrowing each rank's local tensor must describe the narrowed global tensor
        full = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
        shards = [ShardedTensor.from_rank_offsets("w", full[:, 4 * r : 4 * r + 4], (1, r, 2)) for r in range(2)]
        narrowed_full = torch.cat([full[:, 4 * r + 1 : 4 * r + 3] for r in range(2)], dim=1)
        for sh in shards:
            (out,) = sh.narrow(1, 1, 2)
            assert out.global_shape == tuple(narrowed_full.shape)
            assert torch.equal(narrowed_full[out.global_slice()], out.data)

    def test_with_prepend(self):
        sh = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, 1, 3), (1, 1, 2), prepend_axis_num=1)
        (out,) = sh.narrow(0, 0, 2)
        assert out.global_shape == (3, 4, 6)
        assert out.global_offset == (1, 2, 0)
        assert out.local_shape == (2, 6)

    def test_without_data(self):
        (out,) = make_st().narrow(1, 0, 1)
        assert out.data is None and out.local_shape == (2, 1) and out.global_shape == (4, 1)

    @pytest.mark.parametrize("start, length", [(s, n) for s in range(4) for n in range(0, 5 - s)])
    def test_flat_against_brute_force(self, start, length):
        local_shape = (4, 3)
        full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
        local = full[4:8]  # rank 1 of 2
        rng = slice(4, 10)
        sh = ShardedTensor.from_rank_offsets_flat(
            "f", local.flatten()[rng].clone(), local_shape, (0, 1, 2), flattened_range=rng
        )
        result = sh.narrow(0, start, length)
        row = 3
        lo, hi = max(rng.start, start * row), min(rng.stop, (start + length) * row)
        if hi <= lo:
            assert result == []
            return
        (out,) = result
        assert out.local_shape == (length, 3)
        assert out.global_shape == (2 * length, 3)
        assert out.global_offset == (length, 0)
        assert out.flattened_range == slice(lo - start * row, hi - start * row)
        expected = local.narrow(0, start, length).flatten()[out.flattened_range]
        assert torch.equal(out.data, expected)
        # the narrowed data is still exactly what global_coordinates point at
        narrowed_full = torch.cat([full[0:4].narrow(0, start, length), full[4:8].narrow(0, start, length)])
        coords = tuple(torch.from_numpy(c) for c in out.global_coordinates())
        assert torch.equal(narrowed_full[coords], out.data)

    def test_flat_empty_result(self):
        sh = ShardedTensor.from_rank_offsets_flat("f", torch.zeros(3), (3, 4), flattened_range=slice(0, 3))
        assert sh.narrow(0, 1, 2) == []

    def test_flat_only_dim0(self):
        sh = ShardedTensor.from_rank_offsets_flat("flat.key", torch.zeros(3), (3, 4), flattened_range=slice(0, 3))
        with raises_naming(InvalidShardedTensorError, "flat.key"):
            sh.narrow(1, 0, 2)

    @pytest.mark.parametrize("args", [(2, 0, 1), (-1, 0, 1), (0, 1, 2), (0, -1, 1), (0, 0, 3)])
    def test_out_of_range(self, args):
        with raises_naming(InvalidShardedTensorError, "n.key"):
            make_st(key="n.key").narrow(*args)

    def test_indivisible(self):
        sh = make_st(
            key="n.key", local_shape=(4, 3), global_shape=(10, 3), global_offset=(4, 0), axis_fragmentations=None
        )
        (ok,) = sh.narrow(0, 0, 2)
        assert ok.global_shape == (5, 3)
        with raises_naming(InvalidShardedTensorError, "n.key"):
            sh.narrow(0, 0, 1)


# --------------------------------------------------------------------------- ShardedObject


class TestShardedObject:
    def test_fields(self):
        obj = {"a": 1}
        so = ShardedObject("o", obj, (2, 3), (1, 2), replica_id=(0, 1))
        assert so.key == "o" and so.data is obj
        assert so.global_shape == (2, 3) and so.global_offset == (1, 2) and so.replica_id == (0, 1)
        assert isinstance(so, ShardedBase)
        assert [f.name for f in fields(ShardedObject)] == ["key", "data", "global_shape", "global_offset", "replica_id"]

    def test_unique_key(self):
        assert ShardedObject("a/b", None, (2, 3), (1, 2)).unique_key == "a/b/shard_1.2_2.3"
        assert ShardedObject("x", None, (4,), (0,)).unique_key == "x/shard_0_4"

    @pytest.mark.parametrize(
        "key, shape, offset",
        [
            ("o", (2, 3), (1, 2)),
            ("nested/key/with_shard", (5,), (4,)),
            ("x", (), ()),
            ("a.b_c/shard_0_1", (1, 1, 10), (0, 0, 9)),
        ],
    )
    def test_unique_key_round_trip(self, key, shape, offset):
        so = ShardedObject(key, "payload", shape, offset, replica_id=2)
        back = ShardedObject.empty_from_unique_key(so.unique_key, replica_id=5)
        assert back.key == key
        assert back.global_shape == tuple(shape)
        assert back.global_offset == tuple(offset)
        assert back.data is None
        assert back.replica_id == 5
        assert back.unique_key == so.unique_key

    @pytest.mark.parametrize("unique_key", ["no_shard_here", "k/shard_1", "k/shard_1_2_3", "k/shard_a_b"])
    def test_bad_unique_key(self, unique_key):
        with pytest.raises(CheckpointingException):
            ShardedObject.empty_from_unique_key(unique_key)

    def test_bad_unique_key_is_named(self):
        with pytest.raises(InvalidShardedTensorError, match="no_shard_here"):
            ShardedObject.empty_from_unique_key("no_shard_here")

    @pytest.mark.parametrize("shape, offset", [((2,), (2,)), ((2,), (0, 0)), ((2,), (-1,)), ("ab", (0,))])
    def test_bad_geometry(self, shape, offset):
        with raises_naming(InvalidShardedTensorError, "obj.key"):
            ShardedObject("obj.key", None, shape, offset)

    def test_bad_replica(self):
        with raises_naming(InvalidShardedTensorError, "obj.key"):
            ShardedObject("obj.key", None, (1,), (0,), replica_id=-2)

    def test_bad_key(self):
        with pytest.raises(InvalidShardedTensorError):
            ShardedObject("", None, (1,), (0,))

    def test_without_data(self):
        so = ShardedObject("o", [1, 2], (2,), (1,), replica_id=1)
        meta = so.without_data()
        assert meta.data is None and so.data == [1, 2]
        assert (meta.key, meta.global_shape, meta.global_offset, meta.replica_id) == ("o", (2,), (1,), 1)

    def test_validate_after_mutation(self):
        so = ShardedObject("obj.key", None, (2,), (1,))
        so.global_offset = (2,)
        with raises_naming(InvalidShardedTensorError, "obj.key"):
            so.validate_metadata_integrity()

    def test_str(self):
        assert "obj.key" in str(ShardedObject("obj.key", None, (1,), (0,)))


# --------------------------------------------------------------------------- factories


def _split_build(key, data, replica_id):
    half = data.shape[0] // 2
    return {
        "a": ShardedTensor.from_rank_offsets(f"{key}.a", data[:half], replica_id=replica_id),
        "b": ShardedTensor.from_rank_offsets(f"{key}.b", data[half:], replica_id=replica_id),
    }


def _split_merge(sub):
    return torch.cat([sub["a"], sub["b"]])


class TestShardedTensorFactory:
    def test_fields_and_build_three_args(self):
        data = torch.arange(6.0)
        f = ShardedTensorFactory("fac", data, _split_build, _split_merge, replica_id=1)
        assert f.key == "fac" and f.data is data and f.replica_id == 1 and f.flattened_range is None
        built = f.build()
        assert set(built) == {"a", "b"}
        assert built["a"].key == "fac.a" and built["b"].key == "fac.b"
        assert built["a"].replica_id == 1
        assert torch.equal(_split_merge({"a": built["a"].data, "b": built["b"].data}), data)

    def test_build_four_args_receives_flattened_range(self):
        seen = []

        def build(key, data, replica_id, flattened_range):
            seen.append((key, replica_id, flattened_range))
            return {"x": ShardedTensor.from_rank_offsets_flat(key, data, (4,), flattened_range=flattened_range)}

        f = ShardedTensorFactory(
            "fac", torch.zeros(2), build, lambda sub: sub["x"], replica_id=(0, 2), flattened_range=slice(1, 3)
        )
        built = f.build()
        assert seen == [("fac", (0, 2), slice(1, 3))]
        assert built["x"].flattened_range == slice(1, 3)

    def test_four_arg_build_without_range_gets_none(self):
        seen = []

        def build(key, data, replica_id, flattened_range=None):
            seen.append(flattened_range)
            return {}

        ShardedTensorFactory("fac", torch.zeros(2), build, lambda s: s).build()
        assert seen == [None]

    def test_varargs_build_gets_four(self):
        seen = []

        def build(*args):
            seen.append(len(args))
            return {}

        ShardedTensorFactory("fac", torch.zeros(2), build, lambda s: s).build()
        assert seen == [4]

    def test_three_arg_build_with_range_raises(self):
        f = ShardedTensorFactory("fac.key", torch.zeros(2), _split_build, _split_merge, flattened_range=slice(0, 2))
        with raises_naming(InvalidShardedTensorError, "fac.key"):
            f.build()

    @pytest.mark.parametrize("which", ["build_fn", "merge_fn"])
    def test_not_callable(self, which):
        kwargs = {"build_fn": _split_build, "merge_fn": _split_merge, which: "nope"}
        with raises_naming(InvalidShardedTensorError, "fac.key"):
            ShardedTensorFactory("fac.key", torch.zeros(2), **kwargs)

    def test_bad_replica_and_key(self):
        with raises_naming(InvalidShardedTensorError, "fac.key"):
            ShardedTensorFactory("fac.key", torch.zeros(2), _split_build, _split_merge, replica_id=-1)
        with pytest.raises(InvalidShardedTensorError):
            ShardedTensorFactory("", torch.zeros(2), _split_build, _split_merge)

    def test_without_data(self):
        f = ShardedTensorFactory("fac", torch.zeros(2), _split_build, _split_merge)
        meta = f.without_data()
        assert meta.data is None and meta.build_fn is _split_build and f.data is not None
        assert "fac" in str(f)


class TestApplyFactories:
    def test_apply_factories_and_merges_round_trip(self):
        data = torch.arange(8.0)
        other = ShardedTensor.from_rank_offsets("plain", torch.ones(2))
        sd = {
            "top": ShardedTensorFactory("top", data, _split_build, _split_merge),
            "nested": {"lst": [1, ShardedTensorFactory("inner", data * 2, _split_build, _split_merge)]},
            "plain": other,
            "common": 5,
        }
        factories = {"top": sd["top"], "nested": {"lst": {1: sd["nested"]["lst"][1]}}}
        apply_factories(sd)
        assert isinstance(sd["top"], dict) and sd["top"]["a"].key == "top.a"
        assert sd["nested"]["lst"][0] == 1
        assert sd["nested"]["lst"][1]["b"].key == "inner.b"
        assert sd["plain"] is other and sd["common"] == 5
        # simulate a load: replace every ShardedTensor by its data
        loaded = {
            "top": {"a": sd["top"]["a"].data, "b": sd["top"]["b"].data},
            "nested": {"lst": [1, {"a": data[:4] * 2, "b": data[4:] * 2}]},
            "plain": torch.ones(2),
            "common": 5,
        }
        out = apply_factory_merges(loaded, factories)
        assert out is loaded
        assert torch.equal(out["top"], data)
        assert torch.equal(out["nested"]["lst"][1], data * 2)
        assert out["nested"]["lst"][0] == 1 and out["common"] == 5

    def test_merge_list_against_list(self):
        f = ShardedTensorFactory("f", torch.zeros(2), _split_build, _split_merge)
        out = apply_factory_merges({"l": [{"a": torch.ones(1), "b": torch.zeros(1)}]}, {"l": [f]})
        assert torch.equal(out["l"][0], torch.tensor([1.0, 0.0]))

    def test_merge_missing_key_names_it(self):
        f = ShardedTensorFactory("f", torch.zeros(2), _split_build, _split_merge)
        with pytest.raises(StateDictStructureError, match="missing_one"):
            apply_factory_merges({"outer": {"x": 1}}, {"outer": {"missing_one": f}})

    def test_merge_list_length_mismatch(self):
        f = ShardedTensorFactory("f", torch.zeros(2), _split_build, _split_merge)
        with pytest.raises(StateDictStructureError, match="lst"):
            apply_factory_merges({"lst": [1, 2]}, {"lst": [f]})

    def test_merge_bad_index(self):
        f = ShardedTensorFactory("f", torch.zeros(2), _split_build, _split_merge)
        with pytest.raises(StateDictStructureError, match="lst"):
            apply_factory_merges({"lst": [1]}, {"lst": {3: f}})

    def test_merge_type_mismatch(self):
        f = ShardedTensorFactory("f", torch.zeros(2), _split_build, _split_merge)
        with pytest.raises(StateDictStructureError, match="deep"):
            apply_factory_merges({"deep": 5}, {"deep": {"x": f}})


# --------------------------------------------------------------------------- misc


class TestLocalNonPersistent:
    def test_unwrap_and_aliases(self):
        obj = object()
        wrapped = LocalNonPersistentObject(obj)
        assert wrapped.unwrap() is obj and wrapped.obj is obj
        assert LocalNonpersistentObject is LocalNonPersistentObject
        assert LocalNonpersitentObject is LocalNonPersistentObject
        assert dist_ckpt.LocalNonpersitentObject is LocalNonPersistentObject
        assert isinstance(LocalNonpersitentObject([1]), LocalNonPersistentObject)
        assert "LocalNonPersistentObject" in repr(LocalNonpersistentObject(3))
        assert "3" in repr(LocalNonpersistentObject(3))


class TestIsMainReplica:
    @pytest.mark.parametrize(
        "replica_id, expected",
        [
            (0, True),
            (1, False),
            (7, False),
            ((0,), True),
            ((0, 0, 0), True),
            ((0, 1), False),
            ((2, 0), False),
            ([0, 0], True),
        ],
    )
    def test_values(self, replica_id, expected):
        assert is_main_replica(replica_id) is expected


def test_sharded_base_is_abstract():
    with pytest.raises(TypeError):
        ShardedBase()  # type: ignore[abstract]
    for cls in (ShardedTensor, ShardedObject, ShardedTensorFactory):
        assert issubclass(cls, ShardedBase)
    assert not issubclass(LocalNonPersistentObject, ShardedBase)
