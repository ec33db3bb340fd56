"""The command line's progress bars for saves and loads: bytes as they move (issue 39, item 6)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.cli.progress import ProgressBars


def test_a_save_and_a_load_draw_a_bar_of_bytes_and_one_of_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sd = {f"w{i}": dc.ShardedTensor.from_rank_offsets(f"w{i}", torch.zeros(4096)) for i in range(8)}  # 128 KiB
    with ProgressBars(enabled=True, description="saving") as bars:
        dc.save(sd, tmp_path / "c", progress=bars)
        steps = bars._phases
        assert steps is not None and steps.n == steps.total  # every step counted, the byte-counting one too
    err = capsys.readouterr().err
    assert "saving sharded tensors: 100%" in err and "128 KiB/128 KiB" in err, err
    with ProgressBars(enabled=True, description="loading") as bars:
        dc.load(sd, tmp_path / "c", progress=bars)
    err = capsys.readouterr().err
    assert "loading sharded tensors: 100%" in err and "128 KiB/128 KiB" in err, err
