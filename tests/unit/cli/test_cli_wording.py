"""What the commands print, word by word: one of a thing in the singular, rates without
exponents (issue 39, item 15). In process (``main``), on a checkpoint of one of everything."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.cli import main


@pytest.fixture
def single(tmp_path: Path) -> Path:
    """A checkpoint of one tensor, one common entry and one ShardedObject."""
    path = tmp_path / "one"
    dc.save(
        {
            "w": dc.ShardedTensor.from_rank_offsets("w", torch.arange(4.0)),
            "rng": dc.ShardedObject("rng", [1, 2], (1,), (0,)),
            "step": 5,
        },
        path,
    )
    return path


def test_inspect_counts_one_key_in_the_singular(single: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(single)]) == 0
    out = capsys.readouterr().out
    assert "common state (1 key):" in out and "ShardedObjects (1):" in out, out
    assert "saved by  1 rank," in out, out


def test_convert_counts_in_the_singular_and_writes_its_rate_out(
    single: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["convert", str(single), str(tmp_path / "z"), "--to", "zarr", "-q"]) == 0
    out = capsys.readouterr().out
    assert "dist-ckpt convert: 1 tensor," in out and "common state (1 key) and 1 ShardedObject copied" in out, out
    assert "e-" not in out.split(" in ", 1)[1], out  # 16 bytes in a few ms: far below 0.001 GiB/s
