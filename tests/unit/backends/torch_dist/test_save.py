"""Saving torch_dist in one process: the files Megatron-Core expects, the checksums, verification,
asynchronous saves, conversions, and the leftovers of an interrupted save."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

import dist_ckpt as dc
from dist_ckpt.backends.torch_dist.checksums import CHECKSUMS_FILENAME, item_spans, parse_manifest
from dist_ckpt.backends.torch_dist.load import TorchDistLoadShardedStrategy
from dist_ckpt.backends.torch_dist.metadata import read_metadata
from dist_ckpt.backends.torch_dist.save import TorchDistSaveOptions, TorchDistSaveShardedStrategy
from dist_ckpt.errors import (
    CheckpointExistsError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    NotACheckpointError,
    SaveConflictError,
)
from dist_ckpt.record.commit import RECORD_FILENAME, read_save_record
from dist_ckpt.tools.convert import convert
from dist_ckpt.tools.inspection import inspect_checkpoint
from dist_ckpt.tools.verify import verify_checkpoint

TORCH_DIST = ("torch_dist", 1)
MEGATRON_KEYS = ["sharded_backend", "sharded_backend_version", "common_backend", "common_backend_version"]


def state() -> Dict[str, Any]:
    flat_full = torch.arange(16, dtype=torch.float32).reshape(8, 2)
    return {
        "w": dc.ShardedTensor.from_rank_offsets("w", torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)),
        "layers": [
            dc.ShardedTensor.from_rank_offsets("layers.w", torch.full((2,), float(i)), (0, i, 2), prepend_axis_num=1)
            for i in range(2)
        ],
        # distributed-optimizer state: each TP chunk (4 x 2) flattened and cut in two
        "flat": [
            dc.ShardedTensor.from_rank_offsets_flat(
                "opt.w",
                flat_full[tp * 4 : (tp + 1) * 4].flatten()[a:b].clone(),
                (4, 2),
                (0, tp, 2),
                flattened_range=slice(a, b),
            )
            for tp in range(2)
            for a, b in ((0, 3), (3, 8))
        ],
        "rng": dc.ShardedObject("rng", {"seed": 1, "te": io.BytesIO(b"extra")}, (1,), (0,)),
        "iteration": 10,
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    dc.save(state(), path, sharded_strategy=TORCH_DIST)
    return path


def test_files_and_megatron_metadata_json(ckpt: Path) -> None:
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == sorted(
        [".metadata", "__0_0.distcp", "__0_1.distcp", CHECKSUMS_FILENAME, "common.checksums.json", "common.pt"]
        + ["metadata.json", RECORD_FILENAME]
    )
    record = json.loads((ckpt / "metadata.json").read_text())
    assert list(record) == MEGATRON_KEYS and record["sharded_backend"] == "torch_dist"  # nothing Megatron refuses
    assert read_save_record(ckpt)["world_size"] == 1 and inspect_checkpoint(ckpt).world_size == 1


def test_objects_live_inside_dcp_as_megatron_stores_them(ckpt: Path) -> None:
    md = read_metadata(ckpt)
    assert isinstance(md.state_dict_metadata["rng/shard_0_1"], BytesStorageMetadata)
    info = md.storage_data[MetadataIndex("rng/shard_0_1")]
    raw = (ckpt / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    with torch.serialization.safe_globals([io.BytesIO]):
        value = torch.load(io.BytesIO(raw), weights_only=True)
    assert isinstance(value, list) and len(value) == 1 and value[0]["seed"] == 1
    assert not (ckpt / "objects").exists()


def test_flattened_ranges_saved_in_megatron_reformulated_layout(ckpt: Path) -> None:
    md = read_metadata(ckpt)
    assert tuple(md.state_dict_metadata["opt.w"].size) == (2, 1, 8)
    assert md.mcore_data == {"opt.w": {"nd_reformulated_orig_global_shape": (8, 2)}}  # type: ignore[attr-defined]
    column = {"f": dc.ShardedTensor.from_rank_offsets("opt.w", torch.zeros(8, 1), (1, 1, 2))}
    loaded = dc.load(column, ckpt, validate_access_integrity=False)  # one column: across the stored blocks
    assert torch.equal(loaded["f"], torch.arange(16, dtype=torch.float32).reshape(8, 2)[:, 1:])


def test_round_trip_and_verify(ckpt: Path) -> None:
    request = {
        "w": dc.ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4, dtype=torch.bfloat16)),
        "layers": dc.ShardedTensor.from_rank_offsets("layers.w", torch.zeros(2, 2)),
        "rng": dc.ShardedObject("rng", None, (1,), (0,)),
    }
    loaded = dc.load(request, ckpt)
    assert torch.equal(loaded["w"], torch.arange(12, dtype=torch.bfloat16).reshape(3, 4))
    assert torch.equal(loaded["layers"], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert loaded["rng"]["te"].getvalue() == b"extra" and loaded["iteration"] == 10
    report = verify_checkpoint(ckpt)
    assert report.ok and report.backends == ["torch_dist:1", "torch:1"] and not report.notes


def _damage(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_item_fails_the_load_and_verify(ckpt: Path) -> None:
    md = read_metadata(ckpt)
    info = md.storage_data[MetadataIndex("w", (0, 0))]
    _damage(ckpt / info.relative_path, info.offset + info.length - 40)
    request = {"w": dc.ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4, dtype=torch.bfloat16))}
    with pytest.raises(ChecksumMismatchError) as error:
        dc.load(request, ckpt)
    assert str(ckpt / info.relative_path) in str(error.value)
    report = verify_checkpoint(ckpt)
    assert not report.ok and [p.path for p in report.problems] == [info.relative_path]
    assert report.problems[0].key == "w"
    unverified = dc.load(request, ckpt, sharded_strategy=TorchDistLoadShardedStrategy(verify_checksums=False))
    assert unverified["w"].shape == (3, 4)  # the damage hit the zip's trailer; the bytes still load


def test_damaged_metadata_file_is_caught_by_its_checksum(ckpt: Path) -> None:
    raw = bytearray((ckpt / ".metadata").read_bytes())
    raw[-3] ^= 0x01
    (ckpt / ".metadata").write_bytes(bytes(raw))
    assert not verify_checkpoint(ckpt).ok


def test_saved_without_checksums(tmp_path: Path) -> None:
    strategy = TorchDistSaveShardedStrategy(thread_count=1, options=TorchDistSaveOptions(checksums=False))
    dc.save(state(), tmp_path / "c", sharded_strategy=strategy)
    assert not (tmp_path / "c" / CHECKSUMS_FILENAME).exists() and (tmp_path / "c" / "__0_0.distcp").exists()
    report = verify_checkpoint(tmp_path / "c")
    assert report.ok and any("no checksums recorded" in n for n in report.notes)


def test_checksum_manifest_covers_every_file(ckpt: Path) -> None:
    manifest = parse_manifest((ckpt / CHECKSUMS_FILENAME).read_bytes(), CHECKSUMS_FILENAME)
    assert set(manifest) == {".metadata", "__0_0.distcp", "__0_1.distcp"}
    md = read_metadata(ckpt)
    for info in md.storage_data.values():  # whole spans tile each item: a load checks exactly what it reads
        spans = manifest[info.relative_path].spans
        assert item_spans([s[0] for s in spans], spans, info.offset, info.length), info
    items = sum(len(spans.spans) for name, spans in manifest.items() if name != ".metadata")
    assert items == len(md.storage_data)  # small items (no write of OWN_SPAN_BYTES): one span each


def test_async_save_writes_the_same_files(tmp_path: Path) -> None:
    dc.save(state(), tmp_path / "sync", sharded_strategy=TORCH_DIST)
    sd = state()
    request = dc.save(sd, tmp_path / "async", sharded_strategy=TORCH_DIST, async_sharded_save=True)
    assert request is not None and not (tmp_path / "async" / "metadata.json").exists()
    sd["w"].data.fill_(-1)  # after the snapshot
    request.execute_sync()
    for name in ("__0_0.distcp", "__0_1.distcp"):
        assert (tmp_path / "sync" / name).read_bytes() == (tmp_path / "async" / name).read_bytes()
    assert verify_checkpoint(tmp_path / "async").ok
    assert torch.equal(
        dc.load_plain_tensors(tmp_path / "async")["w"], torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    )


def test_interrupted_save_is_not_loadable_and_its_files_are_not_deleted(tmp_path: Path) -> None:
    """Files with DCP's names (patterns included) and no in-progress record of a save that is
    provably gone are not dist_ckpt's to delete (issue 15): the next save refuses, naming them."""
    path = tmp_path / "c"
    dc.save(state(), path, sharded_strategy=TORCH_DIST)
    (path / "metadata.json").unlink()  # as if rank 0 died before the commit
    (path / "__7_1.distcp").write_bytes(b"a leftover of a save by more ranks")
    with pytest.raises(NotACheckpointError, match="metadata.json"):
        dc.load_tensors_metadata(path)
    assert not verify_checkpoint(path).committed
    with pytest.raises(SaveConflictError, match=r"__7_1\.distcp.*no record says dist_ckpt wrote them"):
        dc.save(state(), path, sharded_strategy=TORCH_DIST)
    assert (path / "__7_1.distcp").exists() and (path / "__0_0.distcp").exists()
    fresh = tmp_path / "fresh"
    dc.save(state(), fresh, sharded_strategy=TORCH_DIST)
    assert verify_checkpoint(fresh).ok
    with pytest.raises(CheckpointExistsError):
        dc.save(state(), fresh, sharded_strategy=TORCH_DIST)


