"""torch_dist at 2 and 4 ranks: Megatron-Core's golden checkpoints loaded resharded, plain DCP
checkpoints written by ``torch.distributed.checkpoint.save`` loaded resharded, and asynchronous
saves that write the same files as synchronous ones.

Saving and loading dist_ckpt's own states in every layout is the conformance suite's job
(``test_resharding.py`` runs it for every registered backend, torch_dist included).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dist_ckpt as dc
from dist_ckpt.asynchronous.queue import AsyncCallsQueue
from tests.golden.torch_dist import expected as E
from tests.torch_dist_golden import STYLES, check_loaded, fixture_dir, golden_requests

from .helpers import assert_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("name", sorted(E.FIXTURES))
def test_golden_fixture_loads_resharded(name: str, style: str) -> None:
    """Every tensor split over this world in another layout than megatron-core saved it (or cut
    into other flattened ranges), every ShardedObject and the common state, bit for bit."""
    requests, expected = golden_requests(name, rank(), world(), style)
    loaded = dc.load(requests, fixture_dir(name))
    problems = check_loaded(name, loaded, expected)
    assert_on_all_ranks(not problems, "; ".join(problems[:5]))


def test_golden_fixture_metadata_is_local(tmp_path: Path) -> None:
    """load_tensors_metadata and load_sharded_metadata need no other rank (rank 0 alone calls them)."""
    ok = True
    if rank() == 0:
        name = "flat_legacy_mcore015"
        tensors = dc.load_tensors_metadata(fixture_dir(name))
        objects = dc.load_sharded_metadata(fixture_dir(name))
        ok = set(tensors) == {t.key for t in E.FIXTURES[name].tensors} and set(E.expected_objects(name)) <= set(objects)
    assert_on_all_ranks(ok, "metadata of the legacy fixture differs")


def _plain_dcp_state(full: torch.Tensor, step: int) -> dict:
    """Each rank's part of a state saved with plain DCP, as torchtitan does: a DTensor sharded on
    rows over the world, a replicated tensor, and plain values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world(),))
    return {
        "model": {
            "w": distribute_tensor(full.clone(), mesh, [Shard(0)]),
            "norm": torch.arange(6, dtype=torch.bfloat16),
        },
        "step": step,
        "blob": io.BytesIO(b"rng"),
        "optim": {"param_groups": [{"lr": 0.1, "params": [0]}]},
    }


def test_plain_dcp_checkpoint_loads_resharded(shared_tmp_path: Path) -> None:
    """A directory written by torch.distributed.checkpoint.save (no metadata.json) loads with
    dist_ckpt.load: rows saved across ranks are read as column halves; plain values come back as
    the common state, nested as they were saved."""
    import torch.distributed.checkpoint as dcp

    full = torch.arange(8 * 4 * world(), dtype=torch.float32).reshape(8, 4 * world())
    dcp.save(_plain_dcp_state(full, 3), checkpoint_id=str(shared_tmp_path))
    dist.barrier()
    cols = full.shape[1] // world()
    request = {
        "w": dc.ShardedTensor.from_rank_offsets("model.w", torch.zeros(8, cols), (1, rank(), world())),
        "norm": dc.ShardedTensor.from_rank_offsets(
            "model.norm", torch.zeros(6, dtype=torch.float32), replica_id=rank()
        ),
    }
    loaded = dc.load(request, shared_tmp_path)
    ok = (
        torch.equal(loaded["w"], full[:, rank() * cols : (rank() + 1) * cols])
        and torch.equal(loaded["norm"], torch.arange(6, dtype=torch.float32))
        and loaded["step"] == 3
        and loaded["blob"].getvalue() == b"rng"
        and loaded["optim"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    )
    assert_on_all_ranks(ok, f"loaded {loaded}")


def _state(scale: float) -> dict:
    layers = 4
    sd: dict = {
        "emb": dc.ShardedTensor.from_rank_offsets(
            "emb", torch.full((4, 6), scale * (rank() + 1), dtype=torch.bfloat16), (0, rank(), world())
        ),
        "rng": dc.ShardedObject("rng", {"seed": rank()}, (world(),), (rank(),)),
        "iteration": 7,
    }
    for layer in range(layers):
        sd[f"l{layer}"] = dc.ShardedTensor.from_rank_offsets(
            "layers.w", torch.full((2,), scale * layer), (0, layer, layers), replica_id=rank(), prepend_axis_num=1
        )
    return sd


def test_async_save_writes_the_files_a_sync_save_writes(shared_tmp_path: Path) -> None:
    """The background save of torch_dist produces the same DCP files, byte for byte, and the
    checkpoint loads; the tensors may change as soon as the async call returns."""
    dc.save(_state(1.0), shared_tmp_path / "sync", sharded_strategy=("torch_dist", 1))
    state = _state(1.0)
    queue = AsyncCallsQueue(persistent=False)
    request = dc.save(state, shared_tmp_path / "async", sharded_strategy=("torch_dist", 1), async_sharded_save=True)
    assert request is not None
    state["emb"].data.fill_(-1)  # after the snapshot: not saved
    queue.schedule_async_request(request)
    queue.close()
    ok = True
    if rank() == 0:
        sync_files = sorted(p.name for p in (shared_tmp_path / "sync").glob("__*.distcp"))
        async_files = sorted(p.name for p in (shared_tmp_path / "async").glob("__*.distcp"))
        same = [
            (shared_tmp_path / "sync" / n).read_bytes() == (shared_tmp_path / "async" / n).read_bytes()
            for n in sync_files
        ]
        ok = sync_files == async_files and all(same) and (shared_tmp_path / "async" / "metadata.json").exists()
    assert_on_all_ranks(ok, "async files differ from sync files")
    request_sd = {
        "emb": dc.ShardedTensor.from_rank_offsets("emb", torch.zeros(4 * world(), 6, dtype=torch.bfloat16)),
        "rng": dc.ShardedObject("rng", None, (world(),), ((rank() + 1) % world(),)),
    }
    loaded = dc.load(request_sd, shared_tmp_path / "async", validate_access_integrity=False)
    expected_emb = torch.cat([torch.full((4, 6), float(r + 1), dtype=torch.bfloat16) for r in range(world())])
    ok = torch.equal(loaded["emb"], expected_emb) and loaded["rng"] == {"seed": (rank() + 1) % world()}
    assert_on_all_ranks(ok, f"async checkpoint loaded {loaded}")
