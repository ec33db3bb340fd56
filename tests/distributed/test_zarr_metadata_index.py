"""The root group's index of every zarr.json, saved by real ranks: each array's zarr.json is
written by the rank a hash of its key picks, so the index holds documents gathered from every
rank; a load with checksums in the saved layout (whole chunks, read without the engine's
library) reads none of the tensors' own zarr.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.zarr.layout import ATTR, ZARR_DIR
from dist_ckpt.backends.zarr.metadata_index import INDEX_FIELD
from dist_ckpt.backends.zarr.nodes import creates_array
from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreLoadShardedStrategy, TensorStoreSaveShardedStrategy
from dist_ckpt.backends.zarr.zarr_python import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy
from dist_ckpt.testing.layouts import full_tensor, tp_shards
from tests.object_reads import record_object_reads

from .helpers import assert_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)

ENGINES = {
    "zarr-python": (ZarrSaveShardedStrategy, ZarrLoadShardedStrategy),
    "tensorstore": (TensorStoreSaveShardedStrategy, TensorStoreLoadShardedStrategy),
}
KEYS = [f"layer{i}.weight" for i in range(12)]


def _state(tp: int, empty: bool = False):
    sd = {}
    for key in KEYS:
        sd.update(tp_shards(key, full_tensor(key, (8, 6), torch.float32), 0, tp, rank(), world(), empty=empty))
    return sd


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_every_ranks_documents_are_indexed_and_a_load_reads_none(shared_tmp_path: Path, engine, monkeypatch):
    save_strategy, load_strategy = ENGINES[engine]
    state = _state(world())
    creators = {creates_array(sh) for sh in state.values()}  # this rank creates some arrays
    dc.save(state, shared_tmp_path, sharded_strategy=save_strategy())
    tree = shared_tmp_path / ZARR_DIR
    index = json.loads((tree / "zarr.json").read_text())["attributes"][ATTR][INDEX_FIELD]
    assert_on_all_ranks(set(index) == {f"{key}/zarr.json" for key in KEYS}, str(sorted(index)))
    assert_on_all_ranks(all(index[n] == (tree / n).read_text() for n in index), "index differs from the files")
    # the arrays were created by several ranks (the hash spreads them), so the gather mattered
    made_here = torch.tensor([int(True in creators)])
    torch.distributed.all_reduce(made_here)
    assert_on_all_ranks(int(made_here) > 1, f"only {int(made_here)} rank(s) created arrays")

    read = record_object_reads(monkeypatch)
    request = _state(world(), empty=True)  # the saved layout
    out = dc.load(request, shared_tmp_path, sharded_strategy=load_strategy())
    monkeypatch.undo()
    for name, sh in state.items():
        assert_on_all_ranks(torch.equal(out[name], sh.data), name)
    tensor_docs = [k for k in read if k.endswith("zarr.json") and k != f"{ZARR_DIR}/zarr.json"]
    assert_on_all_ranks(tensor_docs == [], str(tensor_docs))
