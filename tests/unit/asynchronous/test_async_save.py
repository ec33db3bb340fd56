"""Asynchronous saves in one process: snapshot semantics, the queue, failures, the byte budget.

The background writer is a spawned process; one queue (one worker) serves most tests, so the
worker's start-up is paid once.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Dict

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.asynchronous import snapshot as snapshot_module
from dist_ckpt.asynchronous.queue import AsyncCallsQueue, AsyncRequest
from dist_ckpt.asynchronous.snapshot import PROCESS_SNAPSHOTS, SnapshotPool, file_order_layout, snapshot_layout
from dist_ckpt.backends.safetensors import strategy as safetensors_strategy
from dist_ckpt.backends.safetensors.strategy import (
    SafetensorsSaveOptions,
    SafetensorsSaveShardedStrategy,
    deferred_starts,
)
from dist_ckpt.errors import AsyncSaveError, CheckpointingException, NotACheckpointError
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.storage import direct_io
from dist_ckpt.storage.direct_io import DIRECT_IO_ALIGN, accepts_direct_writes


def _state(seed: int = 0) -> Dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.randn(256, 64, generator=gen)),
        "b": ShardedTensor.from_rank_offsets("b", torch.randn(64, generator=gen).to(torch.bfloat16)),
        "i": ShardedTensor.from_rank_offsets("i", torch.randint(0, 1 << 40, (33,), generator=gen)),
        "flat0": ShardedTensor.from_rank_offsets_flat(
            "flat", torch.randn(7, generator=gen), (4, 5), flattened_range=slice(0, 7)
        ),
        "flat1": ShardedTensor.from_rank_offsets_flat(
            "flat", torch.randn(13, generator=gen), (4, 5), flattened_range=slice(7, 20)
        ),
        "empty": ShardedTensor.from_rank_offsets("empty", torch.empty(0, 3)),
        "step": 7,
    }


def _request(sd: Dict[str, object]) -> Dict[str, object]:
    out: Dict[str, object] = {}
    for k, v in sd.items():
        if isinstance(v, ShardedTensor):
            out[k] = (
                ShardedTensor.from_rank_offsets_flat(
                    v.key, torch.empty_like(v.data), v.local_shape, flattened_range=v.flattened_range
                )
                if v.flattened_range is not None
                else ShardedTensor.from_rank_offsets(v.key, torch.empty_like(v.data))
            )
    return out


def _values(sd: Dict[str, object]) -> Dict[str, torch.Tensor]:
    return {k: v.data.clone() for k, v in sd.items() if isinstance(v, ShardedTensor)}


def _assert_loads(path: Path, expected: Dict[str, torch.Tensor], sd: Dict[str, object]) -> None:
    loaded = dc.load(_request(sd), path)
    for key, value in expected.items():
        assert torch.equal(
            loaded[key].view(torch.uint8) if value.dtype == torch.bfloat16 else loaded[key],
            value.view(torch.uint8) if value.dtype == torch.bfloat16 else value,
        ), key


@pytest.fixture(scope="module")
def queue():
    q = AsyncCallsQueue()
    yield q
    q.close()


# --------------------------------------------------------------------------- pure helpers


def test_snapshot_layout_aligns_every_tensor():
    slots, total = snapshot_layout([10, 0, 70, 1])
    assert slots == [(0, 10), (64, 0), (64, 70), (192, 1)] and total == 193
    assert snapshot_layout([]) == ([], 0)


def test_file_order_layout_keeps_each_region_congruent_with_its_file():
    slots, total = file_order_layout([(100, [10, 20]), (8, [4]), (5000, []), (4096, [3])])
    assert slots == [(100, 10), (110, 20), (4104, 4), (8192, 3)] and total == 8195
    for (offset, _), file_offset in zip(slots, [100, 110, 8, 4096]):
        assert (offset - file_offset) % DIRECT_IO_ALIGN == 0
    assert file_order_layout([]) == ([], 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.complex64, torch.int64])
def test_snapshot_slots_no_dtype_view_fits_still_get_the_bytes(dtype):
    """In file order a tensor may start at an offset its dtype cannot be viewed at (after an odd
    number of int8 bytes): its bytes are copied as bytes."""
    pool = SnapshotPool()
    odd = torch.arange(3, dtype=torch.int8)
    value = (torch.arange(6) * 3 - 5).to(dtype).reshape(2, 3).t()  # not contiguous
    snap = pool.take([odd, value], in_use=lambda: False, layout=file_order_layout([(0, [3, 6 * value.element_size()])]))
    assert snap.slots[1][0] % value.element_size() != 0
    assert bytes(snap.view(1).numpy()) == bytes(value.contiguous().view(torch.uint8).numpy())


def test_a_snapshot_holds_the_values_of_every_kind_of_tensor_and_records_no_autograd():
    """Parameters that require grad, 0-d and empty tensors, non-contiguous views and bf16: the
    snapshot holds each one's values row-major, and nothing in it joins an autograd graph."""
    weight = torch.nn.Parameter(torch.arange(12.0).reshape(3, 4))
    tensors = [
        weight,
        weight.t(),  # not contiguous, and requires grad
        torch.tensor(7, dtype=torch.int64),
        torch.empty(0, 5),
        (torch.arange(9) - 4).to(torch.bfloat16).reshape(3, 3)[:, 1],
    ]
    snap = SnapshotPool().take(tensors, in_use=lambda: False)
    assert not snap.buffer.requires_grad and snap.buffer.grad_fn is None
    for i, t in enumerate(tensors):
        assert bytes(snap.view(i).numpy()) == bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    assert weight.grad is None and weight.requires_grad


