"""Loading what Megatron-Core wrote (the golden torch_dist fixtures) in one process: every layout
style at world size 1, the load_* entry points, unshard, strict modes, shape mismatch, dtype
casts, and the errors of absent or damaged entries."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from safetensors.torch import load_file

import dist_ckpt as dc
from dist_ckpt import StrictHandling
from dist_ckpt.backends.torch_dist import load as load_module
from dist_ckpt.backends.torch_dist.load import TorchDistLoadShardedStrategy
from dist_ckpt.errors import CorruptCheckpointError, KeyMismatchError, LoadMismatchError, ShardedObjectLayoutError
from dist_ckpt.tools.convert import convert
from dist_ckpt.tools.inspection import inspect_checkpoint
from dist_ckpt.tools.verify import verify_checkpoint
from tests.golden.torch_dist import expected as E
from tests.torch_dist_golden import STYLES, check_loaded, fixture_dir, golden_requests
from tests.unit.backends.torch_dist.conftest import Cli

EMB = "embedding.word_embeddings.weight"


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("name", sorted(E.FIXTURES))
def test_golden_fixture_loads_in_one_process(name: str, style: str) -> None:
    """World size 1: every tensor whole (or as one flattened range), objects and common state."""
    requests, expected = golden_requests(name, 0, 1, style)
    loaded = dc.load(requests, fixture_dir(name))
    assert check_loaded(name, loaded, expected) == []


def test_load_is_in_place() -> None:
    data = torch.empty(16, 8, dtype=torch.bfloat16)
    loaded = dc.load({"e": dc.ShardedTensor.from_rank_offsets(EMB, data)}, fixture_dir("tp2"))
    assert loaded["e"] is data and torch.equal(data, E.full_tensor(EMB, (16, 8), torch.bfloat16))


@pytest.mark.parametrize("name", sorted(E.FIXTURES))
def test_tensors_metadata_and_plain_tensors(name: str) -> None:
    """Tensors described as saved (as Megatron-Core describes them): those saved as flattened
    ranges as one flattened range of their shape, so load_plain_tensors returns them flat;
    unshard returns every tensor with its shape."""
    fixture = E.FIXTURES[name]
    metadata = dc.load_tensors_metadata(fixture_dir(name))
    assert {k: (tuple(v.global_shape), v.dtype) for k, v in metadata.items()} == {
        t.key: (t.global_shape, t.dtype) for t in fixture.tensors
    }
    flat = {t.key for t in fixture.tensors if any(p.flattened_range is not None for p in t.pieces)}
    assert {k for k, v in metadata.items() if v.flattened_range is not None} == flat
    assert all(v.flattened_range == slice(0, v.data.numel()) for k, v in metadata.items() if k in flat)
    plain = dc.load_plain_tensors(fixture_dir(name))
    whole = dc.unshard(fixture_dir(name))
    assert whole.keys() == E.expected_tensors(name).keys()
    for key, value in E.expected_tensors(name).items():
        E.assert_same(plain[key], value.flatten() if key in flat else value, key)
        E.assert_same(whole[key], value, key)


@pytest.mark.parametrize("name", sorted(E.FIXTURES))
def test_sharded_metadata_lists_objects_by_unique_key(name: str) -> None:
    found = dc.load_sharded_metadata(fixture_dir(name))
    objects = {k for k, v in found.items() if isinstance(v, dc.ShardedObject)}
    assert objects == set(E.expected_objects(name))
    assert {k for k, v in found.items() if isinstance(v, dc.ShardedTensor)} == {t.key for t in E.FIXTURES[name].tensors}


def test_common_state_with_a_namespace_loads_safely() -> None:
    E.assert_same(dc.load_common_state_dict(fixture_dir("tp2pp2")), E.expected_common("tp2pp2"), "common")


@pytest.mark.parametrize("shape", [(20, 8), (12, 8), (16, 4)], ids=["pad", "crop", "crop-columns"])
def test_allow_shape_mismatch_pads_and_crops(shape) -> None:
    request = dc.ShardedTensor.from_rank_offsets(EMB, torch.full(shape, 7.0, dtype=torch.bfloat16))
    request.allow_shape_mismatch = True
    loaded = dc.load({"e": request}, fixture_dir("tp2"))["e"]
    full = E.full_tensor(EMB, (16, 8), torch.bfloat16)
    rows, cols = min(shape[0], 16), min(shape[1], 8)
    assert torch.equal(loaded[:rows, :cols], full[:rows, :cols])
    assert not loaded[rows:].any() and not loaded[:, cols:].any()


def test_shape_mismatch_without_the_flag_names_key_and_fix() -> None:
    with pytest.raises(LoadMismatchError, match="allow_shape_mismatch") as info:
        dc.load(
            {"e": dc.ShardedTensor.from_rank_offsets(EMB, torch.zeros(20, 8, dtype=torch.bfloat16))}, fixture_dir("tp2")
        )
    assert EMB in str(info.value)


def test_dtype_is_cast_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    key = "output_layer.weight"  # fp32 in the fixture
    with caplog.at_level(logging.INFO, logger="dist_ckpt"):
        loaded = dc.load(
            {"o": dc.ShardedTensor.from_rank_offsets(key, torch.zeros(16, 8, dtype=torch.bfloat16))}, fixture_dir("tp2")
        )
    assert torch.equal(loaded["o"], E.full_tensor(key, (16, 8), torch.float32).to(torch.bfloat16))
    assert f"{key!r} (float32 -> bfloat16)" in caplog.text
    # a flattened legacy tensor (read through a scratch buffer) is cast too
    flat = "optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight"
    got = dc.load(
        {"f": dc.ShardedTensor.from_rank_offsets(flat, torch.zeros(16, 8, dtype=torch.float64))},
        fixture_dir("flat_legacy_mcore015"),
    )
    assert torch.equal(got["f"], E.full_tensor(flat, (16, 8), torch.float32).double())


def test_dtype_cast_can_be_refused() -> None:
    strict = TorchDistLoadShardedStrategy(allow_dtype_cast=False)
    request = {"o": dc.ShardedTensor.from_rank_offsets("output_layer.weight", torch.zeros(16, 8, dtype=torch.bfloat16))}
    with pytest.raises(LoadMismatchError, match="stored as torch.float32, requested as torch.bfloat16"):
        dc.load(request, fixture_dir("tp2"), sharded_strategy=strict)


def _two_keys():
    return {
        "e": dc.ShardedTensor.from_rank_offsets(EMB, torch.zeros(16, 8, dtype=torch.bfloat16)),
        "nope": dc.ShardedTensor.from_rank_offsets("not.in.checkpoint", torch.zeros(2)),
        "obj": dc.ShardedObject("not_an_object", None, (1,), (0,)),
    }


def test_absent_keys_raise_naming_them() -> None:
    with pytest.raises(KeyMismatchError, match="not.in.checkpoint") as info:
        dc.load(_two_keys(), fixture_dir("tp2"))
    assert info.value.unexpected_keys == ["not.in.checkpoint"]
    with pytest.raises(KeyMismatchError, match="not_an_object"):
        dc.load({"obj": dc.ShardedObject("not_an_object", None, (1,), (0,))}, fixture_dir("tp2"))


@pytest.mark.parametrize(
    "strict", [StrictHandling.LOG_ALL, StrictHandling.RETURN_ALL, StrictHandling.IGNORE_ALL, StrictHandling.RAISE_ALL]
)
def test_strict_modes(strict: StrictHandling) -> None:
    if strict == StrictHandling.RAISE_ALL:
        with pytest.raises(KeyMismatchError) as info:
            dc.load(_two_keys(), fixture_dir("tp2"), strict=strict)
        assert "not.in.checkpoint" in str(info.value) and "rng_state" in str(info.value)  # unexpected and missing
        return
    result = dc.load(_two_keys(), fixture_dir("tp2"), strict=strict)
    state = result[0] if isinstance(result, tuple) else result
    assert torch.equal(state["e"], E.full_tensor(EMB, (16, 8), torch.bfloat16))
    assert "nope" not in state and "obj" not in state
    if strict == StrictHandling.RETURN_ALL:
        _, missing, unexpected = result
        assert unexpected == {"not.in.checkpoint", "not_an_object"}
        assert "rng_state" in missing and "output_layer.weight" in missing


def test_a_shard_of_an_object_in_another_layout(tmp_path: Path) -> None:
    """Other shards of the key are stored, in another grid: not a key mismatch, nor damage, but an
    object asked for in another layout than it was saved in (as for the torch common strategy's
    object files; see tests/unit/backends/test_object_layout.py)."""
    request = {"r": dc.ShardedObject("rng_state", None, (1, 3), (0, 2))}  # saved with global shape (1, 2)
    with pytest.raises(ShardedObjectLayoutError, match="rng_state/shard_0.2_1.3"):
        dc.load(request, fixture_dir("tp2"), validate_access_integrity=False)
    request = {"r": dc.ShardedObject("rng_state", None, (1, 2), (0, 1))}
    loaded = dc.load(request, fixture_dir("tp2"), validate_access_integrity=False)
    E.assert_same(loaded["r"], E.expected_objects("tp2")["rng_state/shard_0.1_1.2"], "rng")


def test_truncated_distcp_file_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "tp2"
    shutil.copytree(fixture_dir("tp2"), ckpt)
    for path in ckpt.glob("__*.distcp"):
        path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError) as info:
        dc.load_plain_tensors(ckpt)
    assert str(ckpt) in str(info.value)


def test_loads_without_a_process_group_and_metadata_is_cached() -> None:
    strategy = TorchDistLoadShardedStrategy()
    first = strategy.open(fixture_dir("pp2"))
    assert strategy.open(fixture_dir("pp2")) is first
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("name", sorted(E.FIXTURES))
def test_inspect_and_verify_what_megatron_wrote(name: str) -> None:
    info = inspect_checkpoint(fixture_dir(name))
    assert info.kind == "dist_ckpt" and info.sharded_backend == "torch_dist:1" and info.world_size is None
    assert set(info.sharded_objects) == set(E.expected_objects(name))
    described = {t.key: t.shards for t in info.tensors}
    for spec in E.FIXTURES[name].tensors:
        shards = described[spec.key]
        assert shards is not None and len(shards) == len(E.dcp_chunks(spec))
    report = verify_checkpoint(fixture_dir(name))
    assert report.ok and any("no checksums recorded" in n for n in report.notes)


def test_legacy_flattened_chunks_are_described_as_flat_ranges_of_blocks() -> None:
    info = inspect_checkpoint(fixture_dir("flat_legacy_mcore015"))
    shards = {t.key: t.shards for t in info.tensors}["optimizer.state.exp_avg.decoder.layers.0.mlp.linear_fc1.weight"]
    assert shards is not None
    assert sorted((s.global_offset, s.shape, s.flat_range) for s in shards) == [
        ((0, 0), (8, 8), (0, 40)),
        ((0, 0), (8, 8), (40, 64)),
        ((8, 0), (8, 8), (0, 40)),
        ((8, 0), (8, 8), (40, 64)),
    ]


@pytest.mark.parametrize("name", sorted(E.FIXTURES))
def test_each_file_is_read_in_the_order_of_its_bytes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP reads the plan's items in plan order: the plan is sorted so a cold read of a file is sequential."""
    read: Dict[str, List[int]] = {}
    slice_file = load_module._Reader._slice_file

    def recording(self: Any, file: Any, sinfo: Any) -> Any:
        read.setdefault(sinfo.relative_path, []).append(sinfo.offset)
        return slice_file(self, file, sinfo)

    monkeypatch.setattr(load_module._Reader, "_slice_file", recording)
    requests, expected = golden_requests(name, 0, 1, STYLES[0])
    assert check_loaded(name, dc.load(requests, fixture_dir(name)), expected) == []
    assert read and all(offsets == sorted(offsets) for offsets in read.values()), read


