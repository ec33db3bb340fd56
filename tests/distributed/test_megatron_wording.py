"""Errors and warnings across ranks, worded so that code written for Megatron-Core still matches.

Key mismatches name every rank's keys on every rank, with Megatron-Core's "Unexpected keys" /
"Missing keys"; the common-state warning starts as Megatron-Core's does, with its per-rank
structure; a missing directory and a gap between flattened ranges are worded as it words them.
dist_ckpt's own text (rank, key, path, fix) stays in each message.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.testing.layouts import full_tensor, tp_shards

from .helpers import assert_on_all_ranks, raises_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)


def state() -> Dict[str, dc.ShardedTensor]:
    return tp_shards("w", full_tensor("w", (8 * world(), 4)), 0, world(), rank(), world())


def absent(key: str, replica_id: int = 0) -> dc.ShardedTensor:
    return dc.ShardedTensor.from_rank_offsets(key, torch.zeros(3), replica_id=replica_id)


@pytest.mark.parametrize("strict", ["assume_ok_unexpected", "raise_unexpected", "raise_all"])
def test_every_rank_names_the_keys_of_every_rank(shared_tmp_path: Path, strict: str) -> None:
    """Every rank requests 'shared_absent'; rank r also 'only_on_rank_r'. Each rank's error names
    all of them (a key requested by rank 1 only is named on rank 0 too), as Unexpected keys."""
    dc.save(state(), shared_tmp_path)
    request: Dict[str, dc.ShardedTensor] = dict(state())
    request["a"] = absent("shared_absent", replica_id=rank())  # a replica on every rank
    request["b"] = absent(f"only_on_rank_{rank()}")
    err = raises_on_all_ranks(dc.KeyMismatchError, lambda: dc.load(request, shared_tmp_path, strict=strict))
    text = str(err)
    wanted = ["shared_absent", "Unexpected keys"] + [f"only_on_rank_{r}" for r in range(world())]
    assert_on_all_ranks(all(w in text for w in wanted), text)
    assert_on_all_ranks("Missing keys" not in text, text)  # nothing is missing: every stored key was asked for
    expected = sorted(["shared_absent"] + [f"only_on_rank_{r}" for r in range(world())])
    assert_on_all_ranks(err.unexpected_keys == expected, f"unexpected_keys={err.unexpected_keys}")  # type: ignore[attr-defined]


def test_missing_keys_are_named_with_megatron_words(shared_tmp_path: Path) -> None:
    sd = dict(state())
    sd.update(tp_shards("b", full_tensor("b", (4,)), 0, 1, rank(), world()))
    dc.save(sd, shared_tmp_path)
    err = raises_on_all_ranks(dc.KeyMismatchError, lambda: dc.load(state(), shared_tmp_path, strict="raise_all"))
    text = str(err)
    ok = "Missing keys" in text and "'b'" in text and "Unexpected keys" not in text and err.missing_keys == ["b"]  # type: ignore[attr-defined]
    assert_on_all_ranks(ok, text)


def test_common_state_warning_starts_as_megatron_core_words_it(
    shared_tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sd: Dict[str, object] = dict(state())
    sd["step"] = 10
    sd["rank_specific"] = rank()
    with caplog.at_level(logging.WARNING, logger="dist_ckpt"):
        dc.save(sd, shared_tmp_path)
    expected = {r: ([], [], [(("rank_specific",), int, int)]) for r in range(1, world())}
    prefix = f"There is difference in the common state dict in different ranks. The differences are {expected}"
    messages = [r.getMessage() for r in caplog.records if "common state" in r.getMessage()]
    ok = any(m.startswith(prefix) for m in messages) if rank() == 0 else not messages  # rank 0 logs it
    assert_on_all_ranks(ok, f"{messages}")


def test_missing_directory(shared_tmp_path: Path) -> None:
    nowhere = str(shared_tmp_path / "does" / "not" / "exist")
    for fn in (lambda: dc.load(state(), nowhere), lambda: dc.load_common_state_dict(nowhere)):
        err = raises_on_all_ranks(dc.NotACheckpointError, fn)
        assert_on_all_ranks(f"directory {nowhere} does not exist" in str(err), str(err))


def test_gap_between_flattened_ranges(shared_tmp_path: Path) -> None:
    """Each rank holds a flat range of one (4, 4) tensor; the last rank's range stops one
    element short, leaving a gap at the end."""
    full = full_tensor("f", (4, 4)).flatten()
    per = 16 // world()
    stop = (rank() + 1) * per - (1 if rank() == world() - 1 else 0)
    sh = dc.ShardedTensor.from_rank_offsets_flat(
        "f", full[rank() * per : stop].clone(), (4, 4), flattened_range=slice(rank() * per, stop)
    )
    err = raises_on_all_ranks(dc.ShardingIntegrityError, lambda: dc.save({"f": sh}, shared_tmp_path))
    ok = "Flattened ranges dont cover the whole shard" in str(err) and "'f'" in str(err) and "[15, 16)" in str(err)
    assert_on_all_ranks(ok, str(err))
