"""``load_tensors_metadata`` describes each stored tensor as it was saved, for every backend.

A tensor saved as flattened ranges (distributed-optimizer state) is described with
``local_shape == global_shape ==`` its shape and a ``flattened_range`` covering all of it, so
``load(load_tensors_metadata(d), d)`` returns it flat, beside the other tensors with their shapes
(Megatron-Core's behaviour). Saved by several "virtual ranks" in one process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.safetensors.index import INDEX_FILENAME, INDEX_VERSION, SAFETENSORS_DIR
from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreLoadShardedStrategy
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.model.stored_metadata import shaped, stored_tensor_metadata
from dist_ckpt.testing.layouts import bitwise_equal, flat_shards, full_tensor, tp_shards
from tests.unit.backends.safetensors.legacy_index import write_index_document, write_legacy_index

#: (backend saved with, loader of the metadata and the load: None = the registered one)
ENGINES = {
    "safetensors": (("safetensors", 1), None),
    "zarr": (("zarr", 1), None),
    "tensorstore": (("zarr", 1), TensorStoreLoadShardedStrategy),
    "torch_dist": (("torch_dist", 1), None),
}
FLAT = {"opt.exp_avg": (24, 10), "opt.dp1": (6, 4), "opt.empty": (0, 4)}
SHAPED = {"w": (16, 12), "scalar": ()}


@pytest.fixture(params=sorted(ENGINES))
def saved(request: pytest.FixtureRequest, tmp_path: Path) -> Tuple[Path, Any]:
    backend, loader = ENGINES[request.param]
    sd: Dict[str, ShardedTensor] = {}
    # TP=2 x DP=2 flattened ranges with uneven cuts; DP=1 (each range a whole chunk); no elements
    sd.update(flat_shards("opt.exp_avg", full_tensor("opt.exp_avg", FLAT["opt.exp_avg"]), 0, 2, 2, 0, 1))
    sd.update(flat_shards("opt.dp1", full_tensor("opt.dp1", FLAT["opt.dp1"], torch.bfloat16), 1, 2, 1, 0, 1))
    sd["empty"] = ShardedTensor.from_rank_offsets_flat(
        "opt.empty", torch.zeros(0), FLAT["opt.empty"], flattened_range=slice(0, 0)
    )
    sd.update(tp_shards("w", full_tensor("w", SHAPED["w"]), 1, 2, 0, 1))
    sd["s"] = ShardedTensor.from_rank_offsets("scalar", full_tensor("scalar", ()))
    dc.save(sd, tmp_path / "ckpt", sharded_strategy=backend)
    return tmp_path / "ckpt", None if loader is None else loader()


def _full(key: str) -> torch.Tensor:
    shape = {**FLAT, **SHAPED}[key]
    return full_tensor(key, shape, torch.bfloat16 if key == "opt.dp1" else torch.float32)


def test_metadata_describes_flattened_tensors_as_saved(saved: Tuple[Path, Any]) -> None:
    path, loader = saved
    for meta in (dc.load_tensors_metadata(path, loader), dc.load_sharded_metadata(path, loader)):
        assert set(meta) == set(FLAT) | set(SHAPED)
        for key, shape in FLAT.items():
            sh = meta[key]
            assert sh.local_shape == sh.global_shape == shape and sh.global_offset == (0,) * len(shape)
            assert sh.flattened_range == slice(0, sh.global_shape[0] * sh.global_shape[1]) and sh.data is not None
            assert tuple(sh.data.shape) == (sh.flattened_range.stop,) and sh.data.device.type == "meta"
        for key, shape in SHAPED.items():
            sh = meta[key]
            assert sh.local_shape == sh.global_shape == shape and sh.flattened_range is None


def test_loading_the_metadata_returns_flattened_tensors_flat(saved: Tuple[Path, Any]) -> None:
    path, loader = saved
    out = dc.load(dc.load_tensors_metadata(path, loader), path, sharded_strategy=loader)
    for key in FLAT:
        assert bitwise_equal(out[key], _full(key).flatten()), key
    for key in SHAPED:
        assert bitwise_equal(out[key], _full(key)), key
    plain = dc.load_plain_tensors(path)  # Megatron-Core: load of the metadata
    assert all(bitwise_equal(plain[k], out[k]) for k in out)
    whole = dc.unshard(path)  # every tensor with its shape
    assert all(bitwise_equal(whole[k], _full(k)) for k in whole) and set(whole) == set(out)


def test_shaped_description_loads_with_the_shape(saved: Tuple[Path, Any]) -> None:
    path, loader = saved
    request = {k: shaped(sh) for k, sh in dc.load_tensors_metadata(path, loader).items()}
    out = dc.load(request, path, sharded_strategy=loader)
    assert all(bitwise_equal(out[k], _full(k)) for k in out)


def _save_flat_and_whole(path: Path) -> Path:
    full = full_tensor("opt", (6, 4))
    sd = dict(flat_shards("opt", full, 0, 1, 2, 0, 1))
    sd["w"] = ShardedTensor.from_rank_offsets("w", full)
    dc.save(sd, path)
    return path / SAFETENSORS_DIR / INDEX_FILENAME


def test_safetensors_index_records_flattened_tensors(tmp_path: Path) -> None:
    index_path = _save_flat_and_whole(tmp_path / "c")
    doc = json.loads(index_path.read_text())
    assert doc["version"] == INDEX_VERSION == 3
    assert doc["tensors"]["opt"]["flattened"] is True and "flattened" not in doc["tensors"]["w"]
    meta = dc.load_tensors_metadata(tmp_path / "c")
    assert meta["opt"].flattened_range == slice(0, 24) and meta["w"].flattened_range is None
    doc["tensors"]["w"]["flattened"] = "yes"
    write_index_document(tmp_path / "c", doc)
    with pytest.raises(dc.CheckpointingException, match="'flattened' must be true or false"):
        dc.load_tensors_metadata(tmp_path / "c")


def test_legacy_safetensors_index_without_the_field(tmp_path: Path) -> None:
    """An index of version 1 or 2 written before the field existed: the shards' flat ranges say it."""
    _save_flat_and_whole(tmp_path / "c")
    doc = write_legacy_index(tmp_path / "c")
    assert doc["version"] == 2 and doc["tensors"]["opt"]["flattened"] is True
    del doc["tensors"]["opt"]["flattened"]
    write_index_document(tmp_path / "c", doc)
    assert dc.load_tensors_metadata(tmp_path / "c")["opt"].flattened_range == slice(0, 24)
    doc["tensors"]["w"]["flattened"] = "yes"
    write_index_document(tmp_path / "c", doc)
    with pytest.raises(dc.CheckpointingException, match="'flattened' must be true or false"):
        dc.load_tensors_metadata(tmp_path / "c")


def test_stored_tensor_metadata() -> None:
    flat = stored_tensor_metadata("k", torch.bfloat16, (3, 5), flattened=True)
    assert (flat.local_shape, flat.global_shape, flat.flattened_range, flat.dtype) == (
        (3, 5),
        (3, 5),
        slice(0, 15),
        torch.bfloat16,
    )
    whole = shaped(flat)
    assert whole.flattened_range is None and whole.local_shape == (3, 5) and tuple(whole.data.shape) == (3, 5)
    assert shaped(whole) is whole
    zero_d = stored_tensor_metadata("s", torch.float32, (), flattened=True)
    assert zero_d.flattened_range == slice(0, 1) and zero_d.local_shape == ()
