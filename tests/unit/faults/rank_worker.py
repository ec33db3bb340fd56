"""One rank of a job in which tests/unit/faults/test_rank_death.py kills another rank.

Run as ``python -m tests.unit.faults.rank_worker RANK WORLD PORT CKPT VICTIM WHERE OUT``. Every
rank joins a gloo process group and saves (or loads) a row-split tensor; rank VICTIM exits on
the spot (``os._exit``: no error report, as a SIGKILL or an OOM kill would) when it reaches
WHERE: ``write`` (its own tensor files), ``gather`` (the sharding validation's gather),
``commit`` (rank 0 only: just before ``metadata.json``) or ``load`` (reading tensors). Each
survivor writes what it got to ``OUT/<rank>.json``: the error's type, message, failed ranks and
step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict

from tests.deadlines import scaled


def _die_at(where: str, rank: int, victim: int) -> None:
    """Patch the library so that ``victim`` exits when it reaches ``where``."""
    if rank != victim:
        return
    from dist_ckpt.backends.safetensors import strategy as safetensors_strategy
    from dist_ckpt.backends.safetensors.load import TensorIndex
    from dist_ckpt.engine import save as engine_save
    from dist_ckpt.engine.checks import sharding

    def die(*args: Any, **kwargs: Any) -> Any:
        os._exit(9)

    target, name = {
        "write": (safetensors_strategy.SafetensorsSaveShardedStrategy, "_write_files"),
        "gather": (sharding, "gather_bytes"),
        "commit": (engine_save, "save_config"),
        "load": (TensorIndex, "lookup"),
    }[where]
    if not hasattr(target, name):  # the library moved: patching nothing would let the victim live
        raise AttributeError(f"{target!r} has no {name!r} to replace; update rank_worker")
    setattr(target, name, die)


def main(rank: int, world: int, port: int, ckpt: str, victim: int, where: str, out: str) -> None:
    import torch

    import dist_ckpt as dc
    from dist_ckpt.testing import init_process_group

    init_process_group(rank, world, port, timeout_s=scaled(60))
    shard = torch.arange(16.0).reshape(4, 4) + 100 * rank

    def sd() -> Dict[str, Any]:
        return {"w": dc.ShardedTensor.from_rank_offsets("w", shard.clone(), (0, rank, world))}

    if where == "load":
        dc.save(sd(), ckpt)
    _die_at(where, rank, victim)
    result: Dict[str, Any] = {"type": None}
    try:
        if where == "load":
            dc.load(sd(), ckpt)
        else:
            dc.save(sd(), ckpt)
    except Exception as e:  # noqa: BLE001 -- reported to the test
        result = {
            "type": type(e).__name__,
            "message": str(e),
            "failed_ranks": list(getattr(e, "failed_ranks", ())),
            "step": getattr(e, "step", ""),
        }
    try:  # a user's clean-up must still work on the broken group
        torch.distributed.destroy_process_group()
    except Exception as e:  # noqa: BLE001 -- reported to the test
        result["destroy_error"] = repr(e)
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6], sys.argv[7])
