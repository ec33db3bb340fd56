"""Write a golden checkpoint of the state in :mod:`tests.golden.state` with 2 spawned ranks.

Run once, when a format version is introduced, and commit the result::

    PYTHONPATH=. python -m tests.golden.make_golden tests/golden/safetensors_index_v1 safetensors 1

Never regenerate an existing golden directory: its point is that it was written by an older
dist_ckpt.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from dist_ckpt.serialization import save
from dist_ckpt.testing import spawn_ranks

from .state import WORLD, sharded_state


def _save(rank: int, world: int, out: str, backend: str, version: int) -> None:
    save(sharded_state(rank, world), out, sharded_strategy=(backend, version))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("backend")
    parser.add_argument("version", type=int)
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; golden checkpoints are never rewritten")
    spawn_ranks(_save, WORLD, str(args.out), args.backend, args.version)
    for tmp in args.out.rglob(".*.tmp-*"):
        tmp.unlink()
    shutil.rmtree(args.out / "__pycache__", ignore_errors=True)
    print(f"wrote {args.out}: {sorted(str(p.relative_to(args.out)) for p in args.out.rglob('*') if p.is_file())}")


if __name__ == "__main__":
    main()