def test_deferred_starts_takes_file_ends_within_the_budget():
    assert deferred_starts([[8, 4], [6, 2]], None) == [0, 0]
    assert deferred_starts([[8, 4], [6, 2]], 0) == [2, 2]
    assert deferred_starts([[8, 4], [6, 2]], 7) == [1, 1]
    assert deferred_starts([[8, 4], [6, 2]], 12) == [1, 0]  # 4 + 2 + 6: the 8 does not fit
    assert deferred_starts([[8, 4], [6, 2]], 20) == [0, 0]
    assert deferred_starts([[5], []], 4) == [1, 0]


def test_snapshot_pool_reuses_its_buffer_only_when_free():
    pool = SnapshotPool()
    busy = [True]
    a = pool.take([torch.arange(10.0)], in_use=lambda: busy[0])
    b = pool.take([torch.arange(5.0)], in_use=lambda: False)
    assert a.buffer.data_ptr() != b.buffer.data_ptr()  # a's buffer was in use
    assert torch.equal(a.view(0).view(torch.float32), torch.arange(10.0))  # and is intact
    c = pool.take([torch.ones(3)], in_use=lambda: False)
    assert c.buffer.data_ptr() == b.buffer.data_ptr() and c.buffer.is_shared()
    scalar = pool.take([torch.tensor(2.5, dtype=torch.float64)], in_use=lambda: False)
    assert scalar.view(0).view(torch.float64).item() == 2.5