def _objects(ckpt: Path, name: str) -> Dict[str, Any]:
    """Every main-replica ShardedObject of fixture ``name``, loaded from ``ckpt`` (by unique key)."""
    request = {
        o.unique_key: dc.ShardedObject(o.key, None, o.global_shape, o.global_offset)
        for o in E.FIXTURES[name].objects
        if o.is_main_replica
    }
    loaded = dc.load(request, ckpt)
    return {k: loaded[k] for k in request}


@pytest.mark.parametrize("name", sorted(E.FIXTURES))
def test_what_megatron_wrote_converts_to_every_backend_and_back(name: str, tmp_path: Path) -> None:
    """torch_dist (Megatron-Core's) -> safetensors -> torch_dist and -> HF -> torch_dist, bit-exact:
    tensors by their logical shape, ShardedObjects and common state carried (HF: tensors only)."""
    fixture = fixture_dir(name)
    hops = [(fixture, tmp_path / "st", "safetensors"), (tmp_path / "st", tmp_path / "td", "torch_dist")]
    hops += [(fixture, tmp_path / "hf", "hf"), (tmp_path / "hf", tmp_path / "hf_td", "torch_dist")]
    for src, dst, to in hops:
        convert(src, dst, to=to)
    expected = E.expected_tensors(name)
    for ckpt in ("st", "td", "hf_td"):
        found = dc.unshard(tmp_path / ckpt)
        assert found.keys() == expected.keys(), ckpt
        for key, value in expected.items():
            E.assert_same(found[key], value, f"{ckpt}:{key}")
    for ckpt in ("st", "td"):
        E.assert_same(_objects(tmp_path / ckpt, name), E.expected_objects(name), ckpt)
        E.assert_same(dc.load_common_state_dict(tmp_path / ckpt), E.expected_common(name), ckpt)
    assert verify_checkpoint(tmp_path / "td").ok and verify_checkpoint(tmp_path / "hf_td").ok


