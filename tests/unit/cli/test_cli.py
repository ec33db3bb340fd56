"""The ``dist-ckpt`` commands through their real entry point (``python -m dist_ckpt``, a subprocess).

Checkpoints are made in the tests (4 virtual ranks, see :mod:`tests.sample_checkpoints`).
Every failure must be one line on stderr, without a traceback, with exit status 1 (the
checkpoint is damaged, a verification failed) or 2 (usage error, or a bad location).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.cli import COMMANDS, main
from dist_ckpt.testing.layouts import bitwise_equal
from tests.sample_checkpoints import COMMON, save_sample, stored_tensors


def dist_ckpt(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m dist_ckpt ARGS`` in ``cwd`` (environment inherited: S3 settings included)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "dist_ckpt", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )  # a hang guard, not a timing check


def one_line_error(proc: subprocess.CompletedProcess[str], status: int, command: str) -> str:
    """Check a failure's exit status and stderr (one line, no traceback); return that line."""
    assert proc.returncode == status, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"dist-ckpt {command}: error:"), lines[0]
    return lines[0]


def same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A safetensors checkpoint shared by the read-only tests of this module."""
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    save_sample(path)
    return path


def corrupt_one_byte(checkpoint: Path) -> Path:
    """Flip a bit in the tensor data of the checkpoint's first safetensors file; return the file."""
    data = sorted((checkpoint / "safetensors").glob("rank*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0x10
    data.write_bytes(bytes(raw))
    return data


# --------------------------------------------------------------------------- help and usage


def test_help_lists_every_command(tmp_path):
    proc = dist_ckpt("--help", cwd=tmp_path)
    assert proc.returncode == 0 and "usage: dist-ckpt" in proc.stdout
    for name in ("inspect", "verify", "convert", "export-hf", "bench", "demo"):
        assert f"    {name}" in proc.stdout
    assert len(COMMANDS) == 6


@pytest.mark.parametrize("command", ["inspect", "verify", "convert", "export-hf", "bench", "demo"])
def test_each_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dist-ckpt {command}") and "--debug" in out


@pytest.mark.parametrize(
    "args",
    [
        ["inspect"],
        ["convert", "a", "b"],
        ["convert", "a", "b", "--to", "nope"],
        ["verify", "a", "--bogus"],
        ["export-hf", "a", "b", "--max-shard-size", "lots"],
    ],
)
def test_usage_errors_exit_2(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2 and f"usage: dist-ckpt {args[0]}" in capsys.readouterr().err


def test_version(tmp_path):
    proc = dist_ckpt("--version", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == f"dist-ckpt {dc.__version__}"


def test_a_closed_stdout_pipe_ends_quietly(sample, monkeypatch, capsys):
    class ClosedPipe:  # what `| head` leaves once head has exited
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["inspect", str(sample)]) == 141
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- inspect


def test_inspect(sample, tmp_path):
    proc = dist_ckpt("inspect", str(sample), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"{sample}: dist_ckpt checkpoint" in out and "backend   safetensors:1 (common state: torch:1)" in out
    assert "saved by  1 rank" in out and "tensors   6," in out
    table = {
        line.split()[0]: line for line in out.splitlines() if line.startswith(("embedding", "optimizer", "layers"))
    }
    assert "[64, 16]" in table["embedding.weight"] and "bfloat16" in table["embedding.weight"]
    assert "4 chunks of [16, 16]" in table["embedding.weight"]
    assert "4 flattened ranges of chunks" in table["optimizer.exp_avg"]
    assert "common state (3 keys):" in out and "config/name: str = 'tiny'" in out
    assert "ShardedObjects (2):" in out and "rng_state/shard_1_2" in out
    assert proc.stderr == ""


def test_inspect_json_with_shards_and_a_key_pattern(sample, tmp_path):
    proc = dist_ckpt("inspect", str(sample), "--json", "--shards", "--keys", "optimizer.*", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["sharded_backend"] == "safetensors:1" and doc["world_size"] == 1
    (tensor,) = doc["tensors"]
    assert tensor["key"] == "optimizer.exp_avg" and tensor["global_shape"] == [24, 10] and tensor["dtype"] == "float32"
    assert len(tensor["shards"]) == 4 and all(s["flat_range"] is not None for s in tensor["shards"])
    assert sum(s["nbytes"] for s in tensor["shards"]) == tensor["nbytes"] == 24 * 10 * 4
    assert doc["common"]["step"] == "int = 1000"


def test_inspect_a_huggingface_folder(sample, tmp_path):
    dc.convert(sample, tmp_path / "hf", to="hf")
    proc = dist_ckpt("inspect", str(tmp_path / "hf"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "HuggingFace folder" in proc.stdout and "backend   hf:1" in proc.stdout and "embedding.weight" in proc.stdout


def test_inspect_bad_paths_exit_2(tmp_path):
    line = one_line_error(dist_ckpt("inspect", str(tmp_path / "absent"), cwd=tmp_path), 2, "inspect")
    assert "does not exist" in line
    one_line_error(dist_ckpt("inspect", str(tmp_path), cwd=tmp_path), 2, "inspect")  # no checkpoint in it


def test_inspect_damaged_metadata_exits_1(sample, tmp_path):
    broken = tmp_path / "broken"
    dc.convert(sample, broken, to="safetensors")
    (broken / "safetensors" / "index.json").write_text("{not json")
    line = one_line_error(dist_ckpt("inspect", str(broken), cwd=tmp_path), 1, "inspect")
    assert "index.json" in line


# --------------------------------------------------------------------------- verify


def test_verify_a_healthy_checkpoint(sample, tmp_path):
    proc = dist_ckpt("verify", str(sample), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"OK: {sample} (safetensors:1, torch:1):") and proc.stderr == ""


def test_verify_names_the_damaged_file_and_key(sample, tmp_path):
    copy = tmp_path / "copy"
    dc.convert(sample, copy, to="safetensors")
    damaged = corrupt_one_byte(copy)
    proc = dist_ckpt("verify", str(copy), cwd=tmp_path)
    line = one_line_error(proc, 1, "verify")
    assert "1 problem" in line
    (problem,) = proc.stdout.strip().splitlines()
    assert damaged.name in problem and "(key " in problem and "crc32c" in problem
    doc = json.loads(dist_ckpt("verify", str(copy), "--json", cwd=tmp_path).stdout)
    assert doc["ok"] is False and len(doc["problems"]) == 1


def test_verify_a_missing_directory_exits_2(tmp_path):
    assert "does not exist" in one_line_error(dist_ckpt("verify", str(tmp_path / "nope"), cwd=tmp_path), 2, "verify")


def test_verify_an_uncommitted_save_exits_1(sample, tmp_path):
    copy = tmp_path / "copy"
    dc.convert(sample, copy, to="zarr")
    (copy / "metadata.json").unlink()
    proc = dist_ckpt("verify", str(copy), cwd=tmp_path)
    one_line_error(proc, 1, "verify")
    assert "metadata.json: missing" in proc.stdout


# --------------------------------------------------------------------------- convert, export-hf


def test_convert_round_trip_is_bit_exact(sample, tmp_path):
    expected = stored_tensors(sample)
    steps = [
        (sample, tmp_path / "zarr", "zarr"),
        (tmp_path / "zarr", tmp_path / "hf", "hf"),
        (tmp_path / "hf", tmp_path / "st", "safetensors"),
        (tmp_path / "st", tmp_path / "zarr2", "zarr:1"),
    ]
    for src, dst, to in steps:
        proc = dist_ckpt("convert", str(src), str(dst), "--to", to, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "dist-ckpt convert: 6 tensors" in proc.stdout and f"to   {dst}" in proc.stdout
        assert "copying tensors" not in proc.stderr  # no progress bars when stderr is not a terminal
        assert same(stored_tensors(dst), expected), (src, to)
    assert (
        "not copied (a HuggingFace folder holds tensors only)"
        in dist_ckpt("convert", str(sample), str(tmp_path / "hf2"), "--to", "hf", cwd=tmp_path).stdout
    )
    assert dc.load_common_state_dict(str(tmp_path / "zarr")) == COMMON


def test_convert_json_and_progress_bars(sample, tmp_path):
    proc = dist_ckpt("convert", str(sample), str(tmp_path / "out"), "--to", "zarr", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["tensors"] == 6 and doc["sharded_objects"] == 2 and doc["target_backend"] == "zarr:1"
    assert doc["report"]["operation"] == "convert" and doc["report"]["complete"] is True
    proc = dist_ckpt("convert", str(sample), str(tmp_path / "bars"), "--to", "safetensors", "--progress", cwd=tmp_path)
    assert proc.returncode == 0 and "copying tensors" in proc.stderr and "100%" in proc.stderr
    proc = dist_ckpt("convert", str(sample), str(tmp_path / "quiet"), "--to", "safetensors", "-q", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stderr == ""


def test_convert_failures(sample, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    line = one_line_error(
        dist_ckpt("convert", str(sample), str(tmp_path / "full"), "--to", "zarr", cwd=tmp_path), 2, "convert"
    )
    assert "not an empty directory" in line and (tmp_path / "full" / "x").read_text() == "mine"
    one_line_error(
        dist_ckpt("convert", str(tmp_path / "absent"), str(tmp_path / "o"), "--to", "zarr", cwd=tmp_path), 2, "convert"
    )
    damaged = tmp_path / "damaged"
    dc.convert(sample, damaged, to="safetensors")
    name = corrupt_one_byte(damaged).name
    line = one_line_error(
        dist_ckpt("convert", str(damaged), str(tmp_path / "o"), "--to", "zarr", cwd=tmp_path), 1, "convert"
    )
    assert name in line and not (tmp_path / "o").exists()


def test_export_hf(sample, tmp_path):
    proc = dist_ckpt("export-hf", str(sample), str(tmp_path / "hf"), "--max-shard-size", "2KB", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    # model weights only: the optimizer state is left out by default
    assert doc["tensors"] == 5 and doc["index"] == "model.safetensors.index.json" and len(doc["files"]) > 1
    assert doc["left_out"] == ["optimizer.exp_avg"]
    weights = {k: v for k, v in stored_tensors(sample).items() if k != "optimizer.exp_avg"}
    assert same(stored_tensors(tmp_path / "hf"), weights)
    line = one_line_error(dist_ckpt("export-hf", str(sample), str(tmp_path / "hf"), cwd=tmp_path), 2, "export-hf")
    assert "already holds HuggingFace weights" in line


# --------------------------------------------------------------------------- object stores


def test_commands_on_s3_urls(sample, tmp_path, s3_url):
    up = dist_ckpt("convert", str(sample), s3_url, "--to", "safetensors", cwd=tmp_path)
    assert up.returncode == 0, up.stderr
    assert f"to   {s3_url}" in up.stdout
    proc = dist_ckpt("verify", s3_url, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith(f"OK: {s3_url}"), proc.stderr
    doc = json.loads(dist_ckpt("inspect", s3_url, "--json", cwd=tmp_path).stdout)
    assert doc["checkpoint"] == s3_url and doc["num_tensors"] == 6
    proc = dist_ckpt("export-hf", s3_url, str(tmp_path / "hf"), "--include", "*", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert same(stored_tensors(tmp_path / "hf"), stored_tensors(sample))
    line = one_line_error(dist_ckpt("convert", str(sample), s3_url + "-z", "--to", "zarr", cwd=tmp_path), 1, "convert")
    assert "object storage" in line or "object store" in line


# --------------------------------------------------------------------------- bench


def test_bench_reports_ratios_to_the_raw_disk(tmp_path):
    proc = dist_ckpt("bench", "--dir", str(tmp_path), "--size", "2", "--ranks", "2", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is True and doc["ranks"] == 2 and doc["state_bytes"] > 0
    operations: List[str] = [r["operation"] for r in doc["rows"]]
    assert operations[0].startswith("disk write") and operations[1].startswith("disk read")
    assert any(op.startswith("save") for op in operations) and sum(op.startswith("load") for op in operations) == 2
    for row in doc["rows"]:
        assert row["ratio"] > 0 and row["reference"] in ("disk write", "disk read")
    assert list(tmp_path.iterdir()) == []  # the checkpoint and the raw test file are deleted


def test_bench_bad_directory_exits_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = one_line_error(dist_ckpt("bench", "--dir", str(blocker / "sub"), "--size", "1", cwd=tmp_path), 2, "bench")
    assert "cannot be used" in line


def test_verify_progress_bar_in_process(sample, capsys):
    assert main(["verify", str(sample), "--progress"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("OK:") and "verifying" in captured.err and "3/3" in captured.err
