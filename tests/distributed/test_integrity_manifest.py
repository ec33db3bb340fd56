"""Megatron-Core's ``integrity.json`` at 2 and 4 ranks: every rank hashes a share of the files (Megatron-Core
hashes them all on rank 0), and a file changed on disk fails a verified load on every rank, named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

import dist_ckpt as dc
from dist_ckpt.errors import CorruptCheckpointError
from dist_ckpt.integrity import file_manifest
from dist_ckpt.testing.layouts import full_tensor, tp_shards

from .helpers import assert_on_all_ranks, raises_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)


def _state(fill: bool) -> Dict[str, Any]:
    return tp_shards("w", full_tensor("w", (4 * world(), 6)), 0, world(), rank(), world(), empty=not fill)


def test_ranks_share_the_hashing_and_a_changed_file_fails_everywhere(
    shared_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed: List[str] = []
    original = file_manifest.sha256_of

    def counting(storage: Any, name: str) -> str:
        hashed.append(name)
        return original(storage, name)

    monkeypatch.setattr(file_manifest, "sha256_of", counting)
    dc.save(_state(True), shared_tmp_path, sharded_strategy=("torch_dist", 1), verify_integrity=True)
    counts = [None] * world()
    dist.all_gather_object(counts, len(hashed))
    names = json.loads((shared_tmp_path / "integrity.json").read_text())["files"]
    assert_on_all_ranks(sum(counts) == len(names) and min(counts) > 0, f"hashed per rank {counts} of {len(names)}")

    loaded = dc.load(_state(False), shared_tmp_path, verify_integrity=True)
    expected = _state(True)
    assert_on_all_ranks(all(torch.equal(loaded[k], v.data) for k, v in expected.items()), "loaded other values")

    dist.barrier()
    if rank() == 0:
        target = shared_tmp_path / sorted(n for n in names if n.endswith(".distcp"))[-1]
        target.write_bytes(target.read_bytes()[:-1] + b"\x01")
    dist.barrier()
    raises_on_all_ranks(
        CorruptCheckpointError, lambda: dc.load(_state(False), shared_tmp_path, verify_integrity=True), "differs"
    )
