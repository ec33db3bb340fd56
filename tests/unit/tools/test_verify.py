"""dist-ckpt verify and dist_ckpt.verify_checkpoint: healthy checkpoints exit 0; every missing,
damaged or uncommitted file is one line, and exit 1; --json for machines."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.base import LoadShardedStrategy
from dist_ckpt.cli import main
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor
from dist_ckpt.tools.verify import verify_checkpoint
from tests.paths import GOLDEN_DIR

GOLDEN = GOLDEN_DIR


def _save(path: Path, backend=None) -> Path:
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(64, dtype=torch.float32).reshape(8, 8)),
        "o": ShardedObject("obj", [1, 2], (1,), (0,)),
        "step": 1,
    }
    dc.save(sd, path, sharded_strategy=backend)
    return path


def test_healthy_checkpoint(tmp_path, capsys):
    path = _save(tmp_path / "c")
    report = verify_checkpoint(path)
    assert report.ok and report.committed and not report.problems
    assert report.backends == ["safetensors:1", "torch:1"] and report.bytes_checked >= 256
    assert main(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK: ") and "safetensors:1" in out


def test_one_line_per_problem_and_exit_1(tmp_path, capsys):
    path = _save(tmp_path / "c")
    (data,) = sorted((path / "safetensors").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    (path / "common.pt").unlink()
    assert main(["verify", str(path)]) == 1
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"safetensors/{data.name} (key 'w'): bytes ") and "crc32c" in lines[0]
    assert lines[1] == "common.pt: missing"
    assert "2 problems" in captured.err and captured.err.count("\n") == 1


def test_json_output(tmp_path, capsys):
    path = _save(tmp_path / "c", ("zarr", 1))
    (path / "metadata.json").unlink()
    chunk = path / "zarr" / "w" / "c.0.0"
    chunk.write_bytes(chunk.read_bytes()[:-4])
    assert main(["verify", str(path), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["committed"] is False and doc["backends"] == ["zarr:1", "torch:1"]
    assert doc["problems"][0]["path"] == "metadata.json" and "never committed" in doc["problems"][0]["problem"]
    assert doc["problems"][1] == {
        "path": "zarr/w/c.0.0",
        "problem": "has 252 bytes, 256 were recorded at save time (truncated or replaced)",
        "key": "w",
    }
    assert main(["verify", str(_save(tmp_path / "d")), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_not_a_directory(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope")]) == 2  # a bad path is a usage error
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["safetensors_index_v1", "zarr_v1"])
def test_version_1_goldens_verify_with_notes(tmp_path, name):
    path = tmp_path / name
    shutil.copytree(GOLDEN / name, path)
    report = verify_checkpoint(path)
    assert report.ok and any("without checksums" in n or "no checksums" in n for n in report.notes)
    # structure checks still catch a missing file of an old checkpoint
    victim = sorted(
        p
        for p in (path / name.split("_")[0]).rglob("*")
        if p.is_file() and p.name != "zarr.json" and p.name != "index.json"
    )[0]
    victim.unlink()
    assert str(victim.relative_to(path)) in {p.path for p in verify_checkpoint(path).problems}


def test_a_backend_without_verification_is_noted(tmp_path):
    class Plain(LoadShardedStrategy):
        supported_backends = ("plain",)
        supported_versions = (1,)

        def load(self, sharded_state_dict, checkpoint_dir):  # pragma: no cover - not called
            return sharded_state_dict

        def load_tensors_metadata(self, checkpoint_dir):  # pragma: no cover - not called
            return {}

    report = Plain().verify_integrity(tmp_path)
    assert not report.problems and "not checked" in report.notes[0]


def test_leftover_temporary_files_are_noted(tmp_path):
    path = _save(tmp_path / "c")
    (path / ".metadata.json.tmp-123-abc").write_bytes(b"{")
    report = verify_checkpoint(path)
    assert report.ok and any(".metadata.json.tmp-123-abc" in n for n in report.notes)


@pytest.mark.parametrize("backend", [("safetensors", 1), ("zarr", 1)])
def test_removing_tensors_keeps_the_checkpoint_verifiable(tmp_path, backend):
    sd = {
        k: ShardedTensor.from_rank_offsets(k, torch.arange(12.0).reshape(3, 4) + i)
        for i, k in enumerate(["a.w", "a.b", "c"])
    }
    dc.save(sd, tmp_path / "c", sharded_strategy=backend)
    dc.remove_sharded_tensors(tmp_path / "c", "a.")
    report = verify_checkpoint(tmp_path / "c")
    assert report.ok, report.problems
    assert list(dc.load_tensors_metadata(tmp_path / "c")) == ["c"]


def test_progress_events_for_each_part(tmp_path):
    from dist_ckpt.engine.report import Operation

    events = []
    report = verify_checkpoint(_save(tmp_path / "d"), progress=events.append)
    assert report.ok
    assert [(e.phase, e.done) for e in events] == [
        ("checking metadata.json", False),
        ("checking metadata.json", True),
        ("checking the safetensors:1 files", False),
        ("checking the safetensors:1 files", True),
        ("checking the torch:1 files", False),
        ("checking the torch:1 files", True),
    ]
    assert all(e.operation == Operation.VERIFY for e in events) and events[-1].index == events[-1].total == 3
