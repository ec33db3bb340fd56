"""benchmarks/bench_scale.py as a user runs it: a small simulated run, into a directory that does
not exist yet (``--dir`` creates it, as the help text promises to write there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.paths import REPO_ROOT


def test_dir_that_does_not_exist_is_created(tmp_path: Path) -> None:
    target = tmp_path / "not" / "yet"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, "benchmarks/bench_scale.py", "--worlds", "2", "--tensors", "5", "--dir", str(target)]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert target.is_dir()
    assert list(target.iterdir()) == []  # the run's own temporary directory was removed
