"""Start-up cost: `import dist_ckpt` loads only what every user needs (DESIGN: no heavy optional
imports at import time).

Each check runs a fresh interpreter, since this test process has imported everything already.
"""

from __future__ import annotations

import subprocess
import sys
from typing import List

from tests.paths import REPO_ROOT


def _loaded_after(code: str, modules: List[str]) -> List[str]:
    """Which of ``modules`` a fresh interpreter has imported after running ``code``."""
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {modules!r} if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )  # a hang guard, not a timing check
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_import_does_not_load_ml_dtypes() -> None:
    # ml_dtypes (numpy's bfloat16 and float8 types, about a second to import) is needed only to
    # view such tensors as numpy arrays
    assert _loaded_after("import dist_ckpt", ["ml_dtypes"]) == []


def test_the_numpy_view_of_a_bfloat16_tensor_loads_ml_dtypes() -> None:
    code = (
        "import torch\nfrom dist_ckpt.model.dtypes import tensor_to_numpy\n"
        "assert str(tensor_to_numpy(torch.ones(2, dtype=torch.bfloat16)).dtype) == 'bfloat16'"
    )
    assert _loaded_after(code, ["ml_dtypes"]) == ["ml_dtypes"]
