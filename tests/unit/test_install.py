"""What `make demo`, `make test` and `make check` install (scripts/install.sh through the Makefile).

The real Makefile and script run with a stand-in for Python that records each command line and
succeeds, so nothing is installed and each test takes well under a second.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import List

import pytest

from tests.paths import REPO_ROOT

#: a stand-in for $PYTHON: records its arguments, one line per call, and succeeds
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
"""


def _make(tmp_path: Path, *targets: str) -> List[str]:
    """Run ``make TARGETS`` in the checkout with the stand-in Python; the calls it made."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "log"
    env = {k: v for k, v in os.environ.items() if k != "DIST_CKPT_EXTRAS"}
    env["FAKE_LOG"] = str(log)
    cmd = ["make", "--no-print-directory", "-C", str(REPO_ROOT), f"PYTHON={python}", *targets]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return log.read_text().splitlines()


def _pip_installs(calls: List[str]) -> List[str]:
    return [c for c in calls if c.startswith("-m pip install") and "torch" not in c]


def test_make_demo_installs_the_library_alone(tmp_path: Path) -> None:
    calls = _make(tmp_path, "demo")
    (install,) = _pip_installs(calls)
    assert install.endswith(" -e ."), install  # no extras: no test servers, linters or docs toolchain
    assert calls[-1] == "-m dist_ckpt demo"


@pytest.mark.parametrize("target", ["install", "check"])
def test_make_test_and_check_install_every_extra(tmp_path: Path, target: str) -> None:
    # `make test` runs the same install target before the suite (scripts/run_tests.sh)
    (install,) = _pip_installs(_make(tmp_path, target))
    assert install.endswith(" -e .[all,test,docs]"), install


def test_the_editable_install_is_one_type_checkers_follow(tmp_path: Path) -> None:
    (install,) = _pip_installs(_make(tmp_path, "install-demo"))
    assert "--config-settings editable_mode=compat" in install, install


def test_make_test_installs_first() -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    dry = subprocess.run(
        ["make", "--no-print-directory", "-n", "-C", str(REPO_ROOT), "PYTHON=python", "test"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    assert 'DIST_CKPT_EXTRAS="all,test,docs" ./scripts/install.sh' in lines
    assert lines[-1] == "./scripts/run_tests.sh"
