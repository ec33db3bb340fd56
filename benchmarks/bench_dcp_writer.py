"""``dcp.save`` with dist_ckpt's StorageWriter next to DCP's FileSystemWriter and the raw disk.

One process (DCP saves without a process group) saves a state of ``--size-mib`` MiB of fp32 and
bf16 tensors (``--tensor-mib`` each) with ``--threads`` files, fsync on, in ``--rounds`` rounds;
each round measures, interleaved so that the disk's state drifts equally for all three, the raw
disk (the same bytes in ``--threads`` files, 64 MiB writes, fsync), ``dcp.save`` with DCP's
``FileSystemWriter(thread_count=..., sync_files=True)``, and with
``dist_ckpt.dcp.StorageWriter(thread_count=...)`` (crc32c of every item, atomic files, commit).
It prints the median GB/s of each and the ratios; the last checkpoint is loaded back with
``dist_ckpt.dcp.StorageReader`` (checksums verified) and compared bit-exactly. No timing is
asserted; exit 1 only if a loaded value differs.

Usage::

    python benchmarks/bench_dcp_writer.py --size-mib 1024 --threads 2 --rounds 3 --dir /disk/to/test
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

sys.path.insert(0, str(Path(__file__).resolve().parent))
from raw_io import BLOCK, write_whole  # noqa: E402

import dist_ckpt.dcp  # noqa: E402

MiB = 2**20


def make_state(size_mib: float, tensor_mib: float) -> Dict[str, torch.Tensor]:
    """Tensors of about ``tensor_mib`` MiB adding up to ``size_mib`` MiB, alternately fp32 and bf16."""
    state: Dict[str, torch.Tensor] = {}
    left = int(size_mib * MiB)
    gen = torch.Generator().manual_seed(0)
    i = 0
    while left > 0:
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        item = torch.empty((), dtype=dtype).element_size()
        numel = max(1, min(int(tensor_mib * MiB), left) // item)
        state[f"layer{i}.weight"] = torch.randn(numel, generator=gen).to(dtype)
        left -= numel * item
        i += 1
    return state


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_save(directory: Path, nbytes: int, threads: int) -> None:
    """The same bytes as ``threads`` files written concurrently, fsynced."""
    import threading

    directory.mkdir()
    block = memoryview(os.urandom(BLOCK))
    part = nbytes // threads
    workers = [
        threading.Thread(target=write_whole, args=(directory / f"raw_{i}.bin", part, block)) for i in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--size-mib", type=float, default=512.0, help="state size in MiB (default: %(default)s)")
    parser.add_argument("--tensor-mib", type=float, default=32.0, help="MiB per tensor (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="files / writer threads (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="directory on the disk to test")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)

    state = make_state(args.size_mib, args.tensor_mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    work = Path(tempfile.mkdtemp(prefix="bench_dcp_writer_", dir=args.dir))
    systems: Dict[str, Callable[[Path], None]] = {
        "raw disk": lambda d: raw_save(d, nbytes, args.threads),
        "DCP FileSystemWriter": lambda d: dcp_save(
            state, storage_writer=FileSystemWriter(str(d), thread_count=args.threads, sync_files=True)
        ),
        "dist_ckpt.dcp.StorageWriter": lambda d: dcp_save(
            state, storage_writer=dist_ckpt.dcp.StorageWriter(d, thread_count=args.threads)
        ),
    }
    seconds: Dict[str, List[float]] = {name: [] for name in systems}
    last = work / "last"
    try:
        for round_ in range(args.rounds):
            for n, (name, save) in enumerate(systems.items()):
                target = work / f"r{round_}_{n}"
                seconds[name].append(_timed(lambda: save(target)))
                if name.startswith("dist_ckpt") and round_ == args.rounds - 1:
                    target.rename(last)
                else:
                    shutil.rmtree(target)
        loaded = {k: torch.empty_like(v) for k, v in state.items()}
        dcp_load(loaded, storage_reader=dist_ckpt.dcp.StorageReader(last))
        ok = all(torch.equal(loaded[k], v) for k, v in state.items())
    finally:
        shutil.rmtree(work, ignore_errors=True)

    gbps = {name: nbytes / statistics.median(s) / 1e9 for name, s in seconds.items()}
    print(
        f"dcp.save of {nbytes / MiB:.0f} MiB ({len(state)} tensors), {args.threads} files, fsync, {args.rounds} rounds"
    )
    for name, rate in gbps.items():
        spread = ", ".join(f"{nbytes / s / 1e9:.2f}" for s in seconds[name])
        print(f"  {name:30s} {rate:6.2f} GB/s  (rounds: {spread})")
    ours, theirs, raw = gbps["dist_ckpt.dcp.StorageWriter"], gbps["DCP FileSystemWriter"], gbps["raw disk"]
    print(f"  StorageWriter / FileSystemWriter: {ours / theirs:.2f}")
    print(f"  StorageWriter / raw disk:         {ours / raw:.2f}")
    print(f"  FileSystemWriter / raw disk:      {theirs / raw:.2f}")
    if not ok:
        print("error: the checkpoint loaded back differs from the state saved", file=sys.stderr)
        return 1
    print("the last checkpoint loaded back through StorageReader (checksums verified): bit-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
