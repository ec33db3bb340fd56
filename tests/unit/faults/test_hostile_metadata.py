"""Hostile metadata of dist_ckpt's own formats, consistent with its checksums (issue 41, item 7).

A forger who rewrites a file and its checksum entries (as `test_metadata_fuzz._resign` does)
reaches the parsers behind the checksums. Each case here is refused by every loader with a typed
error, and ``verify`` reports it instead of saying OK: it runs the same structural checks.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Dict

import pytest

import dist_ckpt as dc
from dist_ckpt.engine.load_parts import load_plain_tensors

from .scenario import check_loads, state, strategy


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
