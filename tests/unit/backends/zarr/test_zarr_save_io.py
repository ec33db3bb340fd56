"""How the zarr engines' saves do their I/O on a local disk (local_save): digests from the bytes
written (no second read of the files), several tensors at a time, durable with one syncfs (see
storage.files), a bounded number of files and directories per tensor."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dist_ckpt.backends.zarr import checksums as zarr_checksums
from dist_ckpt.backends.zarr.layout import ZARR_DIR
from dist_ckpt.backends.zarr.nodes import creates_array
from dist_ckpt.backends.zarr.zarr_python import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy
from dist_ckpt.integrity.checksums import file_digest
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.storage.location import resolve_location
from dist_ckpt.storage.object_path import ObjectPath
from dist_ckpt.testing.layouts import bits
from tests.page_cache import drops_clean_pages, resident_pages

_WRITTEN_LAST = ("checksums.json", "zarr.json")


def _state():
    sd = {
        f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.arange(12.0 * (i + 1)).reshape(3, -1)) for i in range(5)
    }
    # a tensor saved as flattened ranges (fragment arrays) and a bf16 one
    sd["flat"] = ShardedTensor.from_rank_offsets_flat("flat", torch.arange(6.0), (2, 3), flattened_range=slice(0, 6))
    sd["bf16"] = ShardedTensor.from_rank_offsets("bf16", torch.arange(8.0).to(torch.bfloat16))
    return sd


@pytest.mark.parametrize("engine", ["zarr-python", "tensorstore"])
def test_the_manifest_is_digested_from_the_written_bytes_without_reading_files(tmp_path, monkeypatch, engine):
    from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreSaveShardedStrategy

    read_back = []
    monkeypatch.setattr(zarr_checksums, "file_digest", lambda path: read_back.append(path))
    strategy = ZarrSaveShardedStrategy if engine == "zarr-python" else TensorStoreSaveShardedStrategy
    strategy().save(_state(), Path(tmp_path))
    assert read_back == []  # every file, fragments and zarr.json included (local_save)
    manifest = json.loads((tmp_path / ZARR_DIR / "checksums.json").read_text())
    files = manifest.get("files", manifest)
    root = ObjectPath(resolve_location(tmp_path)) / ZARR_DIR
    on_disk = sorted(
        p.relative_to(tmp_path / ZARR_DIR).as_posix() for p in (tmp_path / ZARR_DIR).rglob("*") if p.is_file()
    )
    assert sorted(files) == [name for name in on_disk if name != "checksums.json"]
    for name, entry in files.items():
        digest = file_digest(root / name)
        assert (entry["size"], int(entry["crc32c"], 16)) == (digest.size, digest.crc32c), name


def test_loads_of_a_save_written_several_tensors_at_a_time_are_exact(tmp_path):
    saved = _state()
    ZarrSaveShardedStrategy().save(saved, Path(tmp_path))
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v.data)) for k, v in saved.items() if k != "flat"}
    loaded = ZarrLoadShardedStrategy().load(request, Path(tmp_path))
    for k, v in loaded.items():
        assert torch.equal(bits(v), bits(saved[k].data)), k


def _grid_shards(key, grid, chunk=(2, 3)):
    shape = tuple(g * c for g, c in zip(grid, chunk))
    out = []
    for i in range(grid[0]):
        for j in range(grid[1]):
            out.append(
                ShardedTensor.from_rank_offsets(key, torch.zeros(chunk), (0, i, grid[0]), (1, j, grid[1]))
                if grid != (1, 1)
                else ShardedTensor.from_rank_offsets(key, torch.zeros(chunk))
            )
            assert out[-1].global_shape == shape
    return out


def test_exactly_one_shard_of_each_tensor_creates_its_array_and_not_always_the_first():
    picks = set()
    for n, grid in enumerate([(1, 1), (4, 1), (1, 3), (2, 3), (3, 2)] * 4):
        key = f"layer.{n}.weight"
        creators = [i for i, sh in enumerate(_grid_shards(key, grid)) if creates_array(sh)]
        assert len(creators) == 1, (key, grid, creators)
        picks.add(creators[0])
    assert len(picks) > 1  # spread over the chunks (hence the ranks), not always the origin's holder


def _many(n):
    return {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((4, 4), float(i))) for i in range(n)}


@pytest.mark.parametrize("engine", ["zarr-python", "tensorstore"])
def test_a_save_syncs_a_bounded_number_of_times_whatever_the_number_of_tensors(tmp_path, monkeypatch, engine):
    from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreSaveShardedStrategy
    from dist_ckpt.storage import files

    if files._syncfs() is None:
        pytest.skip("no syncfs here: files are fsynced one by one")
    strategy = ZarrSaveShardedStrategy if engine == "zarr-python" else TensorStoreSaveShardedStrategy
    counts = []
    for n in (3, 30):
        syncs, fsyncs = [], []
        real_syncfs, real_fsync = files._syncfs(), os.fsync
        monkeypatch.setattr(files, "_syncfs", lambda: lambda fd: (syncs.append(fd), real_syncfs(fd))[1])
        monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd))[1])
        strategy().save(_many(n), Path(tmp_path / f"n{n}"))
        monkeypatch.undo()
        counts.append((len(syncs), len(fsyncs)))
    assert counts[0] == counts[1] and counts[0][0] == 1, counts  # one syncfs; the manifest's own fsyncs


def test_byte_budget_never_holds_more_than_its_limit_but_lets_a_large_item_through_alone():
    import threading
    import time

    from dist_ckpt.backends.zarr.nodes import ByteBudget, in_threads

    budget, lock = ByteBudget(10), threading.Lock()
    holders = []  # sizes held now
    bad = []

    def work(n):
        with budget.hold(n):
            with lock:
                holders.append(n)
                if sum(holders) > 10 and len(holders) > 1:
                    bad.append(list(holders))
            time.sleep(0.01)
            with lock:
                holders.remove(n)

    in_threads(work, [6, 6, 4, 20, 3, 3, 3, 6, 9, 1])
    assert bad == []


def _fill_the_disk_at(monkeypatch, tensor_dir: str) -> None:
    """Local zarr saves get ENOSPC writing the chunk files of ``tensor_dir`` (not its zarr.json)."""
    import errno

    from dist_ckpt.backends.zarr import local_save

    real = local_save._write_new

    def full_disk(path: str, data: memoryview, window):
        if os.path.basename(os.path.dirname(path)) == tensor_dir and not path.endswith("zarr.json"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real(path, data, window)

    monkeypatch.setattr(local_save, "_write_new", full_disk)


@pytest.mark.parametrize("engine", ["zarr-python", "tensorstore"])
def test_a_refused_write_is_a_storage_error_naming_rank_tensor_and_path(tmp_path, monkeypatch, engine):
    """The file system's refusal (here ENOSPC on one chunk file) reaches the caller as a typed
    StorageError that names the rank, the tensor and the file, its OSError kept as the cause."""
    import errno

    import dist_ckpt as dc
    from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreSaveShardedStrategy
    from dist_ckpt.storage.errors import StorageError

    _fill_the_disk_at(monkeypatch, "t3")
    strategy = ZarrSaveShardedStrategy() if engine == "zarr-python" else TensorStoreSaveShardedStrategy()
    with pytest.raises(StorageError, match=r"\[rank 0\] .*'t3'.*t3/c\.0\.0: No space left on device") as info:
        dc.save(_state(), tmp_path / "c", sharded_strategy=strategy)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert not (tmp_path / "c" / "metadata.json").exists()


def test_a_chunk_file_that_exists_is_never_overwritten(tmp_path):
    from dist_ckpt.backends.zarr.local_save import plan_node_files, write_node_files
    from dist_ckpt.storage.errors import ObjectExistsError

    (node,) = plan_node_files([ShardedTensor.from_rank_offsets("w", torch.ones(2, 3))], root_group=False)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "c.0.0").write_bytes(b"earlier")
    with pytest.raises(ObjectExistsError, match=r"'w'.*c\.0\.0"):
        write_node_files(str(tmp_path), node)
    assert (tmp_path / "w" / "c.0.0").read_bytes() == b"earlier"


@pytest.mark.parametrize("engine", ["zarr-python", "tensorstore"])
def test_a_local_save_leaves_its_files_out_of_the_page_cache(tmp_path, engine):
    """Once durable, a save's chunk files and zarr.json documents leave the page cache (a
    checkpoint crowded out the training job's data, and made the next save twice as slow on the
    test VM)."""
    from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreSaveShardedStrategy

    if not drops_clean_pages(tmp_path):
        pytest.skip("this file system keeps a file's pages (tmpfs) or has no posix_fadvise")
    state = _state()
    state["big"] = ShardedTensor.from_rank_offsets("big", torch.ones(1024, 1024))  # 4 MiB, early writeback
    strategy = ZarrSaveShardedStrategy if engine == "zarr-python" else TensorStoreSaveShardedStrategy
    strategy().save(state, Path(tmp_path))
    tree = tmp_path / ZARR_DIR
    # the manifest and the root group (indexing every zarr.json) come after
    written = [p for p in tree.rglob("*") if p.is_file() and p.relative_to(tree).as_posix() not in _WRITTEN_LAST]
    assert len(written) > 2 * len(state)
    assert {p.relative_to(tree).as_posix(): resident_pages(p) for p in written if resident_pages(p)} == {}


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
@pytest.mark.parametrize("engine", ["zarr-python", "tensorstore"])
def test_large_chunk_files_go_through_a_writeback_window_that_a_failure_closes(tmp_path, monkeypatch, engine):
    """Every chunk file of at least EARLY_WRITEBACK_BYTES is handed to the save's WritebackWindow
    (dropped from the page cache as the save goes, not all at the end); a save that fails half way
    leaves none of their descriptors open."""

    import dist_ckpt as dc
    from dist_ckpt.backends.zarr import local_save
    from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreSaveShardedStrategy
    from dist_ckpt.storage.errors import StorageError
    from dist_ckpt.storage.files import WritebackWindow

    handed = []

    class Recording(WritebackWindow):
        def hand_over(self, fd: int, nbytes: int) -> None:
            handed.append(nbytes)
            super().hand_over(fd, nbytes)

    monkeypatch.setattr(local_save, "WritebackWindow", Recording)
    big = local_save.EARLY_WRITEBACK_BYTES // 4
    state = {f"b{i}": ShardedTensor.from_rank_offsets(f"b{i}", torch.full((big,), float(i))) for i in range(6)}
    state.update(_state())
    strategy = ZarrSaveShardedStrategy if engine == "zarr-python" else TensorStoreSaveShardedStrategy
    before = _open_descriptors()
    dc.save(state, tmp_path / "ok", sharded_strategy=strategy())
    assert sorted(handed) == [local_save.EARLY_WRITEBACK_BYTES] * 6  # the large chunks, nothing small
    assert _open_descriptors() == before
    loaded = dc.load(
        {k: ShardedTensor.from_rank_offsets(k, torch.empty(big)) for k in ("b0", "b5")},
        tmp_path / "ok",
        sharded_strategy=ZarrLoadShardedStrategy(),
    )
    assert torch.equal(bits(loaded["b5"]), bits(torch.full((big,), 5.0)))

    _fill_the_disk_at(monkeypatch, "b4")
    with pytest.raises(StorageError, match=r"'b4'.*No space left"):
        dc.save(state, tmp_path / "failed", sharded_strategy=strategy())
    assert _open_descriptors() == before


def test_a_failed_close_of_the_chunk_files_fails_the_save_as_a_storage_error(tmp_path, monkeypatch):
    import errno

    import dist_ckpt as dc
    from dist_ckpt.backends.zarr import local_save
    from dist_ckpt.storage.errors import StorageError
    from dist_ckpt.storage.files import WritebackWindow

    class FailingClose(WritebackWindow):
        def close(self) -> None:
            super().close()
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(local_save, "WritebackWindow", FailingClose)
    with pytest.raises(StorageError, match=r"\[rank 0\] closing the zarr files written under .*Input/output error"):
        dc.save(_state(), tmp_path / "c", sharded_strategy=ZarrSaveShardedStrategy())
    assert not (tmp_path / "c" / "metadata.json").exists()
