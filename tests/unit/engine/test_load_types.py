"""What a type checker sees of `dist_ckpt.load()` in a user's script (mypy, strict).

``load`` returns the state dict, or ``(state_dict, missing_keys, unexpected_keys)`` with
``strict=RETURN_UNEXPECTED/RETURN_ALL`` (Megatron-Core's signature); its overloads on a literal
``strict`` make ``state["w"]`` type-check. mypy runs from ``tmp_path``, outside the checkout, on
the installed dist_ckpt: an editable install made by scripts/install.sh is one type checkers
follow (setuptools' default import-hook mode is not).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="mypy is in the test extra: pip install 'dist_ckpt[test]'")

USER_SCRIPT = """
from typing import Any, Dict, Set, Tuple

import dist_ckpt as dc
from dist_ckpt import StrictHandling

sd: Dict[str, Any] = {}
state = dc.load(sd, "ckpt")
w = state["w"]
state_dict, missing, unexpected = dc.load(sd, "ckpt", strict=StrictHandling.RETURN_ALL)
missing.add(state_dict["w"])
also: Tuple[Dict[str, Any], Set[str], Set[str]] = dc.load(sd, "ckpt", None, None, True, "return_unexpected")
logged: Dict[str, Any] = dc.load(sd, "ckpt", strict="log_all")
state[0]  # E: a state dict is not indexed by position
"""
#: torch and numpy are skipped (a full analysis of torch takes mypy a minute); dist_ckpt's own
#: modules are checked silently, as installed code is
CONFIG = """[mypy]
strict = True
follow_imports = silent
[mypy-torch.*,numpy.*,zarr.*,tensorstore.*,ml_dtypes.*,mpi4py.*,google_crc32c.*,obstore.*,safetensors.*,tqdm.*]
follow_imports = skip
ignore_missing_imports = True
"""


def test_a_user_script_type_checks_the_result_of_load(tmp_path: Path) -> None:
    (tmp_path / "user.py").write_text(USER_SCRIPT)
    (tmp_path / "mypy.ini").write_text(CONFIG)
    cmd = [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", str(tmp_path / "cache")]
    result = subprocess.run([*cmd, "user.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert not any("import-not-found" in e for e in errors), (
        "mypy cannot find the installed dist_ckpt: reinstall it with scripts/install.sh "
        "(pip install -e . --config-settings editable_mode=compat)\n" + result.stdout
    )
    expected = [str(number) for number, line in enumerate(USER_SCRIPT.splitlines(), 1) if "# E:" in line]
    assert [e.split(":")[1] for e in errors] == expected, result.stdout
