"""Run a script as the docs say -- ``python X.py`` or ``torchrun --nproc-per-node N X.py`` -- for
the tests of the README's and the docs' programs.

torchrun gets ``--standalone`` (a free port, so that concurrent runs never share one). One known
failure of torch itself is retried once: a rank that finished its work aborts while the
interpreter tears down, with ``terminate called without an active exception`` (gloo's C++ threads
at exit; see pytorch/pytorch#179291). dist_ckpt's own collectives wait until gloo lets go of
their tensors (``collectives.distributed.wait_released``), so only a script's own collectives can still
set it off. Nothing else is retried, and the retry starts from a fresh working directory
(``prepare``), so a retried run proves the same as a first one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, List, Optional

from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
#: what a rank prints when std::terminate runs at interpreter exit (the torch teardown race)
TEARDOWN_ABORT = "terminate called without an active exception"


def command(ranks: Optional[int], *script: str) -> List[str]:
    """``python SCRIPT`` for ``ranks=None``, else ``python -m torch.distributed.run --standalone
    --nproc-per-node RANKS SCRIPT`` (torchrun, also for one rank)."""
    if ranks is None:
        return [sys.executable, *script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *script]


def run(
    workdir: Path,
    ranks: Optional[int],
    *script: str,
    prepare: Optional[Callable[[], None]] = None,
    retry_teardown_abort: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in ``workdir`` with this checkout on PYTHONPATH: with torchrun on ``ranks``
    ranks, or with plain ``python`` for ``ranks=None``.

    Args:
        prepare: lays out ``workdir`` (called before each attempt, on an emptied directory).
        retry_teardown_abort: retry once after the torch teardown abort (module docstring).
    """
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    for attempt in range(2):
        if prepare is not None:
            prepare()
        proc = subprocess.run(
            command(ranks, *script), cwd=workdir, env=env, capture_output=True, text=True, timeout=600
        )  # a hang guard, not a timing check
        if proc.returncode == 0 or not retry_teardown_abort or TEARDOWN_ABORT not in proc.stderr or attempt:
            return proc
    raise AssertionError("unreachable")