def test_snapshots_in_a_reused_buffer_hold_each_take_s_values_whatever_the_tensors():
    """The pool keeps the views it copies through for the next take of the same tensors: a
    later take copies the new values, and tensors of other shapes or dtypes in the same bytes
    (or the same tensors in another layout) are laid out anew."""
    pool = SnapshotPool()
    pool.reserve(4096)  # room for every take below
    w = torch.arange(12.0).reshape(3, 4)
    first = pool.take([w, torch.ones(2)], in_use=lambda: False)
    w.add_(100.0)
    again = pool.take([w, torch.ones(2)], in_use=lambda: False)
    assert again.buffer.data_ptr() == first.buffer.data_ptr()
    assert torch.equal(again.view(0).view(torch.float32).view(3, 4), w)
    as_ints = w.to(torch.int32)  # the same slots, another dtype: copied as int32, not converted to float32
    ints = pool.take([as_ints, torch.ones(2)], in_use=lambda: False)
    assert ints.slots == again.slots
    assert bytes(ints.view(0).numpy()) == bytes(as_ints.reshape(-1).view(torch.uint8).numpy())
    other = [torch.arange(6, dtype=torch.float64).reshape(2, 3).t(), torch.arange(4, dtype=torch.int32)]
    reshaped = pool.take(other, in_use=lambda: False)
    assert reshaped.buffer.data_ptr() == first.buffer.data_ptr()
    for i, t in enumerate(other):
        assert bytes(reshaped.view(i).numpy()) == bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    moved = pool.take(other, in_use=lambda: False, layout=file_order_layout([(4, [48, 16])]))
    assert moved.slots[0][0] == 4
    for i, t in enumerate(other):
        assert bytes(moved.view(i).numpy()) == bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def test_a_take_outside_inference_mode_after_one_inside_it_and_back():
    """Views made under ``torch.inference_mode()`` are inference tensors, which cannot be written
    outside it: a save from an evaluation loop followed by one from training must not copy
    through the views the first one made (and the other way round)."""
    pool = SnapshotPool()
    w = torch.arange(6.0).reshape(2, 3)
    with torch.inference_mode():
        pool.take([w], in_use=lambda: False)
    w.add_(1.0)
    snap = pool.take([w], in_use=lambda: False)
    assert torch.equal(snap.view(0).view(torch.float32).view(2, 3), w)
    w.add_(1.0)
    with torch.inference_mode():
        again = pool.take([w], in_use=lambda: False)
    assert torch.equal(again.view(0).view(torch.float32).view(2, 3), w)


def test_a_second_take_of_the_same_tensors_makes_no_new_views(monkeypatch):
    """The point of keeping the views: a training job's next save copies through them."""
    pool = SnapshotPool()
    tensors = [torch.arange(10.0), torch.ones(2, 3, dtype=torch.bfloat16)]
    pool.take(tensors, in_use=lambda: False)
    made = []
    monkeypatch.setattr(snapshot_module, "_target", lambda *a: made.append(a) or torch.empty(0))
    snap = pool.take(tensors, in_use=lambda: False)
    assert made == []
    assert bytes(snap.view(1).numpy()) == bytes(tensors[1].reshape(-1).view(torch.uint8).numpy())


def _mappings() -> list:
    """``(low, high, path)`` of each file mapping of this process."""
    with open("/proc/self/maps") as maps:
        fields = [line.split(maxsplit=5) for line in maps]
    return [(*(int(x, 16) for x in f[0].split("-")), f[5].strip()) for f in fields if len(f) == 6]


def _mapping_of(address: int) -> str:
    for low, high, path in _mappings():
        if low <= address < high:
            return path
    raise AssertionError(f"no mapping holds address {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")
def test_release_unmaps_the_buffer_after_takes_that_kept_their_views():
    """What the pool keeps for the next take does not keep a released buffer's memory."""
    pool = SnapshotPool()
    tensors = [torch.arange(4096.0), torch.ones(7, 3)]
    snap = pool.take(tensors, in_use=lambda: False)
    pool.take(tensors, in_use=lambda: False)
    shared_file = _mapping_of(snap.buffer.data_ptr())
    del snap
    pool.release()
    gc.collect()
    assert shared_file not in {path for _, _, path in _mappings()}


# --------------------------------------------------------------------------- the request and the queue


def test_values_at_the_time_of_the_call(tmp_path, queue):
    """Training changes every tensor right after async save returns; the checkpoint holds the
    values the tensors had when save was called."""
    sd = _state()
    expected = _values(sd)
    request = dc.save(sd, tmp_path / "c", async_sharded_save=True)
    idx = queue.schedule_async_request(request)
    for v in sd.values():
        if isinstance(v, ShardedTensor):
            v.data.add_(1)
    assert not (tmp_path / "c" / "metadata.json").exists()  # committed at finalization only
    assert queue.maybe_finalize_async_calls(blocking=True) == [idx]
    assert (tmp_path / "c" / "metadata.json").exists()
    _assert_loads(tmp_path / "c", expected, _state())
    assert dc.verify_checkpoint(tmp_path / "c").ok


