"""Plain torch.distributed.checkpoint directories (``dcp.save``, as torchtitan and OLMo-core write
them; no metadata.json) load with dist_ckpt.load and pass through inspect, verify, convert and
export-hf. Multi-rank saves (DTensor) are in tests/distributed/test_torch_dist.py."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
from safetensors.torch import load_file

import dist_ckpt as dc
from dist_ckpt.errors import KeyMismatchError, NotACheckpointError
from dist_ckpt.record.commit import DCP_CONFIG, detect_config, is_plain_dcp_directory
from dist_ckpt.tools.convert import convert
from dist_ckpt.tools.inspection import inspect_checkpoint
from dist_ckpt.tools.verify import verify_checkpoint
from tests.unit.backends.torch_dist.conftest import Cli

W = torch.arange(48, dtype=torch.float32).reshape(6, 8)


def _state() -> Dict[str, Any]:
    return {
        "model": {"w": W.clone(), "norm": torch.ones(8, dtype=torch.bfloat16)},
        "optimizer": {"state": {"w": {"exp_avg": W * 2}}, "param_groups": [{"lr": 0.1, "params": ["model.w"]}]},
        "step": 12,
        "blob": io.BytesIO(b"dataloader"),
    }


@pytest.fixture
def dcp_dir(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "step-12"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(_state(), checkpoint_id=str(path))
    return path


def test_detected_as_plain_dcp(dcp_dir: Path, tmp_path: Path) -> None:
    assert is_plain_dcp_directory(dcp_dir) and detect_config(dcp_dir) == DCP_CONFIG
    assert not dc.check_is_distributed_checkpoint(dcp_dir)
    (dcp_dir / "common.pt").write_bytes(b"")  # a torch_dist save that did not commit is not plain DCP
    with pytest.raises(NotACheckpointError, match="metadata.json"):
        dc.load_tensors_metadata(dcp_dir)


def test_loads_resharded_with_common_state(dcp_dir: Path) -> None:
    request = {
        "w_rows": [dc.ShardedTensor.from_rank_offsets("model.w", torch.zeros(3, 8), (0, i, 2)) for i in range(2)],
        "w_col": dc.ShardedTensor.from_rank_offsets("optimizer.state.w.exp_avg", torch.zeros(6, 4), (1, 1, 2)),
        "norm": dc.ShardedTensor.from_rank_offsets("model.norm", torch.zeros(8, dtype=torch.float32)),
    }
    loaded = dc.load(request, dcp_dir, validate_access_integrity=False)
    assert torch.equal(torch.cat(loaded["w_rows"]), W)
    assert torch.equal(loaded["w_col"], (W * 2)[:, 4:])
    assert torch.equal(loaded["norm"], torch.ones(8))
    assert loaded["step"] == 12 and loaded["blob"].getvalue() == b"dataloader"
    assert loaded["optimizer"]["param_groups"] == [{"lr": 0.1, "params": ["model.w"]}]


def test_metadata_functions(dcp_dir: Path) -> None:
    meta = dc.load_tensors_metadata(dcp_dir)
    assert {k: tuple(v.global_shape) for k, v in meta.items()} == {
        "model.w": (6, 8),
        "model.norm": (8,),
        "optimizer.state.w.exp_avg": (6, 8),
    }
    assert set(dc.load_sharded_metadata(dcp_dir)) == set(meta)  # its bytes entries are not ShardedObjects
    assert torch.equal(dc.load_plain_tensors(dcp_dir)["model.w"], W)
    assert dc.load_common_state_dict(dcp_dir)["step"] == 12
    with pytest.raises(KeyMismatchError, match="rng"):
        dc.load({"r": dc.ShardedObject("rng", None, (1,), (0,))}, dcp_dir)


def test_inspect_and_verify(dcp_dir: Path) -> None:
    info = inspect_checkpoint(dcp_dir)
    assert info.kind == "dcp" and info.sharded_backend == "dcp:1" and len(info.tensors) == 3
    assert info.common_keys["step"] == "int = 12"
    report = verify_checkpoint(dcp_dir)
    assert report.ok and report.committed
    assert any("no checksums recorded" in note for note in report.notes)
    damaged = dcp_dir / "__0_0.distcp"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert not verify_checkpoint(dcp_dir).ok  # the zip archives' own CRC-32s catch it


def test_cli(dcp_dir: Path, tmp_path: Path, cli: Cli) -> None:
    shown = cli("inspect", str(dcp_dir))
    assert shown.returncode == 0 and "backend   dcp:1" in shown.stdout, shown.stderr
    described = cli("inspect", str(dcp_dir), "--json")  # lines are shortened to the terminal's width
    doc = json.loads(described.stdout)
    assert doc["kind"] == "dcp" and "model.w" in {t["key"] for t in doc["tensors"]}
    verified = cli("verify", str(dcp_dir), "--json")
    assert verified.returncode == 0 and json.loads(verified.stdout)["backends"] == ["dcp:1", "dcp:1"]
    converted = cli("convert", str(dcp_dir), str(tmp_path / "td"), "--to", "torch_dist", "--no-progress")
    assert converted.returncode == 0, converted.stderr
    exported = cli("export-hf", str(dcp_dir), str(tmp_path / "hf"), "--no-progress")
    assert exported.returncode == 0, exported.stderr
    assert torch.equal(load_file(tmp_path / "hf" / "model.safetensors")["model.w"], W)
    assert torch.equal(dc.unshard(tmp_path / "td")["model.w"], W)
    assert dc.load_common_state_dict(tmp_path / "td")["optimizer"]["param_groups"][0]["lr"] == 0.1


def test_convert_to_every_backend(dcp_dir: Path, tmp_path: Path) -> None:
    for to in ("safetensors", "zarr", "torch_dist"):
        result = convert(dcp_dir, tmp_path / to, to=to)
        assert result.source_backend == "dcp:1" and result.tensors == 3 and verify_checkpoint(tmp_path / to).ok
        assert torch.equal(dc.unshard(tmp_path / to)["optimizer.state.w.exp_avg"], W * 2)
        assert dc.load_common_state_dict(tmp_path / to)["blob"].getvalue() == b"dataloader"
