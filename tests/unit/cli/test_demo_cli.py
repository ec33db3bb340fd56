"""The ``dist-ckpt demo`` command, run through its real entry point in a subprocess.

The demo saves from 2 spawned ranks, reloads resharded on them and whole in the parent, and
verifies bit-exactly; these tests check its exit status and output, and that a wrong value does
make it fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List, Sequence

import pytest

from dist_ckpt import check_is_distributed_checkpoint
from dist_ckpt.cli import main
from dist_ckpt.tools.gpt_state import dp_flat_ranges

SMALL = ["--ranks", "2", "--size", "1"]
# run the CLI in-process after making the parent's expected values wrong (seed + 1); the spawned
# ranks import the real module, so only the single-process verification can fail
_CORRUPTING_MAIN = """
import sys
import dist_ckpt.tools.gpt_state as demo
from dist_ckpt.cli import main
real = demo.expected_values
demo.expected_values = lambda sh, seed: real(sh, seed + 1)
sys.exit(main(sys.argv[1:]))
"""


def _run(args: List[str], cwd: Path, main: Sequence[str] = ("-m", "dist_ckpt")) -> subprocess.CompletedProcess[str]:
    """Run ``python <main> <args>`` in ``cwd``; the demo's ranks are spawned by that process."""
    cmd = [sys.executable, *main, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )  # a hang guard, not a timing check


def test_demo_saves_reloads_and_verifies(tmp_path: Path) -> None:
    proc = _run(["demo", *SMALL, "--dir", str(tmp_path)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "step  layout" in out and "GiB/s" in out
    assert "TP=2 DP=1" in out  # save layout
    assert "TP=1 DP=2" in out  # resharded load on the ranks
    assert "no process group" in out  # whole load in the parent
    assert out.count("bit-exact") == 2 and "FAILED" not in out
    assert "45 tensors" in out and "files" in out
    assert list(tmp_path.iterdir()) == [], "the checkpoint must be deleted without --keep"


def test_demo_keep_leaves_a_committed_checkpoint(tmp_path: Path) -> None:
    proc = _run(["demo", *SMALL, "--dir", str(tmp_path), "--keep"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (ckpt,) = tmp_path.iterdir()
    assert check_is_distributed_checkpoint(ckpt)
    assert str(ckpt) in proc.stdout


def test_demo_exits_1_when_a_loaded_value_differs(tmp_path: Path) -> None:
    proc = _run(["demo", *SMALL, "--dir", str(tmp_path)], tmp_path, main=("-c", _CORRUPTING_MAIN))
    assert proc.returncode == 1
    assert "FAILED" in proc.stdout
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and "verification failed" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_exits_0(tmp_path: Path) -> None:
    proc = _run(["demo", "--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "usage: dist-ckpt demo" in proc.stdout and "--ranks N" in proc.stdout


def test_bad_option_exits_2(tmp_path: Path) -> None:
    proc = _run(["demo", "--no-such-option"], tmp_path)
    assert proc.returncode == 2
    assert "usage: dist-ckpt demo" in proc.stderr and "--no-such-option" in proc.stderr


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["demo", "--ranks", "3"],
        ["demo", "--size", "-1"],
        ["demo", "--backend", "nope"],
        ["demo", "--backend", "zarr:99"],
    ],
)
def test_usage_errors_exit_2(args: List[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert "usage: dist-ckpt" in capsys.readouterr().err


def test_top_level_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "demo" in capsys.readouterr().out


@pytest.mark.parametrize("numels, dp", [([6, 10, 4], 2), ([5, 0, 7, 3], 3), ([9], 4), ([1, 1], 4)])
def test_dp_flat_ranges_partition_every_chunk(numels: List[int], dp: int) -> None:
    covered = [[0] * n for n in numels]
    for dp_rank in range(dp):
        for chunk, rng in enumerate(dp_flat_ranges(numels, dp, dp_rank)):
            if rng is not None:
                assert 0 <= rng.start < rng.stop <= numels[chunk]
                for i in range(rng.start, rng.stop):
                    covered[chunk][i] += 1
    assert all(c == 1 for chunk in covered for c in chunk)
