"""The ``dist-ckpt`` console script as a user runs it (issue 16, item 8).

Every test starts the installed entry point (``dist-ckpt``, the script pip generated from
``[project.scripts]``) as a subprocess, with PYTHONPATH set to this checkout so that its copy of
dist_ckpt is the one imported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

import dist_ckpt as dc
from tests.paths import REPO_ROOT
from tests.sample_checkpoints import save_sample

ROOT = REPO_ROOT
LONG_KEY = "decoder.layers.self_attention.linear_qkv.layer_norm_weight.with_a_rather_long_suffix"


def _entry_point() -> str:
    beside = Path(sys.executable).parent / "dist-ckpt"
    found = str(beside) if beside.exists() else shutil.which("dist-ckpt")
    if found is None:
        pytest.skip("the dist-ckpt console script is not installed (pip install -e . installs it)")
    return found


def run(*args: str, cwd: Path, columns: Optional[int] = None) -> subprocess.CompletedProcess[str]:
    """``dist-ckpt ARGS`` in ``cwd``; ``columns`` sets $COLUMNS (unset otherwise)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run(
        [_entry_point(), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )  # a hang guard, not a timing check


def error_line(proc: subprocess.CompletedProcess[str], status: int, command: str) -> str:
    """The one stderr line of a failed command, checked to have exit status ``status``."""
    assert proc.returncode == status, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dist-ckpt {command}: error:"), proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("entry") / "ckpt"
    save_sample(path)
    return path


def test_the_entry_point_imports_this_checkout(tmp_path):
    proc = run("--version", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == f"dist-ckpt {dc.__version__}"


# --------------------------------------------------------------------------- bad locations


def test_verify_of_a_directory_without_a_checkpoint_exits_2(sample, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(sample, run_dir / "checkpoint-100")  # a run directory: checkpoints *inside* it
    (run_dir / "notes.txt").write_text("hello")
    line = error_line(run("verify", str(run_dir), cwd=tmp_path), 2, "verify")
    assert "holds no checkpoint" in line and "metadata.json" in line
    doc_proc = run("verify", str(run_dir), "--json", cwd=tmp_path)
    assert doc_proc.returncode == 2
    doc = json.loads(doc_proc.stdout)
    assert doc["found"] is False and doc["files_checked"] == 0 and doc["notes"] == []
    assert run("verify", str(run_dir / "checkpoint-100"), cwd=tmp_path).returncode == 0


def test_verify_of_an_interrupted_save_still_exits_1(sample, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(sample, copy)
    (copy / "metadata.json").unlink()
    proc = run("verify", str(copy), cwd=tmp_path)
    error_line(proc, 1, "verify")
    assert "metadata.json: missing" in proc.stdout


@pytest.mark.parametrize("command", ["inspect", "verify", "export-hf", "convert"])
def test_a_regular_file_is_reported_as_a_file(sample, tmp_path, command):
    file = sample / "metadata.json"
    extra: List[str] = {"export-hf": [str(tmp_path / "out")], "convert": [str(tmp_path / "out"), "--to", "zarr"]}.get(
        command, []
    )
    line = error_line(run(command, str(file), *extra, cwd=tmp_path), 2, command)
    assert "is a file, not a checkpoint directory" in line and "does not exist" not in line
    line = error_line(run(command, str(tmp_path / "absent"), *extra, cwd=tmp_path), 2, command)
    assert "does not exist" in line


# --------------------------------------------------------------------------- terminal width


@pytest.fixture(scope="module")
def long_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("wide") / "ckpt"
    dc.save(
        {
            LONG_KEY: dc.ShardedTensor.from_rank_offsets(LONG_KEY, torch.zeros(3, 4)),
            "short": dc.ShardedTensor.from_rank_offsets("short", torch.zeros(2)),
            "config": {"a_long_common_entry": "x" * 200},
        },
        path,
    )
    return path


def test_inspect_fits_the_terminal_width(long_keys, tmp_path):
    proc = run("inspect", str(long_keys), cwd=tmp_path, columns=70)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if not ln.startswith("note:")]
    assert LONG_KEY in lines, proc.stdout  # whole, on a line of its own (issue 39 item 7), the row below it
    assert max(len(ln) for ln in lines if ln != LONG_KEY) <= 70, proc.stdout
    assert "[3, 4]" in lines[lines.index(LONG_KEY) + 1]
    assert "short" in lines


def test_inspect_with_room_or_into_a_pipe_keeps_keys_whole(long_keys, tmp_path):
    wide = run("inspect", str(long_keys), cwd=tmp_path, columns=250)
    piped = run("inspect", str(long_keys), cwd=tmp_path)  # stdout is a pipe and $COLUMNS unset
    for proc in (wide, piped):
        assert proc.returncode == 0 and LONG_KEY in proc.stdout


# --------------------------------------------------------------------------- one throughput unit


def test_throughput_is_in_gib_per_s_everywhere(sample, tmp_path):
    converted = run("convert", str(sample), str(tmp_path / "z"), "--to", "zarr", "-v", "--progress", cwd=tmp_path)
    exported = run("export-hf", str(sample), str(tmp_path / "hf"), "-v", "--progress", cwd=tmp_path)
    for proc in (converted, exported):
        assert proc.returncode == 0, proc.stderr
        text = proc.stdout + proc.stderr
        assert "GiB/s" in text, text
        for other in ("GB/s", "MB/s", "MiB/s", "kB/s", "KiB/s"):
            assert other not in text.replace("GiB/s", ""), (other, text)
    # the library's report logged by -v (a save's and a conversion's summary) uses it too
    assert "convert of" in converted.stderr and "GiB/s" in converted.stderr.split("convert of", 1)[1]


# --------------------------------------------------------------------------- convert --to hf


def test_convert_to_hf_says_what_it_drops_once(sample, tmp_path):
    proc = run("convert", str(sample), str(tmp_path / "hf"), "--to", "HF", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout + proc.stderr
    assert text.count("the common state (") == 1 and text.count("ShardedObjects (") == 1, text
    assert proc.stderr == ""


# --------------------------------------------------------------------------- backend names


def test_backend_names_are_case_insensitive(sample, tmp_path):
    proc = run("convert", str(sample), str(tmp_path / "z"), "--to", "ZARR", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["target_backend"] == "zarr:1"
    proc = run("convert", str(sample), str(tmp_path / "s"), "--to", "SafeTensors:1", "--json", cwd=tmp_path)
    assert proc.returncode == 0 and json.loads(proc.stdout)["target_backend"] == "safetensors:1"


@pytest.mark.parametrize(
    "args, suggestion",
    [
        (["convert", "SRC", "DST", "--to", "zar"], "did you mean 'zarr'?"),
        (["convert", "SRC", "DST", "--to", "safetensor"], "did you mean 'safetensors'?"),
        (["demo", "--backend", "Zaar"], "did you mean 'zarr'?"),
        (["bench", "--engine", "tensorstor"], "did you mean 'tensorstore'?"),
    ],
)
def test_a_misspelled_name_gets_a_suggestion(tmp_path, args, suggestion):
    proc = run(*args, cwd=tmp_path)
    assert proc.returncode == 2 and suggestion in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- --engine tensorstore


def test_convert_reads_zarr_with_the_engine_chosen(sample, tmp_path):
    zarr_ckpt = tmp_path / "z"
    assert run("convert", str(sample), str(zarr_ckpt), "--to", "zarr", cwd=tmp_path).returncode == 0
    proc = run(
        "convert", str(zarr_ckpt), str(tmp_path / "s"), "--to", "safetensors", "--engine", "TensorStore", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "zarr:1 (read with tensorstore) -> safetensors:1" in proc.stdout
    # the engine is really the one registered for ("zarr", 1) in the command's process
    code = (
        "import sys; from dist_ckpt.cli import main; from dist_ckpt.backends.registry import StrategyAction, "
        "get_default_strategy; status = main(sys.argv[1:]); "
        "print(type(get_default_strategy(StrategyAction.LOAD_SHARDED, 'zarr', 1)).__name__); sys.exit(status)"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "convert",
            str(zarr_ckpt),
            str(tmp_path / "s2"),
            "--to",
            "safetensors",
            "--engine",
            "tensorstore",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip().splitlines()[-1] == "TensorStoreLoadShardedStrategy"


def test_bench_with_the_tensorstore_engine(tmp_path):
    proc = run(
        "bench",
        "--dir",
        str(tmp_path / "b"),
        "--size",
        "1",
        "--ranks",
        "2",
        "--backend",
        "zarr",
        "--engine",
        "tensorstore",
        "--json",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    doc: Dict[str, object] = json.loads(proc.stdout)
    assert doc["ok"] is True and doc["backend"] == "zarr:1" and doc["engine"] == "tensorstore"
