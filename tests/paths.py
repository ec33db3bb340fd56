"""Where the test tree's fixed files are, for tests at any depth of ``tests/``."""

from pathlib import Path

#: the repository root (the directory holding ``dist_ckpt/`` and ``tests/``)
REPO_ROOT = Path(__file__).resolve().parent.parent
#: committed checkpoints of every format version (see ``tests/golden/make_golden.py``)
GOLDEN_DIR = REPO_ROOT / "tests" / "golden"
