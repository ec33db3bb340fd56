"""Write a golden checkpoint of the state in :mod:`tests.golden.state` with 2 spawned ranks.

Run once, when a format version is introduced, and commit the result::

    PYTHONPATH=. python -m tests.golden.make_golden tests/golden/safetensors_index_v1 safetensors 1
    PYTHONPATH=. python -m tests.golden.make_golden tests/golden/safetensors_index_v2 safetensors 1 --block-bytes 32
    PYTHONPATH=. python -m tests.golden.make_golden tests/golden/safetensors_index_v3 safetensors 1 --block-bytes 32
    PYTHONPATH=. python -m tests.golden.make_golden tests/golden/safetensors_records safetensors 1 --block-bytes 32
    PYTHONPATH=. python -m tests.golden.make_golden tests/golden/zarr_records zarr 1
    PYTHONPATH=. python -m tests.golden.make_golden tests/golden/zarr_dot_keys_records zarr 1

(``*_records``: metadata.json lists the integrity records, issue 15; ``safetensors_records`` was
made when the index was at version 2. ``zarr_dot_keys_records``: chunk keys ``c.<i>.<j>``, issue
17; the zarr goldens before it have ``c/<i>/<j>``.)

(``--block-bytes``: a small checksum block, so that shards span several blocks.)

Never regenerate an existing golden directory: its point is that it was written by an older
dist_ckpt.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any, Optional

from dist_ckpt.engine.save import save
from dist_ckpt.testing import spawn_ranks

from .state import WORLD, sharded_state


def _save(rank: int, world: int, out: str, backend: str, version: int, block_bytes: Optional[int]) -> None:
    strategy: Any = (backend, version)
    if block_bytes is not None:
        from dist_ckpt.backends.safetensors.strategy import SafetensorsSaveOptions, SafetensorsSaveShardedStrategy

        strategy = SafetensorsSaveShardedStrategy(SafetensorsSaveOptions(checksum_block_bytes=block_bytes))
    save(sharded_state(rank, world), out, sharded_strategy=strategy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("backend")
    parser.add_argument("version", type=int)
    parser.add_argument("--block-bytes", type=int, default=None)
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; golden checkpoints are never rewritten")
    spawn_ranks(_save, WORLD, str(args.out), args.backend, args.version, args.block_bytes)
    for tmp in args.out.rglob(".*.tmp-*"):
        tmp.unlink()
    shutil.rmtree(args.out / "__pycache__", ignore_errors=True)
    print(f"wrote {args.out}: {sorted(str(p.relative_to(args.out)) for p in args.out.rglob('*') if p.is_file())}")


if __name__ == "__main__":
    main()