def test_the_commands_take_what_megatron_wrote(tmp_path: Path, cli: Cli) -> None:
    """dist-ckpt inspect, verify, convert and export-hf on a Megatron-Core TP=2 x PP=2 checkpoint."""

    fixture = fixture_dir("tp2pp2")
    shown = cli("inspect", str(fixture))
    assert shown.returncode == 0 and "torch_dist:1" in shown.stdout, shown.stderr
    described = cli("inspect", str(fixture), "--json")  # the table shortens keys to the terminal's width
    assert described.returncode == 0, described.stderr
    assert {t["key"] for t in json.loads(described.stdout)["tensors"]} == set(E.expected_tensors("tp2pp2"))
    verified = cli("verify", str(fixture), "--json")
    assert verified.returncode == 0 and "no checksums recorded" in verified.stdout, verified.stderr
    converted = cli("convert", str(fixture), str(tmp_path / "st"), "--to", "safetensors", "--no-progress")
    assert converted.returncode == 0, converted.stderr
    exported = cli("export-hf", str(fixture), str(tmp_path / "hf"), "--no-progress")
    assert exported.returncode == 0, exported.stderr
    expected = E.expected_tensors("tp2pp2")
    E.assert_same(dc.unshard(tmp_path / "st")[EMB], expected[EMB], "safetensors")
    E.assert_same(load_file(tmp_path / "hf" / "model.safetensors")[EMB], expected[EMB], "hf")
