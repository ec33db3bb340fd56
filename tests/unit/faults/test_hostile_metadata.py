"""Hostile metadata of dist_ckpt's own formats, consistent with its checksums (issue 41, item 7).

A forger who rewrites a file and its checksum entries (as `test_metadata_fuzz._resign` does)
reaches the parsers behind the checksums. Each case here is refused by every loader with a typed
error, and ``verify`` reports it instead of saying OK: it runs the same structural checks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Dict

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.engine.load_parts import load_plain_tensors, load_tensors_metadata
from dist_ckpt.integrity.safe_json import MAX_SMALL_JSON_BYTES

from .scenario import check_loads, state, strategy
from .test_metadata_fuzz import _resign


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile")
    out = {}
    for backend in ("safetensors", "zarr"):
        dc.save(state(2.0), root / backend, sharded_strategy=strategy(backend))
        out[backend] = root / backend
    return out


def _copy(src: Path, target: Path) -> Path:
    shutil.copytree(src, target)
    return target


def test_an_empty_shard_table_is_a_typed_error_naming_it(saved, tmp_path):
    ckpt = _copy(saved["safetensors"], tmp_path / "ckpt")
    (table,) = (ckpt / "safetensors").glob("index.*.bin")
    table.write_bytes(b"")
    for call in (lambda: check_loads(ckpt, 2.0), lambda: load_plain_tensors(ckpt)):
        with pytest.raises(dc.CorruptCheckpointError, match=table.name) as info:
            call()
        assert "has 0 bytes" in str(info.value)
    report = dc.verify_checkpoint(ckpt)
    assert not report.ok and any(table.name in str(p) for p in report.problems), report.problems


def _rewrite_json(ckpt: Path, rel: str, change: Callable[[Any], Any]) -> None:
    """Rewrite the JSON document ``rel`` with ``change`` and re-sign it (a consistent forgery)."""
    path = ckpt / rel
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    _resign(ckpt, rel)


def _zarr_refused(ckpt: Path, words: str, key: str = "f") -> None:
    """Loads and load_tensors_metadata raise CorruptCheckpointError with ``words``; verify reports it."""
    calls = {
        "load": lambda: check_loads(ckpt, 2.0),
        "load_plain_tensors": lambda: load_plain_tensors(ckpt),
        "load_tensors_metadata": lambda: load_tensors_metadata(ckpt),
    }
    for name, call in calls.items():
        with pytest.raises(dc.CorruptCheckpointError, match=words):
            call()
    report = dc.verify_checkpoint(ckpt)
    assert not report.ok, name
    assert any(words in str(p) for p in report.problems), report.problems


def _set_range(start: int, stop: int) -> Callable[[Any], Any]:
    def change(doc: Any) -> Any:
        doc["attributes"]["dist_ckpt"]["flat_range"] = [start, stop]
        return doc

    return change


def test_overlapping_fragments_are_refused(saved, tmp_path):
    """Fragments [1, 6) and [5, 12) of a 12-element tensor: as many elements as the tensor, but
    element 5 twice and element 0 never (a load returned element 0 as zero)."""
    ckpt = _copy(saved["zarr"], tmp_path / "ckpt")
    _rewrite_json(ckpt, "zarr/f/0.0_0/zarr.json", _set_range(1, 6))
    _zarr_refused(ckpt, "overlap")


def test_a_fragment_gap_is_refused_by_verify_too(saved, tmp_path):
    ckpt = _copy(saved["zarr"], tmp_path / "ckpt")
    _rewrite_json(ckpt, "zarr/f/0.0_0/zarr.json", _set_range(0, 4))
    _zarr_refused(ckpt, "gap")


@pytest.mark.parametrize("kind", ["deep", "huge"])
def test_an_unreadable_zarr_json_is_reported_by_verify(saved, tmp_path, kind):
    ckpt = _copy(saved["zarr"], tmp_path / "ckpt")
    rel = "zarr/w/zarr.json"
    raw = b"[" * 100_000 + b"]" * 100_000 if kind == "deep" else b" " * (MAX_SMALL_JSON_BYTES + 1) + b"{}"
    (ckpt / rel).write_bytes(raw)
    _resign(ckpt, rel)
    with pytest.raises(dc.CorruptCheckpointError, match="zarr.json"):
        check_loads(ckpt, 2.0)
    report = dc.verify_checkpoint(ckpt)
    assert not report.ok and any(p.path == rel for p in report.problems), report.problems


def test_a_key_read_from_a_zarr_json_is_validated(saved, tmp_path):
    ckpt = _copy(saved["zarr"], tmp_path / "ckpt")

    def hostile(doc: Any) -> Any:
        doc["attributes"]["dist_ckpt"]["key"] = "../../../x"
        return doc

    _rewrite_json(ckpt, "zarr/w/zarr.json", hostile)
    with pytest.raises(dc.CorruptCheckpointError, match=r"\.\./\.\./\.\./x") as info:
        load_tensors_metadata(ckpt)
    assert isinstance(info.value.__cause__, dc.InvalidKeyError)
    report = dc.verify_checkpoint(ckpt)
    assert not report.ok and any("../../../x" in str(p) for p in report.problems), report.problems


def test_a_key_read_from_the_safetensors_index_is_validated(saved, tmp_path):
    ckpt = _copy(saved["safetensors"], tmp_path / "ckpt")

    def hostile(doc: Any) -> Any:
        doc["tensors"]["../../../x"] = doc["tensors"].pop("w")
        return doc

    _rewrite_json(ckpt, "safetensors/index.json", hostile)
    with pytest.raises(dc.CorruptCheckpointError, match=r"\.\./\.\./\.\./x") as info:
        load_tensors_metadata(ckpt)
    assert isinstance(info.value.__cause__, dc.InvalidKeyError)
    assert not dc.verify_checkpoint(ckpt).ok


def test_a_key_read_from_a_huggingface_header_is_validated(tmp_path):
    from safetensors.torch import save_file

    save_file({"../../../x": torch.zeros(2), "model.w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(dc.CorruptCheckpointError, match=r"\.\./\.\./\.\./x") as info:
        load_tensors_metadata(tmp_path)
    assert isinstance(info.value.__cause__, dc.InvalidKeyError) and "model.safetensors" in str(info.value)


def test_a_key_read_from_an_object_key_file_is_validated(tmp_path):
    """A ShardedObject key too long for a file name is stored in ``_key.txt`` beside its shards."""
    ckpt = tmp_path / "ckpt"
    dc.save({"x": dc.ShardedObject("o" * 300, {"v": 1}, (1,), (0,))}, ckpt, sharded_strategy=strategy("safetensors"))
    (key_file,) = ckpt.glob("objects/*/_key.txt")
    key_file.write_text("../../../x")
    _resign(ckpt, str(key_file.relative_to(ckpt)))
    with pytest.raises(dc.CorruptCheckpointError, match=r"\.\./\.\./\.\./x") as info:
        dc.load_sharded_metadata(ckpt)
    assert isinstance(info.value.__cause__, dc.InvalidKeyError) and "_key.txt" in str(info.value)