def test_non_blocking_finalize_waits_for_the_write(tmp_path, queue):
    sd = _state(1)
    expected = _values(sd)
    idx = queue.schedule_async_request(dc.save(sd, tmp_path / "c", async_sharded_save=True))
    finished = []
    while not finished:
        finished = queue.maybe_finalize_async_calls(blocking=False)
    assert finished == [idx] and queue.get_num_unfinalized_calls() == 0
    _assert_loads(tmp_path / "c", expected, sd)


def test_requests_finalize_in_order(tmp_path, queue):
    order = []
    requests = []
    for i in range(3):
        request = dc.save(_state(i), tmp_path / f"c{i}", async_sharded_save=True)
        request.add_finalize_fn(lambda i=i: order.append(i))
        requests.append(queue.schedule_async_request(request))
    assert queue.get_num_unfinalized_calls() == 3
    assert queue.maybe_finalize_async_calls(blocking=True) == requests
    assert order == [0, 1, 2]
    for i in range(3):
        _assert_loads(tmp_path / f"c{i}", _values(_state(i)), _state(i))


def test_frozen_request_takes_no_more_finalize_fns():
    request = AsyncRequest(None, ()).freeze()
    with pytest.raises(CheckpointingException, match="frozen"):
        request.add_finalize_fn(lambda: None)


def test_execute_sync_runs_the_same_request(tmp_path):
    sd = _state(2)
    expected = _values(sd)
    request = dc.save(sd, tmp_path / "c", async_sharded_save=True)
    request.execute_sync()
    _assert_loads(tmp_path / "c", expected, sd)


def test_worker_failure_surfaces_at_finalize_and_nothing_is_committed(tmp_path, queue):
    request = dc.save(_state(), tmp_path / "c", async_sharded_save=True)
    # the files' directory replaced by a file: whatever the save still had to write (files to
    # create, bytes to write from the training process or the worker, fsyncs) fails
    shutil.rmtree(tmp_path / "c" / "safetensors")
    (tmp_path / "c" / "safetensors").write_text("in the way")
    queue.schedule_async_request(request)
    with pytest.raises(AsyncSaveError) as info:
        queue.maybe_finalize_async_calls(blocking=True)
    assert "[rank 0]" in str(info.value)
    assert "NotADirectoryError" in str(info.value) or "FileNotFoundError" in str(info.value)
    assert not (tmp_path / "c" / "metadata.json").exists()
    with pytest.raises(NotACheckpointError):
        dc.load(_request(_state()), tmp_path / "c")
    assert queue.get_num_unfinalized_calls() == 0
    # the queue keeps working after a failed request
    queue.schedule_async_request(dc.save(_state(3), tmp_path / "d", async_sharded_save=True))
    queue.maybe_finalize_async_calls(blocking=True)
    _assert_loads(tmp_path / "d", _values(_state(3)), _state(3))


def test_killed_worker_fails_the_request_and_is_replaced(tmp_path):
    queue = AsyncCallsQueue()
    try:
        request = dc.save(_state(), tmp_path / "c", async_sharded_save=True)
        queue.schedule_async_request(request)
        os.kill(queue._worker.pid, signal.SIGKILL)  # type: ignore[union-attr]
        with pytest.raises(AsyncSaveError, match="killed by signal 9"):
            queue.maybe_finalize_async_calls(blocking=True)
        assert not (tmp_path / "c" / "metadata.json").exists()
        queue.schedule_async_request(dc.save(_state(4), tmp_path / "d", async_sharded_save=True))
        queue.maybe_finalize_async_calls(blocking=True)
        _assert_loads(tmp_path / "d", _values(_state(4)), _state(4))
    finally:
        queue.close()


