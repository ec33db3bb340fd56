"""tiling_problem: exact covers pass, duplicates, overlaps and gaps are named, in any layout."""

from __future__ import annotations

import random

from dist_ckpt.model import tiling
from dist_ckpt.model.tiling import tiling_problem


def test_exact_tilings_pass():
    assert tiling_problem((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))]) is None
    assert tiling_problem((5, 3), [((0, 0), (3, 3)), ((3, 0), (2, 2)), ((3, 2), (2, 1))]) is None  # uneven
    # not a guillotine cut anywhere: a pinwheel of four boxes around a centre cell
    pinwheel = [((0, 0), (2, 1)), ((0, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 0), (1, 2)), ((1, 1), (1, 1))]
    assert tiling_problem((3, 3), pinwheel) is None
    assert tiling_problem((), [((), ())]) is None  # a scalar
    assert tiling_problem((0, 4), [((0, 0), (0, 4)), ((0, 2), (0, 2))]) is None  # nothing to cover
    assert tiling_problem((4,), [((0,), (4,)), ((4,), (0,))]) is None  # an empty chunk at the end


def test_duplicates_are_counted():
    problem = tiling_problem((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))] * 3)
    assert problem is not None and "[0, 0] is listed 3 times (and 1 other offsets)" in problem


def test_overlaps_and_gaps_are_told_apart():
    assert "overlap" in (tiling_problem((4,), [((0,), (3,)), ((2,), (2,))]) or "")
    assert "gap" in (tiling_problem((6,), [((0,), (3,)), ((3,), (2,))]) or "")
    # as many elements as the tensor: row 1 twice, row 3 never
    both = tiling_problem((4, 4), [((0, 0), (2, 4)), ((1, 0), (2, 4))])
    assert both is not None and "overlap and leave a gap" in both


def test_random_grids_and_one_change():
    rng = random.Random(0)
    for _ in range(200):
        cuts = [sorted({0, *rng.sample(range(1, 9), rng.randrange(0, 4)), 9}) for _ in range(3)]
        boxes = []
        for a in zip(cuts[0], cuts[0][1:]):
            for b in zip(cuts[1], cuts[1][1:]):
                for c in zip(cuts[2], cuts[2][1:]):
                    boxes.append(((a[0], b[0], c[0]), (a[1] - a[0], b[1] - b[0], c[1] - c[0])))
        rng.shuffle(boxes)
        assert tiling_problem((9, 9, 9), boxes) is None
        if len(boxes) > 1:
            (o, s), rest = boxes[0], boxes[1:]
            grown = tuple(n + 1 if i == 0 and o[0] + n < 9 else n for i, n in enumerate(s))
            assert tiling_problem((9, 9, 9), rest) is not None  # one chunk missing
            if grown != s:
                assert tiling_problem((9, 9, 9), [(o, grown)] + rest) is not None


def test_too_many_split_axes(monkeypatch):
    grid = [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2)), ((4, 4), (0, 0))]
    assert tiling_problem((4, 4), grid) is None
    monkeypatch.setattr(tiling, "MAX_SPLIT_AXES", 1)
    assert "split it along 2 axes" in (tiling_problem((4, 4), grid) or "")
    assert tiling_problem((4, 4), grid[:2] + [((2, 0), (2, 4))]) is not None  # still checked: 2 axes
    assert tiling_problem((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4)), ((4, 4), (0, 0))]) is None  # 1 axis


def test_sizes_beyond_any_tensor_are_a_problem_not_an_overflow():
    boxes = [((0, 0), (2**62, 2)), ((2**62, 0), (2**62, 2))]
    assert "beyond any tensor" in (tiling_problem((2**63, 2), boxes) or "")
