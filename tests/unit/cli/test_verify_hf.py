"""``dist-ckpt verify`` on a HuggingFace folder (issue 39, item 7): such a folder holds no
checksums, so verify checks what it can -- the index and every file's header against the file
-- and says so, instead of "holds no checkpoint"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_ckpt.cli import main
from dist_ckpt.hf.io import save_checkpoint


@pytest.fixture
def hf(tmp_path: Path) -> Path:
    folder = tmp_path / "hf"
    save_checkpoint(folder, {"a.weight": torch.arange(12.0).reshape(3, 4), "b.bias": torch.ones(5)}, max_shard_size=64)
    return folder


def test_verify_checks_the_headers_of_a_huggingface_folder_and_says_it_has_no_checksums(
    hf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(hf)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK: {hf} (HuggingFace folder): 2 files") and "headers checked" in out, out
    assert "no checksums" in out and "holds no checkpoint" not in out, out
    assert main(["verify", str(hf), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "hf" and doc["ok"] is True and doc["checksums"] is False and doc["files_checked"] == 2


def test_verify_finds_a_truncated_file_of_a_huggingface_folder(hf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = sorted(hf.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-4])
    assert main(["verify", str(hf)]) == 1
    err = capsys.readouterr().err
    assert shard.name in err and "truncated" in err, err
