"""Load requests for the torch_dist golden checkpoints at any world size, and what they must return.

The fixtures (``tests/golden/torch_dist/``, described by its ``expected.py``) were saved by
megatron-core at 2 or 4 ranks. These helpers build, for rank ``rank`` of ``world``, requests in
layouts other than the saved one -- each tensor split over the ranks along another axis, stacked
layers regrouped, flattened ranges cut at other places -- with the values each must load, so the
same checks run in one process (``tests/unit``) and at 2 and 4 ranks (``tests/distributed``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

import dist_ckpt as dc
from tests.golden.torch_dist import expected as E
from tests.paths import GOLDEN_DIR

FIXTURE_DIR: Path = GOLDEN_DIR / "torch_dist"
#: request styles: ``split`` (a regular split of every tensor on the first divisible axis, stacked
#: layers by layer), ``flat`` (flattened ranges of each tensor, cut unevenly), ``columns`` (split on
#: the last divisible axis: reformulated tensors are read across their blocks)
STYLES = ("split", "flat", "columns")

Expected = Dict[str, Any]


def fixture_dir(name: str) -> Path:
    return FIXTURE_DIR / name


def _split_axis(shape: Tuple[int, ...], world: int, last: bool) -> int:
    axes = [a for a, n in enumerate(shape) if n % world == 0]
    if not axes:
        return -1
    return axes[-1] if last else axes[0]


def _flat_bounds(numel: int, world: int) -> List[int]:
    """Uneven cut points of ``[0, numel)`` into ``world`` ranges (the first ones larger)."""
    cuts = [0]
    for r in range(1, world):
        cuts.append(min(numel, cuts[-1] + max(1, (numel - cuts[-1]) * 2 // (world - r + 2))))
    return cuts + [numel]


def tensor_requests(
    spec: E.TensorSpec, rank: int, world: int, style: str
) -> Tuple[Dict[str, dc.ShardedTensor], Expected]:
    """This rank's requests for one tensor, keyed by a unique name, and the values they must load."""
    full = E.full_tensor(spec.key, spec.global_shape, spec.dtype)
    shape = tuple(spec.global_shape)
    requests: Dict[str, dc.ShardedTensor] = {}
    expected: Expected = {}
    name = f"{spec.key}@{style}"
    stacked = any(p.prepend_axis_num for p in spec.pieces) and not any(p.flattened_range for p in spec.pieces)
    if style == "flat":
        cuts = _flat_bounds(math.prod(shape), world)
        start, stop = cuts[rank], cuts[rank + 1]
        data = torch.zeros(stop - start, dtype=spec.dtype)
        requests[name] = dc.ShardedTensor.from_rank_offsets_flat(
            spec.key, data, shape, flattened_range=slice(start, stop)
        )
        expected[name] = full.flatten()[start:stop]
        return requests, expected
    if style == "split" and stacked:
        layers = shape[0]
        for layer in range(rank, layers, world):
            key = f"{name}/layer{layer}"
            requests[key] = dc.ShardedTensor.from_rank_offsets(
                spec.key, torch.zeros(shape[1:], dtype=spec.dtype), (0, layer, layers), prepend_axis_num=1
            )
            expected[key] = full[layer]
        return requests, expected
    axis = _split_axis(shape, world, last=style == "columns")
    if axis < 0:  # nothing divides: every rank reads it whole, rank 0's request is the main one
        requests[name] = dc.ShardedTensor.from_rank_offsets(
            spec.key, torch.zeros(shape, dtype=spec.dtype), replica_id=rank
        )
        expected[name] = full
        return requests, expected
    size = shape[axis] // world
    local = full.narrow(axis, rank * size, size)
    requests[name] = dc.ShardedTensor.from_rank_offsets(spec.key, torch.zeros_like(local), (axis, rank, world))
    expected[name] = local
    return requests, expected


def golden_requests(name: str, rank: int, world: int, style: str) -> Tuple[Dict[str, Any], Expected]:
    """Requests for every tensor and ShardedObject of fixture ``name``, and the expected values
    (the common state is expected under the keys :func:`expected_common` lists)."""
    fixture = E.FIXTURES[name]
    requests: Dict[str, Any] = {}
    expected: Expected = {}
    for spec in fixture.tensors:
        req, exp = tensor_requests(spec, rank, world, style)
        requests.update(req)
        expected.update(exp)
    for unique_key, value in E.expected_objects(name).items():
        obj = dc.ShardedObject.empty_from_unique_key(unique_key, replica_id=rank)
        requests[f"object:{unique_key}"] = obj
        expected[f"object:{unique_key}"] = value
    return requests, expected


def check_loaded(name: str, loaded: Dict[str, Any], expected: Expected) -> List[str]:
    """What differs from ``expected`` and from the fixture's common state (empty when all is exact)."""
    problems = []
    for key, value in expected.items():
        try:
            E.assert_same(loaded.get(key), value, key)
        except AssertionError as e:
            problems.append(str(e))
    common = {k: v for k, v in loaded.items() if k not in expected}
    try:
        E.assert_same(common, E.expected_common(name), "common")
    except AssertionError as e:
        problems.append(str(e))
    return problems
