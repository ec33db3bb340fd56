"""``dist-ckpt inspect`` at a terminal's width: keys are shown whole, the layout column wraps
(issue 39, item 7). In process (``main``), with $COLUMNS set as a terminal of that width does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import List

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.cli import main
from dist_ckpt.cli.common import format_table
from dist_ckpt.training.metrics import save_checkpoint_metrics

#: two keys that differ only in their middle, as an optimizer's two moments of one layer do
MOMENTS = [f"optimizer.state.{moment}.decoder.layers.pre_mlp_layernorm.bias" for moment in ("exp_avg", "exp_avg_sq")]


@pytest.fixture(scope="module")
def moments(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("inspect") / "ckpt"
    sd = {key: dc.ShardedTensor.from_rank_offsets(key, torch.zeros(4, 6)) for key in MOMENTS}
    sd["short"] = dc.ShardedTensor.from_rank_offsets("short", torch.zeros(2))
    dc.save(sd, path)
    return path


def _inspect(path: Path, columns: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["inspect", str(path)]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("columns", [80, 120])
def test_inspect_shows_every_key_whole_within_the_width(
    moments: Path, columns: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _inspect(moments, columns, monkeypatch, capsys)
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= columns, out  # 80: a key on its own line; 120: one line a row
    for key in MOMENTS:
        assert any(ln.split()[:1] == [key] for ln in lines), (key, out)  # whole, at the start of a line
    assert "..." not in out, out
    assert "[4, 6]" in out and "whole" in out


def test_a_table_wraps_its_wrapping_column_instead_of_eliding_it() -> None:
    rows = [["k", "4 flattened ranges of chunks [1, 42]"]]
    table = format_table(["key", "layout"], rows, [False, False], max_width=20, shrink=[1], wrap=[1])
    lines: List[str] = table.splitlines()
    assert max(len(ln) for ln in lines) <= 20, table
    assert len(lines) > 2 and table.split() == ["key", "layout", "k", *rows[0][1].split()], (
        table
    )  # every word, in order


def test_inspect_of_a_run_directory_lists_its_checkpoints(
    moments: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    for step in (100, 200):
        shutil.copytree(moments, run / f"checkpoint-{step}")
    save_checkpoint_metrics(run / "checkpoint-200", {"eval_loss": 0.474})
    shutil.copytree(moments, run / "checkpoint-300")
    (run / "checkpoint-300" / "metadata.json").unlink()  # a save that did not finish
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"{run}: a run directory of 2 complete checkpoints" in out, out
    rows = {line.split()[1]: line for line in out.splitlines() if line.split()[:1] in (["100"], ["200"])}
    assert set(rows) == {"checkpoint-100", "checkpoint-200"} and "eval_loss=0.474" in rows["checkpoint-200"], out
    assert "checkpoint-300" not in out.split("note:")[0] and f"dist-ckpt inspect {run / 'checkpoint-200'}" in out
    assert main(["inspect", str(run), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "run" and [c["step"] for c in doc["checkpoints"]] == [100, 200]
    assert doc["checkpoints"][1]["metrics"] == {"eval_loss": 0.474}
