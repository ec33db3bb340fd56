"""Unit tests of dist_ckpt.model.geometry (boxes, flat ranges, views), checked against brute force."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from dist_ckpt.model.geometry import Box, ShardPiece, flat_range_boxes, piece_view, shard_pieces, sub_view


def box_flat_indices(shape, box):
    """Row-major flat indices of every element of ``box`` inside a tensor of ``shape``, in order."""
    idx = np.arange(math.prod(shape)).reshape(shape)
    return idx[tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape))].reshape(-1)


class TestBox:
    def test_properties(self):
        b = Box((1, 2), (3, 4))
        assert b.numel == 12
        assert b.stop == (4, 6)
        assert Box((), ()).numel == 1

    def test_intersect(self):
        a = Box((0, 0), (4, 4))
        assert a.intersect(Box((2, 3), (5, 5))) == Box((2, 3), (2, 1))
        assert a.intersect(Box((4, 0), (1, 1))) is None  # touching is not overlapping
        assert a.intersect(a) == a
        assert Box((), ()).intersect(Box((), ())) == Box((), ())

    def test_intersect_brute_force(self):
        rng = np.random.default_rng(0)
        for _ in range(200):
            o1, s1, o2, s2 = (tuple(int(v) for v in rng.integers(0, 5, 2)) for _ in range(4))
            a, b = Box(o1, s1), Box(o2, s2)
            ma = np.zeros((10, 10), bool)
            mb = np.zeros((10, 10), bool)
            ma[o1[0] : o1[0] + s1[0], o1[1] : o1[1] + s1[1]] = True
            mb[o2[0] : o2[0] + s2[0], o2[1] : o2[1] + s2[1]] = True
            both = ma & mb
            inter = a.intersect(b)
            if not both.any():
                assert inter is None
            else:
                mi = np.zeros((10, 10), bool)
                mi[inter.offset[0] : inter.stop[0], inter.offset[1] : inter.stop[1]] = True
                assert (mi == both).all()

    def test_intersect_rank_mismatch(self):
        with pytest.raises(ValueError):
            Box((0,), (1,)).intersect(Box((0, 0), (1, 1)))

    def test_slices_within(self):
        outer = Box((2, 10), (4, 6))
        inner = Box((3, 12), (2, 3))
        assert inner.slices_within(outer) == (slice(1, 3), slice(2, 5))
        full = torch.arange(200).reshape(10, 20)
        held = full[2:6, 10:16]
        assert torch.equal(held[inner.slices_within(outer)], full[3:5, 12:15])


SHAPES = [(7,), (3, 4), (2, 3, 4), (2, 1, 3, 2), (1, 5), (4, 1)]


class TestFlatRangeBoxes:
    @pytest.mark.parametrize("shape", SHAPES)
    def test_every_range_brute_force(self, shape):
        total = math.prod(shape)
        for start in range(total + 1):
            for stop in range(start, total + 1):
                pieces = flat_range_boxes(shape, start, stop)
                assert len(pieces) <= max(1, 2 * len(shape) - 1)
                covered = []
                for box, flat_start in pieces:
                    flat = box_flat_indices(shape, box)
                    # contiguous in the flattening and starting where it says
                    np.testing.assert_array_equal(flat, np.arange(flat_start, flat_start + box.numel))
                    covered.extend(flat.tolist())
                assert covered == list(range(start, stop))

    def test_zero_d(self):
        assert flat_range_boxes((), 0, 1) == [(Box((), ()), 0)]
        assert flat_range_boxes((), 0, 0) == []

    @pytest.mark.parametrize("start, stop", [(-1, 2), (3, 2), (0, 13)])
    def test_out_of_range(self, start, stop):
        with pytest.raises(ValueError):
            flat_range_boxes((3, 4), start, stop)


class TestShardPieces:
    def test_whole_shard(self):
        (piece,) = shard_pieces((2, 0), (2, 3))
        assert piece == ShardPiece(Box((2, 0), (2, 3)), None)

    def test_prepend(self):
        (piece,) = shard_pieces((4, 2, 0), (2, 3), prepend_axis_num=1)
        assert piece.box == Box((4, 2, 0), (1, 2, 3))

    @pytest.mark.parametrize("prepend", [0, 1])
    def test_flattened_brute_force(self, prepend):
        local_shape = (3, 4)
        full_local = (1,) * prepend + local_shape
        offset = (1,) * prepend + (3, 4)
        global_shape = tuple(o + s for o, s in zip(offset, full_local))
        for start, stop in itertools.combinations(range(13), 2):
            pieces = shard_pieces(offset, local_shape, prepend, (start, stop))
            glob = np.full(global_shape, -1)
            local = np.full(math.prod(local_shape), -1)
            local[start:stop] = np.arange(stop - start)  # position in the flat shard data
            glob[tuple(slice(o, o + s) for o, s in zip(offset, full_local))] = local.reshape(full_local)
            seen = 0
            for p in pieces:
                region = glob[tuple(slice(o, o + s) for o, s in zip(p.box.offset, p.box.shape))].reshape(-1)
                np.testing.assert_array_equal(region, np.arange(p.flat_offset, p.flat_offset + p.box.numel))
                seen += p.box.numel
            assert seen == stop - start


class TestViews:
    def test_piece_view_whole(self):
        data = torch.zeros(2, 3)
        holder = Box((2, 0), (2, 3))
        (piece,) = shard_pieces((2, 0), (2, 3))
        view = piece_view(data, piece, 0, holder)
        view.fill_(4)
        assert torch.equal(data, torch.full((2, 3), 4.0))

    def test_piece_view_prepend(self):
        data = torch.zeros(2, 3)
        holder = Box((5, 0, 0), (1, 2, 3))
        (piece,) = shard_pieces((5, 0, 0), (2, 3), 1)
        view = piece_view(data, piece, 1, holder)
        assert view.shape == (1, 2, 3)
        view[0, 1, 2] = 9
        assert data[1, 2] == 9

    def test_piece_view_flat_writes_through(self):
        local_shape = (3, 4)
        full = torch.arange(12, dtype=torch.float32).reshape(local_shape)
        start, stop = 2, 11
        data = torch.zeros(stop - start)
        holder = Box((0, 0), local_shape)
        for piece in shard_pieces((0, 0), local_shape, 0, (start, stop)):
            view = piece_view(data, piece, 0, holder)
            assert view.shape == piece.box.shape
            view.copy_(full[tuple(slice(o, o + s) for o, s in zip(piece.box.offset, piece.box.shape))])
        assert torch.equal(data, full.flatten()[start:stop])

    def test_piece_view_flat_non_contiguous_data(self):
        base = torch.zeros(20)
        data = base[::2]  # stride 2
        holder = Box((0, 0), (2, 5))
        for piece in shard_pieces((0, 0), (2, 5), 0, (0, 10)):
            piece_view(data, piece, 0, holder).fill_(1)
        assert torch.equal(base[::2], torch.ones(10))
        assert torch.equal(base[1::2], torch.zeros(10))

    def test_sub_view(self):
        full = torch.arange(30).reshape(5, 6)
        view_box = Box((1, 2), (3, 4))
        view = full[1:4, 2:6]
        region = Box((2, 3), (2, 2))
        assert torch.equal(sub_view(view, view_box, region), full[2:4, 3:5])
