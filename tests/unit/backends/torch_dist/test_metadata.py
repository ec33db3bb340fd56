"""DCP's ``.metadata`` is read by a restricted unpickler: what DCP metadata is made of loads (the
golden fixtures, megatron-core 0.15's own classes, plain ``dcp.save``), anything else is refused
before it runs, naming the file and the opt-in."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

import dist_ckpt as dc
from dist_ckpt.backends.torch_dist.metadata import LegacyMCoreMetadata, mcore_data, read_metadata, unpickle_metadata
from dist_ckpt.backends.torch_dist.plain import DCPCommonLoadStrategy, DCPLoadShardedStrategy
from dist_ckpt.errors import CorruptCheckpointError, NotACheckpointError, UnsafeObjectError
from dist_ckpt.tools.verify import verify_checkpoint
from tests.golden.torch_dist import expected as E
from tests.torch_dist_golden import fixture_dir


class _Payload:
    """Unpickling it would run a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("name", sorted(E.FIXTURES))
def test_golden_metadata_reads_without_megatron(name: str) -> None:
    md = read_metadata(fixture_dir(name))
    assert isinstance(md, Metadata)
    assert {k for k in md.state_dict_metadata if "/shard_" not in k} == {t.key for t in E.FIXTURES[name].tensors}


def test_megatron_015_metadata_maps_to_the_stand_in() -> None:
    md = read_metadata(fixture_dir("flat_legacy_mcore015"))
    assert isinstance(md, LegacyMCoreMetadata)
    assert mcore_data(md)["optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight"] == {
        "nd_reformulated_orig_global_shape": (16, 8)
    }


def _write_malicious_dcp(tmp_path: Path, marker: Path) -> Path:
    """A plain DCP checkpoint whose .metadata carries a payload next to real metadata."""
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "evil"
    with pytest.warns(UserWarning):  # DCP warns that no process group is initialized
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(ckpt))
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    md.planner_data = {"w": ("w",), "payload": _Payload(marker)}
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    return ckpt


def test_malicious_reduce_never_runs_and_the_error_names_the_file(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ckpt = _write_malicious_dcp(tmp_path, marker)
    request = {"w": dc.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}
    with pytest.raises(UnsafeObjectError) as info:
        dc.load(request, ckpt)
    message = str(info.value)
    assert str(ckpt / ".metadata") in message and "system" in message
    assert "TorchDistLoadShardedStrategy(allow_pickle=True)" in message
    for reader in (dc.load_tensors_metadata, dc.load_common_state_dict):
        with pytest.raises(UnsafeObjectError):
            reader(ckpt)
    assert not marker.exists()


def test_malicious_metadata_in_a_megatron_checkpoint(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "tp2"
    shutil.copytree(fixture_dir("tp2"), ckpt)
    md = unpickle_metadata((ckpt / ".metadata").read_bytes(), "tp2")
    md.storage_meta = _Payload(marker)  # type: ignore[assignment]
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeObjectError, match="not part of DCP's checkpoint metadata"):
        dc.load_tensors_metadata(ckpt)
    report = verify_checkpoint(ckpt)
    assert not marker.exists()
    assert not report.ok and any(p.path == ".metadata" and "allow_pickle" in p.problem for p in report.problems)


def test_opt_in_reads_a_trusted_pickle(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "trusted"
    with pytest.warns(UserWarning):
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(ckpt))
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    md.planner_data = {"w": ("w",), "extra": shutil.Error("a class outside DCP's metadata")}
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    request = {"w": dc.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}
    with pytest.raises(UnsafeObjectError):
        dc.load(request, ckpt)
    loaded = dc.load(
        request,
        ckpt,
        sharded_strategy=DCPLoadShardedStrategy(allow_pickle=True),
        common_strategy=DCPCommonLoadStrategy(allow_pickle=True),
    )
    assert torch.equal(loaded["w"], torch.arange(4.0))


def test_plain_dcp_save_metadata_with_paths_loads(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):
        dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path / "p")  # a PosixPath in storage_meta
    assert isinstance(read_metadata(tmp_path / "p").storage_meta.checkpoint_id, Path)  # type: ignore[union-attr]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "not_metadata"])
def test_damaged_metadata_is_a_corrupt_checkpoint(tmp_path: Path, damage: str) -> None:
    path = tmp_path / ".metadata"
    raw = (fixture_dir("tp2") / ".metadata").read_bytes()
    path.write_bytes(
        {"truncate": raw[: len(raw) // 2], "garbage": b"\x00" * 64, "not_metadata": pickle.dumps({"a": 1})}[damage]
    )
    with pytest.raises(CorruptCheckpointError) as info:
        read_metadata(tmp_path)
    assert str(path) in str(info.value)


def test_missing_metadata(tmp_path: Path) -> None:
    with pytest.raises(NotACheckpointError, match=".metadata"):
        read_metadata(tmp_path)