def test_unpicklable_work_is_refused_when_scheduled(queue):
    with pytest.raises(AsyncSaveError, match="cannot be sent"):
        queue.schedule_async_request(AsyncRequest(lambda: None, ()))
    assert queue.get_num_unfinalized_calls() == 0


def test_close_with_abort_commits_nothing(tmp_path):
    queue = AsyncCallsQueue(persistent=False)
    queue.schedule_async_request(dc.save(_state(), tmp_path / "c", async_sharded_save=True))
    queue.close(abort=True)
    assert not (tmp_path / "c" / "metadata.json").exists()
    assert queue.get_num_unfinalized_calls() == 0


def test_non_persistent_queue_uses_a_process_per_request(tmp_path):
    queue = AsyncCallsQueue(persistent=False)
    try:
        queue.schedule_async_request(dc.save(_state(5), tmp_path / "c", async_sharded_save=True))
        worker = queue._calls[0].worker
        assert queue.maybe_finalize_async_calls(blocking=True) == [0]
        assert worker.pid is None  # stopped once finalized
        _assert_loads(tmp_path / "c", _values(_state(5)), _state(5))
    finally:
        queue.close()


# --------------------------------------------------------------------------- the byte budget


@pytest.mark.parametrize("budget", [0, 3000, 20000, None])
def test_snapshot_budget_streams_the_rest(tmp_path, queue, budget, caplog):
    """With a budget the snapshot holds at most that many bytes; the rest is written before
    async_save returns; the checkpoint is the same."""
    strategy = SafetensorsSaveShardedStrategy(SafetensorsSaveOptions(snapshot_budget_bytes=budget, thread_count=2))
    sd = _state(6)
    expected = _values(sd)
    total = sum(t.numel() * t.element_size() for t in expected.values())
    request = dc.save(sd, tmp_path / "c", sharded_strategy=strategy, async_sharded_save=True)
    snapshot = request.async_fn_args[2]
    assert snapshot.nbytes <= (total if budget is None else budget)
    if budget is None:
        assert snapshot.nbytes == total
    files = list((tmp_path / "c" / "safetensors").glob("*.safetensors"))
    if budget == 0:  # everything was written before returning
        assert sum(f.stat().st_size for f in files) >= total
    for v in sd.values():
        if isinstance(v, ShardedTensor):
            v.data.zero_()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    _assert_loads(tmp_path / "c", expected, _state(6))
    assert dc.verify_checkpoint(tmp_path / "c").ok
    doc = json.loads((tmp_path / "c" / "safetensors" / "index.json").read_text())
    assert doc["version"] == 3 and "checksum" in doc and len(doc["files"]) == 2


