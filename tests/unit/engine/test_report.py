"""What reports and commands print: counts in the singular for one, rates without exponents."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.engine.report import CheckpointReport, Operation, format_rate


def test_a_slow_rate_is_written_without_an_exponent() -> None:
    assert format_rate(9.6e-05 * 2**30, 1.0) == "0.0000960 GiB/s"
    assert format_rate(1.88 * 2**30, 1.0) == "1.88 GiB/s" and format_rate(123.4 * 2**30, 1.0) == "123 GiB/s"
    assert format_rate(0.00842 * 2**30, 1.0) == "0.00842 GiB/s" and format_rate(5, 0.0) == "0 GiB/s"


def test_a_summary_of_one_file_on_one_rank_says_so_in_the_singular() -> None:
    report = CheckpointReport(Operation.SAVE, "ckpt", 0, 1, nbytes=100, seconds=1.0, total_nbytes=100)
    report.max_seconds, report.files, report.file_bytes = 1.0, 1, 100
    summary = report.summary()
    assert "on 1 rank;" in summary and "; 1 file," in summary, summary
    assert "e-" not in summary, summary  # 100 B/s is 9.31e-08 GiB/s: written out


def test_each_rank_logs_its_rate_without_an_exponent(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="dist_ckpt.engine.monitor"):
        dc.save({"w": dc.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, tmp_path / "c")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rank 0: 16 bytes")]
    assert lines and "GiB/s" in lines[0] and "e-" not in lines[0], lines
