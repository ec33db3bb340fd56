"""Megatron-Core's ``integrity.json`` (``save``/``load(..., verify_integrity=True)``) in one process: the manifest
lists the SHA-256 of every file of the committed checkpoint, and a load refuses a checkpoint whose files are
missing or differ, naming each one. The multi-rank hashing is in tests/distributed/test_integrity_manifest.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError
from dist_ckpt.integrity.file_manifest import INTEGRITY_MANIFEST_FILENAME, assign_files, parse_manifest


def _state() -> Dict[str, Any]:
    return {"w": dc.ShardedTensor.from_rank_offsets("w", torch.arange(12.0).reshape(3, 4)), "step": 4}


def _request() -> Dict[str, Any]:
    return {"w": dc.ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}


@pytest.mark.parametrize("backend", [("torch_dist", 1), ("safetensors", 1)])
def test_the_manifest_lists_every_file_and_a_load_checks_them(tmp_path: Path, backend: Any) -> None:
    dc.save(_state(), tmp_path, sharded_strategy=backend, verify_integrity=True)
    doc = json.loads((tmp_path / INTEGRITY_MANIFEST_FILENAME).read_text())
    files = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert doc["algorithm"] == "sha256" and set(doc["files"]) == files - {INTEGRITY_MANIFEST_FILENAME}
    assert "metadata.json" in doc["files"]  # written after the commit
    for name, digest in doc["files"].items():
        assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == digest
    loaded = dc.load(_request(), tmp_path, verify_integrity=True)
    assert torch.equal(loaded["w"], torch.arange(12.0).reshape(3, 4))


def test_a_changed_and_a_missing_file_are_each_named(tmp_path: Path) -> None:
    dc.save(_state(), tmp_path, sharded_strategy=("torch_dist", 1), verify_integrity=True)
    names = json.loads((tmp_path / INTEGRITY_MANIFEST_FILENAME).read_text())["files"]
    data = sorted(n for n in names if n.endswith(".distcp"))
    (tmp_path / "common.pt").write_bytes((tmp_path / "common.pt").read_bytes() + b"\0")
    (tmp_path / data[0]).unlink()
    with pytest.raises(CorruptCheckpointError) as raised:
        dc.load(_request(), tmp_path, verify_integrity=True)
    assert "common.pt differs" in str(raised.value) and f"{data[0]} is missing" in str(raised.value)


def test_without_a_manifest_only_a_verified_load_refuses(tmp_path: Path) -> None:
    dc.save(_state(), tmp_path)
    assert not (tmp_path / INTEGRITY_MANIFEST_FILENAME).exists()
    dc.load(_request(), tmp_path)
    with pytest.raises(CheckpointingException, match="saved without verify_integrity=True"):
        dc.load(_request(), tmp_path, verify_integrity=True)


def test_async_save_writes_the_manifest_at_finalization(tmp_path: Path) -> None:
    request = dc.save(
        _state(), tmp_path, sharded_strategy=("torch_dist", 1), async_sharded_save=True, verify_integrity=True
    )
    assert request is not None and not (tmp_path / INTEGRITY_MANIFEST_FILENAME).exists()
    request.execute_sync()
    dc.load(_request(), tmp_path, verify_integrity=True)


def test_files_are_shared_by_size_and_manifests_are_parsed_strictly() -> None:
    shares = assign_files([("a", 10), ("b", 7), ("c", 5), ("d", 4), ("e", 1)], 2)
    assert shares == [["a", "d"], ["b", "c", "e"]]  # 14 and 13 bytes
    with pytest.raises(CorruptCheckpointError, match="md5"):
        parse_manifest(b'{"algorithm": "md5", "files": {}}', "x")
    with pytest.raises(CorruptCheckpointError, match="64 hex digits"):
        parse_manifest(b'{"algorithm": "sha256", "files": {"a": "zz"}}', "x")
