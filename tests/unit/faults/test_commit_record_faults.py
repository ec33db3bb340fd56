"""The commit record's integrity list cannot be dropped to switch verification off (issue 41 item 8).

``metadata.json`` (``dist_ckpt.json`` for torch_dist, beside Megatron-Core's ``metadata.json``)
lists the integrity records a save wrote. Its format version moved when that list became
mandatory: a current checkpoint whose ``integrity_records`` field is removed is corrupt for every
reader, never read as one saved before records existed (those, format version 1, still load).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Callable, Dict

import pytest

import dist_ckpt as dc
from dist_ckpt.record.commit import FORMAT_VERSION
from tests.unit.backends.safetensors.legacy_index import downgrade_index_to_v1

from .scenario import check_loads, state, strategy

BACKENDS = ["safetensors", "zarr", "torch_dist"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("commit_record")
    out = {}
    for backend in BACKENDS:
        dc.save(state(2.0), root / backend, sharded_strategy=strategy(backend))
        out[backend] = root / backend
    return out


def _copy(saved: Dict[str, Path], backend: str, tmp_path: Path) -> Path:
    shutil.copytree(saved[backend], tmp_path / backend)
    return tmp_path / backend


def _edit_record(ckpt: Path, edit: Callable[[Dict[str, Any]], None]) -> None:
    """Apply ``edit`` to the JSON document that holds the save's record and its integrity list."""
    path = ckpt / ("dist_ckpt.json" if (ckpt / "dist_ckpt.json").exists() else "metadata.json")
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("backend", BACKENDS)
def test_removing_the_integrity_records_of_a_current_checkpoint_is_corruption(saved, tmp_path, backend):
    ckpt = _copy(saved, backend, tmp_path)
    _edit_record(ckpt, lambda doc: doc.pop("integrity_records"))
    with pytest.raises(dc.CorruptCheckpointError, match="integrity_records") as info:
        check_loads(ckpt, 2.0)
    assert f"format version {FORMAT_VERSION}" in str(info.value) and str(ckpt) in str(info.value)
    report = dc.verify_checkpoint(ckpt)
    assert not report.ok and any("integrity_records" in p.problem for p in report.problems), report.problems


@pytest.mark.parametrize("backend", BACKENDS)
def test_removing_the_format_version_too_is_corruption(saved, tmp_path, backend):
    ckpt = _copy(saved, backend, tmp_path)

    def strip(doc: Dict[str, Any]) -> None:
        doc.pop("integrity_records")
        doc["dist_ckpt"].pop("format_version")

    _edit_record(ckpt, strip)
    with pytest.raises(dc.CorruptCheckpointError, match="format_version"):
        check_loads(ckpt, 2.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_of_format_version_1_without_records_still_loads_unverified(saved, tmp_path, backend, caplog):
    ckpt = _copy(saved, backend, tmp_path)

    def as_before_records(doc: Dict[str, Any]) -> None:
        doc.pop("integrity_records")
        doc["dist_ckpt"]["format_version"] = 1

    _edit_record(ckpt, as_before_records)
    with caplog.at_level(logging.WARNING, logger="dist_ckpt"):
        check_loads(ckpt, 2.0)
    assert "loads unverified" in caplog.text


def test_a_safetensors_checkpoint_stripped_of_both_records_is_corruption(saved, tmp_path):
    """The 'dist_ckpt' record and the integrity list both removed, and the index rewritten without
    its checksums: the checkpoint would read as another tool's, unchecked; but only dist_ckpt
    writes the safetensors backend, which always records both, so the flipped byte is not loaded."""
    ckpt = _copy(saved, "safetensors", tmp_path)
    downgrade_index_to_v1(ckpt)
    _edit_record(ckpt, lambda doc: (doc.pop("integrity_records"), doc.pop("dist_ckpt")))
    data = next((ckpt / "safetensors").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(dc.CorruptCheckpointError, match="'dist_ckpt' record") as info:
        check_loads(ckpt, 2.0)
    assert str(ckpt) in str(info.value)
    assert not dc.verify_checkpoint(ckpt).ok
