"""Errors of partial or mistyped load requests point at the cause (issue 39 item 10): an
absent key names the stored key it resembles, and a sharding check that fails for a request of
part of a tensor says how to load one (``validate_access_integrity=False``). A key mistyped on
one rank of several: tests/distributed/test_errors.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.errors import KeyMismatchError, ShardingIntegrityError, did_you_mean
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    dc.save(
        {
            "decoder.weight": ShardedTensor.from_rank_offsets("decoder.weight", torch.arange(8.0).reshape(4, 2)),
            "decoder.bias": ShardedTensor.from_rank_offsets("decoder.bias", torch.arange(4.0)),
            "rng": ShardedObject("rng_state", {"seed": 3}, (1,), (0,)),
        },
        path,
    )
    return path


def _typo() -> dict:
    return {"w": ShardedTensor.from_rank_offsets("decoder.weigth", torch.empty(4, 2))}


@pytest.mark.parametrize("strict", ["assume_ok_unexpected", "raise_unexpected", "raise_all"])
def test_a_mistyped_key_names_the_stored_key(ckpt, strict):
    with pytest.raises(KeyMismatchError) as caught:
        dc.load(_typo(), ckpt, strict=strict)
    assert "(did you mean: 'decoder.weigth' -> 'decoder.weight')" in str(caught.value)
    assert caught.value.unexpected_keys == ["decoder.weigth"]


def test_a_mistyped_object_key_names_the_stored_key(ckpt):
    with pytest.raises(KeyMismatchError, match=r"did you mean: 'rng_stat' -> 'rng_state'"):
        dc.load({"rng": ShardedObject("rng_stat", None, (1,), (0,))}, ckpt)


def test_half_a_tensor_in_one_process_says_how(ckpt):
    half = {"w": ShardedTensor.from_rank_offsets("decoder.weight", torch.empty(2, 2), (0, 0, 2))}
    with pytest.raises(ShardingIntegrityError, match=r"gap in coverage.*validate_access_integrity=False"):
        dc.load(half, ckpt)
    out = dc.load(half, ckpt, validate_access_integrity=False)
    assert torch.equal(out["w"], torch.arange(4.0).reshape(2, 2))


def test_a_mistyped_key_that_also_leaves_a_gap(ckpt):
    """The sharding check sees the gap first; the error names the key that caused it."""
    request = {
        "a": ShardedTensor.from_rank_offsets("decoder.weight", torch.empty(2, 2), (0, 0, 2)),
        "b": ShardedTensor.from_rank_offsets("decoder.weigth", torch.empty(2, 2), (0, 1, 2)),
    }
    with pytest.raises(KeyMismatchError) as caught:
        dc.load(request, ckpt)
    text = str(caught.value)
    assert text.startswith("[rank 0] Unexpected keys") and "'decoder.weigth' -> 'decoder.weight'" in text
    assert "the sharding check failed because of them" in text and "gap in coverage" in text


def test_did_you_mean():
    assert did_you_mean(["decoder.weigth"], ["decoder.weight", "decoder.bias"]) == (
        " (did you mean: 'decoder.weigth' -> 'decoder.weight')"
    )
    assert did_you_mean(["embedding"], ["decoder.weight"]) == ""
    assert did_you_mean([], ["a"]) == "" and did_you_mean(["a"], []) == ""
