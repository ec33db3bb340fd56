"""scripts/run_tests.sh (what `make test` runs): every stage runs, and a summary says how each ended.

The script is run for real with stand-ins for Python and mpiexec that print what pytest and mkdocs
would and exit as told, so these tests take a second and check only the script's own logic.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Dict

from tests.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "run_tests.sh"

#: a stand-in for $PYTHON: runs ``-c`` code with the real Python, and answers each stage with the
#: output and exit status its environment variable names (``docs``, ``unit``, ``ranks``)
FAKE_PYTHON = """#!/usr/bin/env bash
case "$*" in
    -c*) exec {python} "$@" ;;
    *mkdocs*) echo "mkdocs ran"; exit "$FAKE_DOCS" ;;
    *tests/unit*) echo "$FAKE_UNIT_LINE"; exit "$FAKE_UNIT" ;;
    *tests/distributed*) echo "$FAKE_RANKS_LINE"; exit "$FAKE_RANKS" ;;
esac
exit 99
"""
#: a stand-in for mpiexec: records the rank count, then runs the command as one process
FAKE_MPIEXEC = """#!/usr/bin/env bash
echo "mpiexec $2" >> "$FAKE_LOG"
shift 2
exec "$@"
"""


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _run(tmp_path: Path, outcomes: Dict[str, str]) -> subprocess.CompletedProcess[str]:
    python = _executable(tmp_path / "python", FAKE_PYTHON.format(python=sys.executable))
    mpiexec = _executable(tmp_path / "mpiexec", FAKE_MPIEXEC)
    env = dict(os.environ, PYTHON=str(python), MPIEXEC=str(mpiexec), TMPDIR=str(tmp_path))
    env.update(FAKE_LOG=str(tmp_path / "log"), FAKE_UNIT_LINE="3 failed, 5 passed in 1.50s")
    env.update(FAKE_RANKS_LINE="7 passed, 1 skipped in 2.00s (0:00:02)", **outcomes)
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)


def test_a_failed_stage_does_not_stop_the_others_and_the_summary_says_which_failed(tmp_path: Path) -> None:
    result = _run(tmp_path, {"FAKE_DOCS": "1", "FAKE_UNIT": "1", "FAKE_RANKS": "0"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert (tmp_path / "log").read_text().split("\n") == ["mpiexec 2", "mpiexec 4", ""]
    summary = result.stdout.split("== summary\n")[1].splitlines()
    assert summary == [
        "FAILED  documentation (mkdocs --strict: any warning fails) (exit 1)",
        "FAILED  single-process tests (exit 1): 3 failed, 5 passed in 1.50s",
        "ok      multi-rank tests at 2 ranks: 7 passed, 1 skipped in 2.00s (0:00:02)",
        "ok      multi-rank tests at 4 ranks: 7 passed, 1 skipped in 2.00s (0:00:02)",
    ]
    # each stage's own output, pytest's closing line included, is shown as it comes
    assert result.stdout.count("7 passed, 1 skipped in 2.00s") == 4
    assert list(tmp_path.glob("tmp.*")) == [], "the stages' logs are left behind"


def test_the_last_stage_failing_fails_the_run(tmp_path: Path) -> None:
    result = _run(tmp_path, {"FAKE_DOCS": "0", "FAKE_UNIT": "0", "FAKE_RANKS": "1"})
    assert result.returncode == 1
    assert result.stdout.splitlines()[-1].startswith("FAILED  multi-rank tests at 4 ranks (exit 1)")


def test_every_stage_passing_exits_0(tmp_path: Path) -> None:
    result = _run(tmp_path, {"FAKE_DOCS": "0", "FAKE_UNIT": "0", "FAKE_RANKS": "0"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout and result.stdout.count("\nok      ") == 4
