"""Reading parts of a checkpoint on one rank while a process group is initialized.

``load_plain_tensors``, ``load_tensors_metadata``, ``load_sharded_metadata`` and
``load_common_state_dict`` are local, as Megatron-Core's are: rank 0 may call them alone (to
inspect a checkpoint, convert it) while the other ranks do something else. Here the other ranks
wait in an MPI barrier, outside torch.distributed, so a function that waited for them in a
collective would never return: it runs in a thread with a time limit, and the test fails
instead of hanging.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.testing.layouts import full_tensor, tp_shards

from .helpers import assert_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)

#: how long rank 0 gives each call before it counts as waiting for the other ranks (a read of
#: this small checkpoint takes well under a second)
_GUARD_S = 60.0


def _state() -> Dict[str, Any]:
    sd: Dict[str, Any] = dict(tp_shards("w", full_tensor("w", (4 * world(), 3)), 0, world(), rank(), world()))
    sd["obj"] = dc.ShardedObject("obj", {"rank": rank()}, (world(),), (rank(),))
    sd["step"] = 7
    return sd


def _on_rank0_alone(fn: Callable[[], Any]) -> List[str]:
    """Run ``fn`` on rank 0 only, in a thread bounded by :data:`_GUARD_S`, while the other ranks
    wait in an MPI barrier (polled, so that they do not spin on the shared cores). Returns the
    problems seen on rank 0, the same list on every rank."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    problems: List[str] = []
    if rank() == 0:
        outcome: Dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = fn()
            except BaseException as e:  # noqa: BLE001 -- reported below
                outcome["error"] = e

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(_GUARD_S)
        if thread.is_alive():
            problems.append(f"still running after {_GUARD_S} s: it waits for the other ranks")
        elif "error" in outcome:
            problems.append(f"raised {outcome['error']!r}")
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.02)
    return list(comm.bcast(problems, root=0))


def test_one_rank_reads_parts_of_a_checkpoint_alone(shared_tmp_path: Path) -> None:
    dc.save(_state(), shared_tmp_path / "c")
    path = shared_tmp_path / "c"
    expected = full_tensor("w", (4 * world(), 3))
    results: Dict[str, Any] = {}

    def check(name: str, fn: Callable[[], Any]) -> None:
        problems = _on_rank0_alone(lambda: results.__setitem__(name, fn()))
        if problems:  # the same list on every rank: all fail alike, without a collective of torch's
            pytest.fail(f"{name} on rank 0 alone: {problems}")

    check("load_plain_tensors", lambda: dc.load_plain_tensors(path))
    check("load_tensors_metadata", lambda: dc.load_tensors_metadata(path))
    check("load_sharded_metadata", lambda: dc.load_sharded_metadata(path))
    check("load_common_state_dict", lambda: dc.load_common_state_dict(str(path)))
    ok = rank() != 0 or (
        torch.equal(results["load_plain_tensors"]["w"], expected)
        and results["load_tensors_metadata"]["w"].global_shape == tuple(expected.shape)
        and "w" in results["load_sharded_metadata"]
        and any(k.startswith("obj") for k in results["load_sharded_metadata"])
        and results["load_common_state_dict"]["step"] == 7
    )
    assert_on_all_ranks(ok, f"rank 0 read {results}")
    # the process group is still in step: a collective load works right after
    loaded = dc.load(_state(), path)
    ok = loaded["step"] == 7 and all(torch.equal(loaded[k], v.data) for k, v in _state().items() if "@" in k)
    assert_on_all_ranks(ok, "load after the local reads")


def test_every_rank_may_still_call_them_together(shared_tmp_path: Path) -> None:
    dc.save(_state(), shared_tmp_path / "c")
    tensors = dc.load_plain_tensors(shared_tmp_path / "c")
    assert_on_all_ranks(torch.equal(tensors["w"], full_tensor("w", (4 * world(), 3))))