def test_convert_both_ways(ckpt: Path, tmp_path: Path) -> None:
    """torch_dist -> safetensors -> zarr -> torch_dist, one tensor at a time; objects and common state
    carried, the last one inside DCP again."""
    hops = [("safetensors", tmp_path / "st"), ("zarr", tmp_path / "zarr"), ("torch_dist", tmp_path / "back")]
    source = ckpt
    for to, dst in hops:
        result = convert(source, dst, to=to)
        assert result.tensors == 3 and result.sharded_objects == 1 and verify_checkpoint(dst).ok
        source = dst
    assert (
        not (tmp_path / "back" / "objects").exists()
        and list(json.loads((tmp_path / "back" / "metadata.json").read_text())) == MEGATRON_KEYS
    )
    full = dc.unshard(ckpt)
    again = dc.unshard(tmp_path / "back")
    assert full.keys() == again.keys() and all(torch.equal(full[k], again[k]) for k in full)
    loaded = dc.load({"rng": dc.ShardedObject("rng", None, (1,), (0,))}, tmp_path / "back")
    assert loaded["rng"]["seed"] == 1 and loaded["iteration"] == 10


def test_objects_stored_by_another_writer_without_a_list_are_refused(ckpt: Path) -> None:
    md = read_metadata(ckpt)
    info = md.storage_data[MetadataIndex("rng/shard_0_1")]
    path = ckpt / info.relative_path
    data = path.read_bytes()
    buf = io.BytesIO()
    torch.save({"seed": 1}, buf)  # Megatron-Core stores [value]; a bare value would come back wrong there
    payload = buf.getvalue()
    assert len(payload) <= info.length
    path.write_bytes(data[: info.offset] + payload.ljust(info.length, b"\0") + data[info.offset + info.length :])
    strategy = TorchDistLoadShardedStrategy(verify_checksums=False)
    with pytest.raises(CorruptCheckpointError, match="list"):
        dc.load({"rng": dc.ShardedObject("rng", None, (1,), (0,))}, ckpt, sharded_strategy=strategy)


