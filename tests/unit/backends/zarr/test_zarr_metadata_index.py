"""The root group's index of every zarr.json (metadata_index): written by local saves of both
engines, byte for byte the files' text; a load with checksums reads it instead of one file per
tensor, and uses only entries the manifest records exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.zarr import metadata_index
from dist_ckpt.backends.zarr.checksums import manifest_check, read_checksums
from dist_ckpt.backends.zarr.layout import ATTR, ZARR_DIR
from dist_ckpt.backends.zarr.metadata_index import read_index
from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreLoadShardedStrategy, TensorStoreSaveShardedStrategy
from dist_ckpt.backends.zarr.zarr_python import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.storage.object_path import ObjectPath
from tests.object_reads import record_object_reads

ENGINES = {
    "zarr-python": (ZarrSaveShardedStrategy, ZarrLoadShardedStrategy),
    "tensorstore": (TensorStoreSaveShardedStrategy, TensorStoreLoadShardedStrategy),
}
VALUES = {
    "w": torch.arange(24.0).reshape(4, 6),
    "b": torch.arange(5, dtype=torch.int64),
    "h": torch.arange(8.0).to(torch.bfloat16),
}


def _state(values: Dict[str, torch.Tensor]) -> Dict[str, ShardedTensor]:
    state = {k: ShardedTensor.from_rank_offsets(k, v.clone()) for k, v in values.items()}
    # a tensor saved as flattened ranges: a group and one fragment array
    state["f"] = ShardedTensor.from_rank_offsets_flat("f", torch.arange(6.0), (2, 3), flattened_range=slice(0, 6))
    return state


def _request(keys=("w", "b", "h")) -> Dict[str, ShardedTensor]:
    return {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(VALUES[k])) for k in keys}


def _used(ckpt: Path) -> Dict[str, bytes]:
    """The index entries a load uses: ``{name under zarr/: bytes}``."""
    root = ObjectPath.of(ckpt / ZARR_DIR)
    manifest = read_checksums(ObjectPath.of(ckpt))
    return {p.relative_to(root): raw for p, raw in read_index(root, manifest, manifest_check(root, manifest)).items()}


def _index(ckpt: Path) -> Dict[str, str]:
    return json.loads((ckpt / ZARR_DIR / "zarr.json").read_text())["attributes"][ATTR][metadata_index.INDEX_FIELD]


@pytest.fixture(params=sorted(ENGINES))
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def ckpt(tmp_path: Path, engine: str) -> Path:
    dc.save(_state(VALUES), tmp_path / "c", sharded_strategy=ENGINES[engine][0]())
    return tmp_path / "c"


def test_the_root_group_indexes_every_zarr_json_byte_for_byte(ckpt):
    tree = ckpt / ZARR_DIR
    files = {p.relative_to(tree).as_posix() for p in tree.rglob("zarr.json")} - {"zarr.json"}
    assert files == {"w/zarr.json", "b/zarr.json", "h/zarr.json", "f/zarr.json", "f/0.0_0/zarr.json"}
    index = _index(ckpt)
    assert set(index) == files
    assert {name: (tree / name).read_text() for name in files} == index
    assert dc.verify_checkpoint(ckpt).ok  # the root group, rewritten last, is in the manifest


def test_a_load_with_checksums_reads_no_tensor_zarr_json(ckpt, engine, monkeypatch):
    read = record_object_reads(monkeypatch)
    out = dc.load(_request(), ckpt, sharded_strategy=ENGINES[engine][1]())
    assert all(torch.equal(out[k], VALUES[k]) for k in ("w", "b", "h"))
    assert [k for k in read if k.endswith("zarr.json")] == [f"{ZARR_DIR}/zarr.json"]

    read.clear()  # without checksums nothing checks the index: each tensor's own file is read
    out = dc.load(_request(), ckpt, sharded_strategy=ENGINES[engine][1](verify_checksums=False))
    assert all(torch.equal(out[k], VALUES[k]) for k in ("w", "b", "h"))
    assert {f"{ZARR_DIR}/{k}/zarr.json" for k in ("w", "b", "h")} <= set(read)


def test_a_damaged_tensor_zarr_json_is_not_read_and_verify_names_it(ckpt, engine):
    path = ckpt / ZARR_DIR / "w" / "zarr.json"
    path.write_bytes(b"\x00 not json")
    out = dc.load(_request(), ckpt, sharded_strategy=ENGINES[engine][1]())
    assert torch.equal(out["w"], VALUES["w"])  # the index holds the bytes the manifest records
    assert "zarr/w/zarr.json" in {p.path for p in dc.verify_checkpoint(ckpt).problems}


def test_a_damaged_root_group_fails_the_load_naming_it(ckpt, engine):
    path = ckpt / ZARR_DIR / "zarr.json"
    path.write_bytes(path.read_bytes().replace(b'"w/zarr.json"', b'"v/zarr.json"'))
    with pytest.raises(CheckpointingException, match=r"zarr/zarr\.json"):
        dc.load(_request(), ckpt, sharded_strategy=ENGINES[engine][1]())


def test_entries_the_manifest_no_longer_records_are_not_used(ckpt, engine):
    """A removed tensor keeps its entry in the root group, but its files left the manifest: the
    load looks for its directory, as without an index, and finds none."""
    assert "b/zarr.json" in _index(ckpt)
    dc.remove_sharded_tensors(ckpt, "b")
    assert "b/zarr.json" in _index(ckpt)  # the root group is written once
    assert set(_used(ckpt)) == {"w/zarr.json", "h/zarr.json", "f/zarr.json", "f/0.0_0/zarr.json"}
    loader = ENGINES[engine][1]()
    out = dc.load(_request(("w", "h")), ckpt, sharded_strategy=loader)
    assert torch.equal(out["h"], VALUES["h"])
    with pytest.raises(CheckpointingException, match="'b'"):
        dc.load(_request(("b",)), ckpt, sharded_strategy=loader)


def test_a_checkpoint_without_an_index_loads_from_each_file(tmp_path, engine, unindexed_zarr):
    dc.save(_state(VALUES), tmp_path / "c", sharded_strategy=ENGINES[engine][0]())
    root = json.loads((tmp_path / "c" / ZARR_DIR / "zarr.json").read_text())
    assert root["attributes"] == {}
    out = dc.load(_request(), tmp_path / "c", sharded_strategy=ENGINES[engine][1]())
    assert all(torch.equal(out[k], VALUES[k]) for k in ("w", "b", "h"))


def test_an_index_over_the_cap_is_left_out(monkeypatch):
    documents = {"a/zarr.json": "x" * 100, "b/zarr.json": "y" * 100}
    assert json.loads(metadata_index.root_document(documents))["attributes"][ATTR]["zarr_json"] == documents
    full = len(metadata_index.root_document(documents))
    monkeypatch.setattr(metadata_index, "MAX_INDEX_BYTES", full)
    assert json.loads(metadata_index.root_document(documents))["attributes"][ATTR]["zarr_json"] == documents
    monkeypatch.setattr(metadata_index, "MAX_INDEX_BYTES", full - 1)
    assert json.loads(metadata_index.root_document(documents))["attributes"] == {}
    assert json.loads(metadata_index.root_document({}))["attributes"] == {}


def test_only_entries_whose_bytes_the_manifest_records_are_used(ckpt):
    """Size and crc32c of each entry against the manifest: an entry that differs (here another
    text of the same length, a lone surrogate, a name the manifest lacks) is read from its file."""
    tree = ckpt / ZARR_DIR
    used = _used(ckpt)
    assert used == {name: (tree / name).read_bytes() for name in used} and "w/zarr.json" in used
    root = ObjectPath.of(tree)
    manifest = dict(read_checksums(ObjectPath.of(ckpt)) or {})
    doc = json.loads((tree / "zarr.json").read_text())
    entries = doc["attributes"][ATTR][metadata_index.INDEX_FIELD]
    entries["w/zarr.json"] = entries["w/zarr.json"].replace("float32", "float64")  # same length
    entries["h/zarr.json"] = "\ud800"
    entries["x/zarr.json"] = "{}"
    (tree / "zarr.json").write_bytes(metadata_index.group_document(doc["attributes"]))  # manifest_check: not used
    index = read_index(root, manifest, None)
    assert {p.relative_to(root) for p in index} == set(used) - {"w/zarr.json", "h/zarr.json"}


def test_a_rank_over_the_cap_leaves_the_index_out(monkeypatch):
    documents = {"a/zarr.json": "x" * 100}
    assert metadata_index.merged_documents([metadata_index.index_part(documents, 1), {"b": "y"}]) == dict(
        documents, b="y"
    )
    monkeypatch.setattr(metadata_index, "MAX_INDEX_BYTES", 50)
    assert metadata_index.index_part(documents, 1) is None
    monkeypatch.setattr(metadata_index, "MAX_INDEX_BYTES", 500)
    assert metadata_index.index_part(documents, 4) == documents  # 111 bytes within its 125
    assert metadata_index.index_part(documents, 5) is None  # rank 0 gathers at most about the cap
    assert metadata_index.merged_documents([None, {"b": "y"}]) == {}
