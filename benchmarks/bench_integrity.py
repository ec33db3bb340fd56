"""What ``verify_integrity=True`` (Megatron-Core's ``integrity.json``) costs at save and at load, with the
hashing spread over the ranks as dist_ckpt does it, against Megatron-Core's way (rank 0 hashes every file).

Spawns ``--world`` ranks (gloo), each with ``--rank-mib`` MiB of tensors, saved with the torch_dist
backend after a warm-up save. Each repeat, in this order: a save without the manifest, a save with
it, the spread hashing alone (``write_integrity_manifest``) and rank 0 alone hashing the same files
(Megatron-Core's way: the same SHA-256), a load, a verified load, and the spread verification
alone. Rank 0 prints medians and ratios. The files are in the page cache when hashed (they were
just written), so this measures the hashing, not the disk.

    .venv/bin/python benchmarks/bench_integrity.py --world 2 --rank-mib 256
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dist_ckpt as dc  # noqa: E402
from dist_ckpt.integrity.file_manifest import (  # noqa: E402
    INTEGRITY_MANIFEST_FILENAME,
    sha256_of,
    verify_integrity_manifest,
    write_integrity_manifest,
)

TENSOR_MIB = 32


def _timed(fn: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _state(rank: int, world: int, mib: int, fill: bool) -> Dict[str, dc.ShardedTensor]:
    rows = TENSOR_MIB * 2**20 // 4 // 1024
    out = {}
    for i in range(max(1, mib // TENSOR_MIB)):
        data = torch.randn(rows, 1024) if fill else torch.zeros(rows, 1024)
        out[f"w{i}"] = dc.ShardedTensor.from_rank_offsets(f"w{i}", data, (0, rank, world))
    return out


def _rank_zero_hashes_all(path: Path) -> None:
    if dist.get_rank() == 0:
        storage = dc.storage.open_storage(path)
        for info in storage.list(""):
            if info.key != INTEGRITY_MANIFEST_FILENAME:
                sha256_of(storage, info.key)


def _rank(rank: int, world: int, root: str, mib: int, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29581")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sd, target = _state(rank, world, mib, True), _state(rank, world, mib, False)
    backend = ("torch_dist", 1)
    dc.save(sd, Path(root) / "warm-up", sharded_strategy=backend)  # imports and first-touch costs
    rows: List[List[float]] = []
    for i in range(repeats):
        plain, verified = Path(root) / f"plain{i}", Path(root) / f"verified{i}"
        storage = dc.storage.open_storage(verified)
        rows.append(
            [
                _timed(lambda: dc.save(sd, plain, sharded_strategy=backend)),
                _timed(lambda: dc.save(sd, verified, sharded_strategy=backend, verify_integrity=True)),
                _timed(lambda: write_integrity_manifest(storage)),  # the spread hashing alone
                _timed(lambda: _rank_zero_hashes_all(verified)),  # Megatron-Core's: rank 0 hashes all
                _timed(lambda: dc.load(target, plain)),
                _timed(lambda: dc.load(target, verified, verify_integrity=True)),
                _timed(lambda: verify_integrity_manifest(storage)),
            ]
        )
        shutil.rmtree(plain, ignore_errors=True)
        shutil.rmtree(verified, ignore_errors=True)
    if rank == 0:
        save, save_v, spread, mcore, load, load_v, verify = (statistics.median(c) for c in zip(*rows))
        gib = mib * world / 1024
        Path(out).write_text(
            f"{gib:.2f} GiB on {world} ranks, torch_dist, median of {repeats}\n"
            f"save {save:.2f} s, with integrity.json {save_v:.2f} s (x{save_v / save:.2f})\n"
            f"load {load:.2f} s, verified {load_v:.2f} s (x{load_v / load:.2f})\n"
            f"hashing every file: spread over the ranks {spread:.2f} s, on rank 0 alone (Megatron-Core) "
            f"{mcore:.2f} s (x{mcore / spread:.2f}); verifying spread {verify:.2f} s\n"
        )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rank-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="bench_integrity_", dir=os.environ.get("BENCH_DIR"))
    out = os.path.join(root, "result.txt")
    try:
        mp.spawn(_rank, args=(args.world, root, args.rank_mib, args.repeats, out), nprocs=args.world)  # type: ignore[attr-defined,no-untyped-call]
        print(Path(out).read_text(), end="")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