@pytest.mark.parametrize("direct", [True, False], ids=["early-writes", "background-writes"])
def test_the_snapshot_goes_to_the_files_as_it_is_taken(tmp_path, queue, monkeypatch, direct):
    """Local files: the snapshot holds each file's bytes in file order; where the disk takes
    O_DIRECT writes the training process writes them as they are copied (early_writes), else the
    background process writes them all. The checkpoint is the same either way: bit-exact,
    checksums verified, also where a tensor follows an odd number of bytes (int8, bf16) and no
    view of its dtype fits its slot."""
    gen = torch.Generator().manual_seed(3)
    sd = {
        "a": ShardedTensor.from_rank_offsets("a", torch.randint(-100, 100, (7,), generator=gen).to(torch.int8)),
        "b": ShardedTensor.from_rank_offsets("b", torch.randn(5, generator=gen).to(torch.bfloat16)),
        "c": ShardedTensor.from_rank_offsets("c", torch.randn(3001, generator=gen)),
        "d": ShardedTensor.from_rank_offsets("d", torch.randn(129, 65, generator=gen).double()),
        "e": ShardedTensor.from_rank_offsets("e", torch.randn(999, generator=gen).to(torch.bfloat16)),
    }
    expected = _values(sd)
    written = []
    real = direct_io.write_at

    def counting(*args):
        written.append(real(*args))
        return written[-1]

    monkeypatch.setattr(direct_io, "write_at", counting)
    early = direct and accepts_direct_writes(tmp_path)
    if not direct:
        monkeypatch.setattr(safetensors_strategy, "accepts_direct_writes", lambda directory: False)
    strategy = SafetensorsSaveShardedStrategy(SafetensorsSaveOptions(thread_count=1))
    request = dc.save(sd, tmp_path / "c", sharded_strategy=strategy, async_sharded_save=True)
    snapshot = request.async_fn_args[2]
    slots = snapshot.slots  # one file: its bytes back to back, as in the file
    assert all(offset + n == after for (offset, n), (after, _) in zip(slots, slots[1:]))
    assert (request.async_fn_args[5] is not None) == early
    for v in sd.values():
        v.data.zero_()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    if early:  # by this process, from the snapshot's memory, most of it past the page cache
        assert len(written) == 1 and written[0] > 0
    else:
        assert written == []
    loaded = dc.load(_request(sd), tmp_path / "c")
    for key, value in expected.items():
        assert bytes(loaded[key].view(torch.uint8).numpy()) == bytes(value.view(torch.uint8).numpy()), key
    assert dc.verify_checkpoint(tmp_path / "c").ok


def test_snapshot_buffer_is_reused_across_saves(tmp_path, queue):
    strategy = SafetensorsSaveShardedStrategy()
    pointers = []
    for i in range(3):
        request = dc.save(_state(i), tmp_path / f"c{i}", sharded_strategy=strategy, async_sharded_save=True)
        pointers.append(request.async_fn_args[2].buffer.data_ptr())
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    assert pointers[0] == pointers[1] == pointers[2]


def test_a_new_strategy_object_reuses_the_process_snapshot_buffer(tmp_path, queue):
    """``save(..., async_sharded_save=True)`` without a strategy (a new strategy object each
    time, as Megatron-Core's training loop does) reuses the previous save's buffer."""
    buffers = []  # kept alive: a fresh buffer could not land at the same address
    for i in range(3):
        strategy = None if i < 2 else SafetensorsSaveShardedStrategy()
        request = dc.save(_state(i), tmp_path / f"c{i}", sharded_strategy=strategy, async_sharded_save=True)
        buffers.append(request.async_fn_args[2].buffer)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        _assert_loads(tmp_path / f"c{i}", _values(_state(i)), _state(i))
    assert buffers[0].data_ptr() == buffers[1].data_ptr() == buffers[2].data_ptr()
    assert PROCESS_SNAPSHOTS.nbytes > 0
    PROCESS_SNAPSHOTS.release()
    assert PROCESS_SNAPSHOTS.nbytes == 0


def test_reserved_snapshot_buffer_serves_the_first_save(tmp_path, queue):
    PROCESS_SNAPSHOTS.release()  # the buffer of an earlier test would serve this one
    strategy = SafetensorsSaveShardedStrategy()
    sd = _state(7)
    nbytes = strategy.reserve_snapshot(sd)
    assert nbytes >= sum(t.numel() * t.element_size() for t in _values(sd).values())
    (reserved,) = strategy._snapshots.buffers
    assert reserved is not None and reserved.numel() == nbytes and reserved.is_shared()
    request = dc.save(sd, tmp_path / "c", sharded_strategy=strategy, async_sharded_save=True)
    assert request.async_fn_args[2].buffer.data_ptr() == reserved.data_ptr()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    _assert_loads(tmp_path / "c", _values(_state(7)), _state(7))


def test_async_needs_an_async_capable_strategy(tmp_path):
    with pytest.raises(CheckpointingException, match="AsyncSaveShardedStrategy"):
        dc.save(_state(), tmp_path / "c", sharded_strategy=("zarr", 1), async_sharded_save=True)
