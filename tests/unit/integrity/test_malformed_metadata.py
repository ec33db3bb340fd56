"""Malformed metadata of the kinds issue 15 found: each a CorruptCheckpointError naming the file
(never RecursionError, a torch RuntimeError or a KeyError), and ``dist-ckpt verify`` exits 1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.cli import main
from dist_ckpt.integrity.records import record_of
from dist_ckpt.model.sharded import ShardedTensor
from tests.unit.backends.safetensors.legacy_index import downgrade_index_to_v1


def _save(path: Path, backend: str = "safetensors") -> Path:
    dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}, path, sharded_strategy=(backend, 1))
    return path


def _resign(ckpt: Path, rel: str) -> None:
    """Update metadata.json's record of ``rel``, as a consistent forgery would."""
    meta: Dict[str, Any] = json.loads((ckpt / "metadata.json").read_text())
    meta["integrity_records"][rel] = record_of((ckpt / rel).read_bytes()).to_json()
    (ckpt / "metadata.json").write_text(json.dumps(meta))


def test_a_global_shape_that_overflows_is_corruption_and_fails_verify(tmp_path):
    ckpt = _save(tmp_path / "c")
    index = ckpt / "safetensors" / "index.json"
    doc = json.loads(index.read_text())
    doc["tensors"]["w"]["global_shape"] = [2**62]  # x 4 bytes; torch: "Storage size calculation overflowed"
    index.write_text(json.dumps(doc))
    _resign(ckpt, "safetensors/index.json")
    for read in (dc.load_tensors_metadata, dc.load_plain_tensors):
        with pytest.raises(dc.CorruptCheckpointError, match="index.json.*more than any tensor can hold"):
            read(ckpt)
    assert not dc.verify_checkpoint(ckpt).ok
    assert main(["verify", str(ckpt)]) == 1


@pytest.mark.parametrize("rel", ["metadata.json", "safetensors/index.json", "common.checksums.json"])
def test_deeply_nested_json_names_the_file(tmp_path, rel):
    ckpt = _save(tmp_path / "c")
    (ckpt / rel).write_bytes(b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    if rel != "metadata.json":
        _resign(ckpt, rel)
    with pytest.raises(dc.CorruptCheckpointError, match=rel.split("/")[-1].replace(".", r"\.") + ".*nests"):
        dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, ckpt)
    assert main(["verify", str(ckpt)]) == 1


def test_a_non_utf8_safetensors_header_names_the_file(tmp_path):
    ckpt = _save(tmp_path / "c")
    data = next((ckpt / "safetensors").glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[9] = 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(dc.CorruptCheckpointError, match=data.name) as info:
        dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, ckpt)
    assert "'w'" in str(info.value)


def test_a_forged_index_cannot_make_a_load_allocate_more_than_the_files_hold(tmp_path):
    """An index (consistently re-signed) that claims a 4 TiB tensor in a file it says is 4 TiB:
    the file's real size is checked before any destination is allocated."""
    ckpt = _save(tmp_path / "c")
    downgrade_index_to_v1(ckpt)  # shards as JSON objects, to forge
    _resign(ckpt, "safetensors/index.json")
    index = ckpt / "safetensors" / "index.json"
    doc = json.loads(index.read_text())
    (file_name,) = doc["files"]
    shard = doc["tensors"]["w"]["shards"][0]
    huge = 2**40
    begin = shard["byte_range"][0]
    doc["tensors"]["w"]["global_shape"] = [huge // 4]
    shard.update(chunk_shape=[huge // 4], byte_range=[begin, begin + huge])
    shard.pop("crc32c", None)
    doc.update(version=1)
    doc.pop("checksum", None)
    doc["files"][file_name] = {"size": begin + huge, "rank": 0}
    index.write_text(json.dumps(doc))
    _resign(ckpt, "safetensors/index.json")
    with pytest.raises(dc.CorruptCheckpointError, match=file_name):
        dc.load_plain_tensors(ckpt)