class _FailsAtCommit(TorchDistSaveShardedStrategy):
    """Writes every file, then fails before ``.metadata`` (as a full disk would)."""

    def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        from dist_ckpt.backends.torch_dist import save as save_module

        original = save_module.publish_staged

        def publish_then_look(directory: Any, names: Any) -> None:
            staged = sorted(p.name for p in (Path(directory) / ".partial-distcp").iterdir())
            assert staged == sorted(names) and not list(Path(directory).glob("__*.distcp")), staged
            raise OSError(28, "No space left on device")

        save_module.publish_staged = publish_then_look  # type: ignore[assignment]
        try:
            super().save(sharded_state_dict, checkpoint_dir)
        finally:
            save_module.publish_staged = original  # type: ignore[assignment]


def test_data_files_stay_staged_until_the_commit_and_a_failed_save_removes_them(tmp_path):
    with pytest.raises(OSError, match="No space left"):
        dc.save(state(), tmp_path / "c", sharded_strategy=_FailsAtCommit())
    assert sorted(p.name for p in (tmp_path / "c").rglob("*")) == []
    dc.save(state(), tmp_path / "c", sharded_strategy=TORCH_DIST)
    assert not (tmp_path / "c" / ".partial-distcp").exists()
    assert sorted(p.name for p in (tmp_path / "c").glob("__*.distcp")) == ["__0_0.distcp", "__0_1.distcp"]


def test_publishing_refuses_a_staging_directory_that_changed(tmp_path):
    from dist_ckpt.backends.torch_dist.staging import publish_staged, staging_dir

    (staging_dir(tmp_path) / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(dc.CheckpointingException, match="missing at the commit"):
        publish_staged(tmp_path, ["__0_0.distcp", "__1_0.distcp"])
    assert not list(tmp_path.glob("__*.distcp"))
    (staging_dir(tmp_path) / "__1_0.distcp").write_bytes(b"y")
    with pytest.raises(dc.CheckpointingException, match="no rank reported writing"):
        publish_staged(tmp_path, [])
