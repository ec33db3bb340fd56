"""Integrity fails closed: metadata.json lists the records (manifests, the safetensors index) a
save wrote, so deleting, downgrading or editing one is corruption, never "saved without
checksums"; checkpoints saved before records existed still load, with a warning."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.safetensors.index import INDEX_VERSION
from dist_ckpt.cli import main
from dist_ckpt.errors import ChecksumMismatchError, CorruptCheckpointError
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor
from tests.unit.backends.safetensors.legacy_index import downgrade_index_to_v1

RECORDS = {
    "safetensors": ["safetensors/index.json", "common.checksums.json", "objects/checksums.json"],
    "zarr": ["zarr/checksums.json", "common.checksums.json", "objects/checksums.json"],
}


def _state() -> Dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(24.0).reshape(4, 6)),
        "b": ShardedTensor.from_rank_offsets("b", torch.arange(5, dtype=torch.int64)),
        "o": ShardedObject("o", {"seed": 3}, (1,), (0,)),
        "step": 9,
    }


def _request() -> Dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6)),
        "b": ShardedTensor.from_rank_offsets("b", torch.zeros(5, dtype=torch.int64)),
        "o": ShardedObject("o", None, (1,), (0,)),
    }


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("records")
    out = {}
    for backend in RECORDS:
        dc.save(_state(), root / backend, sharded_strategy=(backend, 1))
        out[backend] = root / backend
    return out


@pytest.fixture
def ckpt(pristine: Dict[str, Path], tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    backend = request.param
    shutil.copytree(pristine[backend], tmp_path / backend)
    return tmp_path / backend


def _assert_loads(path: Path) -> None:
    out = dc.load(_request(), path)
    assert torch.equal(out["w"], torch.arange(24.0).reshape(4, 6)) and out["o"] == {"seed": 3} and out["step"] == 9


@pytest.mark.parametrize("backend", list(RECORDS))
def test_metadata_lists_every_record_the_save_wrote(pristine, backend):
    doc = json.loads((pristine[backend] / "metadata.json").read_text())
    assert sorted(doc["integrity_records"]) == sorted(RECORDS[backend])
    for key, entry in doc["integrity_records"].items():
        assert entry["size"] == (pristine[backend] / key).stat().st_size
        assert entry["version"] == (INDEX_VERSION if key == "safetensors/index.json" else 1)
    assert not (pristine[backend] / "save_in_progress.json").exists()  # the claim is released


@pytest.mark.parametrize("ckpt", list(RECORDS), indirect=True)
@pytest.mark.parametrize("damage", ["delete", "truncate", "edit"])
def test_a_damaged_record_fails_load_and_verify(ckpt, damage):
    backend = ckpt.name
    for key in RECORDS[backend]:
        path = ckpt / key
        original = path.read_bytes()
        if damage == "delete":
            path.unlink()
        elif damage == "truncate":
            path.write_bytes(original[:-3])
        else:  # same size, another byte: a manifest entry pointed at other data
            i = original.index(b'"size"') + 9
            path.write_bytes(original[:i] + bytes([original[i] ^ 1]) + original[i + 1 :])
        expected = ChecksumMismatchError if damage == "edit" else CorruptCheckpointError
        with pytest.raises(expected, match=key.replace(".", r"\.")):
            _assert_loads(ckpt)
        report = dc.verify_checkpoint(ckpt)
        assert not report.ok and key in {p.path for p in report.problems}, report.problems
        assert main(["verify", str(ckpt)]) == 1  # `dist-ckpt verify` exits 1
        path.write_bytes(original)
    _assert_loads(ckpt)


@pytest.mark.parametrize("ckpt", ["safetensors"], indirect=True)
def test_an_index_rewritten_as_version_1_is_a_downgrade(ckpt):
    downgrade_index_to_v1(ckpt)
    data = next((ckpt / "safetensors").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x40  # tamper with the data the dropped checksums protected
    data.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=f"version 1, but metadata.json recorded version {INDEX_VERSION}"):
        _assert_loads(ckpt)
    problems = dc.verify_checkpoint(ckpt).problems
    assert "safetensors/index.json" in {p.path for p in problems}


@pytest.mark.parametrize("ckpt", ["zarr"], indirect=True)
def test_a_record_the_save_did_not_write_is_refused(ckpt):
    doc = json.loads((ckpt / "metadata.json").read_text())
    del doc["integrity_records"]["objects/checksums.json"]  # as if saved without that manifest
    (ckpt / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match="not one of the integrity records"):
        _assert_loads(ckpt)


@pytest.mark.parametrize("ckpt", list(RECORDS), indirect=True)
def test_checkpoints_from_before_records_load_unverified_with_a_warning(ckpt, caplog):
    doc = json.loads((ckpt / "metadata.json").read_text())
    del doc["integrity_records"]
    doc["dist_ckpt"]["format_version"] = 1  # the format before records were mandatory
    (ckpt / "metadata.json").write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="dist_ckpt"):
        _assert_loads(ckpt)
    assert "loads unverified" in caplog.text
    report = dc.verify_checkpoint(ckpt)
    assert report.ok and any("no integrity records" in n for n in report.notes)
    # without records, a deleted manifest goes unnoticed: exactly what records prevent
    (ckpt / "common.checksums.json").unlink()
    dc.load(_request(), ckpt)


@pytest.mark.parametrize("ckpt", list(RECORDS), indirect=True)
def test_removing_tensors_updates_the_records(ckpt):
    dc.remove_sharded_tensors(ckpt, "b")
    assert set(dc.load_tensors_metadata(ckpt)) == {"w"}
    assert dc.verify_checkpoint(ckpt).ok
    request = _request()
    del request["b"]
    out = dc.load(request, ckpt)
    assert torch.equal(out["w"], torch.arange(24.0).reshape(4, 6))


@pytest.mark.parametrize("ckpt", ["zarr"], indirect=True)
def test_load_plain_tensors_never_drops_a_tensor(ckpt):
    assert set(dc.load_plain_tensors(ckpt)) == {"w", "b"}
    (ckpt / "zarr" / "b" / "zarr.json").unlink()
    with pytest.raises(CorruptCheckpointError, match="zarr.json"):
        dc.load_plain_tensors(ckpt)
    with pytest.raises(CorruptCheckpointError, match="zarr.json"):
        dc.load_tensors_metadata(ckpt)
    # also without the manifest's help (a checkpoint saved before records)
    doc = json.loads((ckpt / "metadata.json").read_text())
    del doc["integrity_records"]
    doc["dist_ckpt"]["format_version"] = 1
    (ckpt / "metadata.json").write_text(json.dumps(doc))
    (ckpt / "zarr" / "checksums.json").unlink()
    with pytest.raises(CorruptCheckpointError, match="zarr.json"):
        dc.load_plain_tensors(ckpt)


@pytest.mark.parametrize("ckpt", ["zarr"], indirect=True)
def test_a_flipped_byte_in_zarr_json_names_the_file(ckpt):
    path = ckpt / "zarr" / "w" / "zarr.json"
    raw = path.read_bytes()
    i = raw.index(b"fill_value")
    path.write_bytes(raw[:i] + b"fill_valud" + raw[i + 10 :])
    for read in (dc.load_plain_tensors, dc.load_tensors_metadata):
        with pytest.raises(CorruptCheckpointError, match="w/zarr.json"):
            read(ckpt)
    # a load takes the document from the root group's index (the bytes the manifest records),
    # never reading the damaged file; verify names it
    assert torch.equal(dc.load(_request(), ckpt)["w"], torch.arange(24.0).reshape(4, 6))
    assert "zarr/w/zarr.json" in {p.path for p in dc.verify_checkpoint(ckpt).problems}


def test_a_wrapper_that_declares_no_records_still_gets_them_recorded(tmp_path):
    """A user's strategy that wraps a built-in one (and knows nothing of records) writes the
    built-in format, so its records are those of the format: recorded, and checked."""
    from dist_ckpt.backends.base import SaveShardedStrategy

    class Wrapper(SaveShardedStrategy):
        def __init__(self) -> None:
            super().__init__("zarr", 1)
            self.inner = dc.get_default_strategy(dc.StrategyAction.SAVE_SHARDED, "zarr", 1)

        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            self.inner.save(sharded_state_dict, checkpoint_dir)

    dc.save(_state(), tmp_path / "c", sharded_strategy=Wrapper())
    _assert_loads(tmp_path / "c")
    (tmp_path / "c" / "zarr" / "checksums.json").unlink()
    with pytest.raises(CorruptCheckpointError, match="zarr/checksums.json is missing"):
        _assert_loads(tmp_path / "c")


def test_torch_dist_keeps_its_records_beside_megatrons_metadata_json(tmp_path):
    """Megatron-Core refuses unknown keys in metadata.json, so a torch_dist checkpoint keeps its
    integrity records in dist_ckpt.json; deleting the DCP checksum manifest still fails closed."""
    path = tmp_path / "td"
    dc.save(_state(), path, sharded_strategy=("torch_dist", 1))
    assert "integrity_records" not in json.loads((path / "metadata.json").read_text())
    side = json.loads((path / "dist_ckpt.json").read_text())
    assert sorted(side["integrity_records"]) == ["common.checksums.json", "torch_dist.checksums.json"]
    _assert_loads(path)
    (path / "torch_dist.checksums.json").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"torch_dist\.checksums\.json is missing"):
        _assert_loads(path)
    assert main(["verify", str(path)]) == 1
