"""The host-memory budget: its precedence, its pieces, and the saves and loads that follow it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.safetensors.strategy import SafetensorsSaveOptions
from dist_ckpt.errors import ArgumentTypeError, CheckpointingException
from dist_ckpt.storage import host_memory
from dist_ckpt.storage.host_memory import (
    BUDGET_ENV_VAR,
    MIN_PIECE_BYTES,
    get_host_memory_budget,
    host_memory_budget,
    host_pieces,
    piece_bytes,
    set_host_memory_budget,
)


@pytest.fixture(autouse=True)
def _no_process_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "_process_budget", None)
    monkeypatch.setattr(host_memory, "_process_budget_set", False)
    monkeypatch.delenv(BUDGET_ENV_VAR, raising=False)


def test_precedence_call_over_process_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_host_memory_budget() is None
    monkeypatch.setenv(BUDGET_ENV_VAR, "1000")
    assert get_host_memory_budget() == 1000
    set_host_memory_budget(2000)
    assert get_host_memory_budget() == 2000
    with host_memory_budget(3000) as use:
        assert get_host_memory_budget() == 3000 and use.budget == 3000
    with host_memory_budget(None) as use:  # None inherits the process's budget
        assert use.budget == 2000
    assert get_host_memory_budget() == 2000


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_bad_budget_is_a_typed_error(bad: object) -> None:
    with pytest.raises(ArgumentTypeError, match="host_memory_budget_bytes"):
        set_host_memory_budget(bad)  # type: ignore[arg-type]


def test_piece_bytes_shares_the_budget() -> None:
    assert piece_bytes(64 << 20, shares=2) == 64 << 20
    with host_memory_budget(16 << 20):
        assert piece_bytes(64 << 20, shares=2) == 8 << 20
    with host_memory_budget(1000):
        assert piece_bytes(64 << 20, shares=2) == MIN_PIECE_BYTES


@pytest.mark.parametrize(
    "tensor",
    [torch.arange(24.0).reshape(4, 6).t(), torch.arange(40, dtype=torch.int16)[::3], torch.arange(7.0).reshape(7, 1)],
)
def test_pieces_are_row_major_and_bounded(tensor: torch.Tensor) -> None:
    """Strided CPU tensors take the staging path a GPU tensor takes: pieces of at most the
    limit through one buffer, whose concatenation is the row-major bytes."""
    buffer = torch.empty(8, dtype=torch.uint8)
    pieces = [bytes(p) for p in host_pieces(tensor, 8, buffer, force=True)]
    assert all(len(p) <= 8 for p in pieces)
    assert b"".join(pieces) == tensor.contiguous().numpy().tobytes()


def test_contiguous_cpu_pieces_are_views() -> None:
    t = torch.arange(10, dtype=torch.uint8)
    first = next(host_pieces(t, 4))
    t[0] = 99
    assert first[0] == 99  # its own memory, not a copy


def test_options_alias_and_conflict() -> None:
    assert SafetensorsSaveOptions(snapshot_budget_bytes=5).host_memory_budget_bytes == 5
    assert SafetensorsSaveOptions(host_memory_budget_bytes=5).snapshot_budget_bytes == 5
    with pytest.raises(CheckpointingException, match="one budget"):
        SafetensorsSaveOptions(snapshot_budget_bytes=5, host_memory_budget_bytes=6)


def test_async_save_under_a_budget_reports_its_split(tmp_path: Path) -> None:
    """With a budget below the state an async save writes what does not fit before returning,
    and its report says how much; the checkpoint holds the state at schedule time."""
    data = [torch.randn(256, 256) for _ in range(4)]  # 4 x 256 KiB
    sd = {f"w{i}": dc.ShardedTensor.from_rank_offsets(f"w{i}", t.t()) for i, t in enumerate(data)}
    expected = {k: v.data.clone() for k, v in sd.items()}
    result = dc.save_with_report(sd, tmp_path / "c", async_sharded_save=True, host_memory_budget_bytes=300_000)
    for t in data:
        t.add_(1.0)
    report = result.report
    assert report.host_memory_budget_bytes == 300_000
    assert report.snapshot_nbytes is not None and report.snapshot_nbytes <= 300_000
    assert report.snapshot_nbytes + (report.written_before_return_nbytes or 0) == 4 * 256 * 256 * 4
    assert report.written_before_return_nbytes and report.blocked_seconds is not None
    assert result.async_request is not None
    result.async_request.execute_sync()
    target = {k: dc.ShardedTensor.from_rank_offsets(k, torch.empty(256, 256)) for k in sd}
    loaded = dc.load(target, tmp_path / "c", host_memory_budget_bytes=1 << 20)
    for k, v in expected.items():
        assert torch.equal(loaded[k], v)
