"""scripts/python_env.sh: which Python `make demo` / `make test` install into (README "Installing").

Each test runs the real script on a copy of it in ``tmp_path`` (so a ``.venv`` it creates lands
there), with a PATH that puts the Python under test first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Dict, Optional

import pytest

from tests.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "python_env.sh"
SYSTEM_PYTHON = Path("/usr/bin/python3")


def _externally_managed(python: Path) -> bool:
    code = (
        "import os, sysconfig; print(os.path.exists(os.path.join(sysconfig.get_path('stdlib'), 'EXTERNALLY-MANAGED')))"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout
    return out.strip() == "True"


def _run(root: Path, path_dirs: str, extra: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess[str]:
    """Run ``root/scripts/python_env.sh`` with PATH ``path_dirs`` and no venv / conda / PYTHON set."""
    scripts = root / "scripts"
    scripts.mkdir(parents=True, exist_ok=True)
    shutil.copy2(SCRIPT, scripts / SCRIPT.name)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHON", "PYTHONHOME")}
    env["PATH"] = path_dirs
    env.update(extra or {})
    return subprocess.run(["bash", str(scripts / SCRIPT.name)], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(
    not SYSTEM_PYTHON.exists() or not _externally_managed(SYSTEM_PYTHON),
    reason="needs an externally managed /usr/bin/python3 (Debian's)",
)
def test_an_externally_managed_python_gets_the_project_venv_once(tmp_path):
    first = _run(tmp_path, "/usr/bin:/bin")
    if first.returncode != 0 and "python3-venv" in first.stderr:
        pytest.skip("this system Python has no venv module")
    assert first.returncode == 0, first.stderr
    venv_python = tmp_path / ".venv" / "bin" / "python"
    assert first.stdout.strip() == str(venv_python)
    assert "externally managed" in first.stderr and venv_python.exists()
    again = _run(tmp_path, "/usr/bin:/bin")  # the venv is reused, silently
    assert again.returncode == 0 and again.stdout.strip() == str(venv_python) and again.stderr == ""
    # and once that venv is active, it is used as is
    active = _run(
        tmp_path / "elsewhere", f"{venv_python.parent}:/usr/bin:/bin", {"VIRTUAL_ENV": str(venv_python.parent.parent)}
    )
    assert active.returncode == 0 and active.stdout.strip() == str(venv_python.parent / "python3")


def test_a_python_with_torch_that_is_not_externally_managed_is_used_as_is(tmp_path):
    python = Path(sys.executable)
    stdlib = Path(sysconfig.get_path("stdlib"))
    if sys.prefix != sys.base_prefix or (stdlib / "EXTERNALLY-MANAGED").exists():
        pytest.skip("the test's Python is a venv or externally managed")
    if not (python.parent / "python3").exists():
        pytest.skip("no python3 beside the test's Python")
    result = _run(tmp_path, f"{python.parent}:/usr/bin:/bin")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(python.parent / "python3") and not (tmp_path / ".venv").exists()


def test_an_explicit_python_wins(tmp_path):
    result = _run(tmp_path, "/usr/bin:/bin", {"PYTHON": sys.executable})
    assert result.returncode == 0 and result.stdout.strip() == sys.executable
    assert not (tmp_path / ".venv").exists()
