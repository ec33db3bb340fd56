"""dist_ckpt.dcp's StorageWriter / StorageReader under DCP's own save and load, in one process.

Round trips (local and S3), DCP's FileSystemReader reading what the writer wrote and the reader
reading what FileSystemWriter wrote, a flipped byte or a deleted manifest failing closed with
the key, rank and file named, and a save that raised or stopped before ``finish`` leaving
nothing loadable.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan

import dist_ckpt.dcp
from dist_ckpt.dcp.items import split_items
from dist_ckpt.errors import CheckpointExistsError, ChecksumMismatchError, NotACheckpointError
from dist_ckpt.storage import LocalStorageOptions, StorageError
from dist_ckpt.storage.local import LocalStorage


@pytest.fixture(autouse=True)
def _no_single_process_warning() -> Iterator[None]:
    with warnings.catch_warnings():  # DCP warns that it saves "in a single process", as intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _state() -> Dict[str, Any]:
    return {
        "w": torch.arange(48, dtype=torch.float32).reshape(6, 8),
        "big": torch.linspace(0, 1, 40_000, dtype=torch.bfloat16),  # a data record with a span of its own
        "view": torch.arange(100, dtype=torch.int64)[10:20],  # part of a larger storage
        "blob": io.BytesIO(b"rng state"),
        "step": 7,
    }


def _empty() -> Dict[str, Any]:
    return {
        "w": torch.zeros(6, 8),
        "big": torch.zeros(40_000, dtype=torch.bfloat16),
        "view": torch.zeros(10, dtype=torch.int64),
        "blob": io.BytesIO(),
        "step": 0,
    }


def _same(got: Dict[str, Any], want: Dict[str, Any]) -> bool:
    tensors = all(torch.equal(got[k], want[k]) for k in ("w", "big", "view"))
    return tensors and got["blob"].getvalue() == want["blob"].getvalue() and got["step"] == want["step"]


def _failure(error: BaseException) -> BaseException:
    """Rank 0's exception inside DCP's CheckpointException (which maps each rank to it and its traceback)."""
    assert isinstance(error, dcp.api.CheckpointException), error
    return error.failures[0][0]


def _save(path: Any, **kwargs: Any) -> Dict[str, Any]:
    state = _state()
    dcp.save(state, storage_writer=dist_ckpt.dcp.StorageWriter(path, **kwargs))
    return _state()


def test_round_trip_and_dcp_file_system_reader(tmp_path: Path) -> None:
    want = _save(tmp_path, thread_count=3)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp", "torch_dist.checksums.json"]
    got = _empty()
    dcp.load(got, storage_reader=dist_ckpt.dcp.StorageReader(tmp_path))
    assert _same(got, want)
    plain = _empty()
    dcp.load(plain, storage_reader=dcp.FileSystemReader(str(tmp_path)))  # DCP's own reader, unchanged format
    assert _same(plain, want)


def test_reads_a_checkpoint_of_dcps_file_system_writer(tmp_path: Path) -> None:
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    got = _empty()
    dcp.load(got, storage_reader=dist_ckpt.dcp.StorageReader(tmp_path))  # unmarked: loads unverified
    assert _same(got, _state())


def test_checkpoint_id_replaces_the_path(tmp_path: Path) -> None:
    dcp.save(_state(), checkpoint_id=tmp_path / "a", storage_writer=dist_ckpt.dcp.StorageWriter(tmp_path / "b"))
    assert (tmp_path / "a" / ".metadata").is_file() and not (tmp_path / "b").exists()


def test_a_flipped_byte_fails_closed_naming_key_rank_and_file(tmp_path: Path) -> None:
    _save(tmp_path, thread_count=1)
    data = tmp_path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # inside "big"'s data record, the largest item
    data.write_bytes(bytes(raw))
    got = _empty()
    with pytest.raises(dcp.api.CheckpointException) as caught:
        dcp.load(got, storage_reader=dist_ckpt.dcp.StorageReader(tmp_path))
    error = _failure(caught.value)
    assert isinstance(error, ChecksumMismatchError)
    assert "[rank 0]" in str(error) and "'big'" in str(error) and str(data) in str(error)


def test_a_deleted_manifest_or_an_edited_metadata_fails_closed(tmp_path: Path) -> None:
    _save(tmp_path)
    raw = (tmp_path / ".metadata").read_bytes()
    (tmp_path / "torch_dist.checksums.json").rename(tmp_path / "moved.json")
    with pytest.raises(dcp.api.CheckpointException) as caught:
        dcp.load(_empty(), storage_reader=dist_ckpt.dcp.StorageReader(tmp_path))
    # DCP turns every error of read_metadata into an AssertionError carrying its message
    assert "torch_dist.checksums.json is missing" in str(_failure(caught.value))
    (tmp_path / "moved.json").rename(tmp_path / "torch_dist.checksums.json")
    edited = raw.replace(b"step", b"stop")  # the pickle still loads; the key changed
    (tmp_path / ".metadata").write_bytes(edited)
    with pytest.raises(dcp.api.CheckpointException) as caught:
        dcp.load(_empty(), storage_reader=dist_ckpt.dcp.StorageReader(tmp_path))
    assert "[rank 0] the DCP metadata" in str(_failure(caught.value)) and "crc32c" in str(_failure(caught.value))


def test_a_failed_write_leaves_nothing_loadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path)  # an older checkpoint at the same place: the new save retires it first
    real = LocalStorage.open_writer
    calls = []

    def failing(self: LocalStorage, key: str) -> Any:
        calls.append(key)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(self, key)

    monkeypatch.setattr(LocalStorage, "open_writer", failing)
    with pytest.raises(dcp.api.CheckpointException) as caught:
        dcp.save(_state(), storage_writer=dist_ckpt.dcp.StorageWriter(tmp_path, thread_count=2))
    assert isinstance(_failure(caught.value), StorageError)
    assert not (tmp_path / ".metadata").exists()
    for reader in (dist_ckpt.dcp.StorageReader(tmp_path), dcp.FileSystemReader(str(tmp_path))):
        with pytest.raises(dcp.api.CheckpointException):
            dcp.load(_empty(), storage_reader=reader)


def test_a_save_stopped_before_finish_is_no_checkpoint(tmp_path: Path) -> None:
    """What a save killed after writing its files and before the commit leaves behind."""
    writer = dist_ckpt.dcp.StorageWriter(tmp_path, storage_options=LocalStorageOptions(fsync=False))
    planner = DefaultSavePlanner()
    planner.set_up_planner(_state(), is_coordinator=True)
    writer.set_up_storage_writer(True, rank=0)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans, _ = planner.create_global_plan([local])
    plan = writer.prepare_global_plan(plans)[0]
    writer.write_data(planner.finish_plan(plan), planner).wait()
    assert (tmp_path / "__0_0.distcp").is_file() and not (tmp_path / ".metadata").exists()
    reader = dist_ckpt.dcp.StorageReader(tmp_path)
    with pytest.raises(NotACheckpointError, match=r"\.metadata does not exist"):
        reader.read_metadata()


def test_overwrite_false_keeps_an_existing_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path)
    with pytest.raises(dcp.api.CheckpointException) as caught:
        dcp.save(_state(), storage_writer=dist_ckpt.dcp.StorageWriter(tmp_path, overwrite=False))
    assert isinstance(_failure(caught.value), CheckpointExistsError)
    got = _empty()
    dcp.load(got, storage_reader=dist_ckpt.dcp.StorageReader(tmp_path))
    assert _same(got, _state())


def test_split_items_balances_files_and_keeps_every_item() -> None:
    planner = DefaultSavePlanner()
    planner.set_up_planner(_state(), is_coordinator=True)
    plan: SavePlan = planner.create_local_plan()
    groups = split_items(plan.items, 2)
    assert len(groups) == 2 and sorted(i.index.fqn for g in groups for i in g) == sorted(
        i.index.fqn for i in plan.items
    )
    assert split_items(plan.items[:1], 4) == [plan.items[:1]]


def test_round_trip_on_s3(s3_url: str) -> None:
    want = _save(s3_url)
    got = _empty()
    dcp.load(got, storage_reader=dist_ckpt.dcp.StorageReader(s3_url))
    assert _same(got, want)


def test_dist_ckpt_load_and_verify_read_it_and_fail_closed(tmp_path: Path) -> None:
    """A StorageWriter checkpoint is a plain DCP directory to dist_ckpt.load and dist-ckpt verify,
    its manifest included."""
    import dist_ckpt as dc
    from dist_ckpt.tools.verify import verify_checkpoint

    want = _save(tmp_path, thread_count=1)
    out = dc.load({"w": dc.ShardedTensor.from_rank_offsets("w", torch.zeros(6, 8))}, tmp_path)
    assert torch.equal(out["w"], want["w"])
    assert verify_checkpoint(tmp_path).ok
    data = tmp_path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    assert not verify_checkpoint(tmp_path).ok
    with pytest.raises(ChecksumMismatchError, match="__0_0.distcp"):
        dc.load({"big": dc.ShardedTensor.from_rank_offsets("big", torch.zeros(40_000, dtype=torch.bfloat16))}, tmp_path)
