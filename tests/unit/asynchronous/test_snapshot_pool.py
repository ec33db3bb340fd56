"""SnapshotPool: spaced saves reuse one buffer, saves back to back alternate between two, and a
reservation made in the background serves the first snapshot (counts of buffers allocated)."""

from __future__ import annotations

import threading
from typing import Iterator, List

import pytest
import torch

from dist_ckpt.asynchronous import snapshot as snapshot_module
from dist_ckpt.asynchronous.snapshot import MAX_KEPT_BUFFERS, SnapshotPool


@pytest.fixture
def allocations(monkeypatch: pytest.MonkeyPatch) -> Iterator[List[int]]:
    """The sizes of the shared-memory buffers allocated during the test."""
    sizes: List[int] = []
    real = snapshot_module._shared_bytes

    def counting(nbytes: int) -> torch.Tensor:
        sizes.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(snapshot_module, "_shared_bytes", counting)
    yield sizes


class _Save:
    """A save's hold on its snapshot: in use until its write is done."""

    def __init__(self) -> None:
        self.writing = True

    def in_use(self) -> bool:
        return self.writing


def test_spaced_saves_use_one_buffer(allocations: List[int]) -> None:
    pool = SnapshotPool()
    t = torch.arange(64.0)
    for _ in range(4):
        save = _Save()
        snap = pool.take([t], in_use=save.in_use)
        assert torch.equal(snap.view(0).view(torch.float32), t)
        save.writing = False  # written before the next save
    assert allocations == [256] and len(pool.buffers) == 1


def test_saves_back_to_back_alternate_between_two_buffers(allocations: List[int]) -> None:
    """Each save is scheduled while the previous one still writes (the one before it is done)."""
    pool = SnapshotPool()
    previous = None
    pointers = []
    for i in range(6):
        save = _Save()
        t = torch.full((64,), float(i))
        snap = pool.take([t], in_use=save.in_use)
        assert torch.equal(snap.view(0).view(torch.float32), t)
        pointers.append(snap.buffer.data_ptr())
        if previous is not None:
            previous.writing = False  # done by the time the save after this one comes
        previous = save
    assert len(allocations) == MAX_KEPT_BUFFERS == 2
    assert pointers[0::2] == [pointers[0]] * 3 and pointers[1::2] == [pointers[1]] * 3
    assert pointers[0] != pointers[1]


def test_a_third_overlapping_save_gets_a_buffer_of_its_own_and_the_pool_keeps_two(allocations: List[int]) -> None:
    pool = SnapshotPool()
    t = torch.arange(16.0)
    saves = [_Save() for _ in range(3)]
    snaps = [pool.take([t], in_use=s.in_use) for s in saves]
    assert len(allocations) == 3 and len({s.buffer.data_ptr() for s in snaps}) == 3
    assert len(pool.buffers) == 2  # the least recently used lives on with its save only
    assert pool.buffers[0].data_ptr() == snaps[1].buffer.data_ptr()
    assert torch.equal(snaps[0].view(0).view(torch.float32), t)  # still readable by its save


def test_a_free_buffer_too_small_is_replaced_not_kept_beside_the_new_one(allocations: List[int]) -> None:
    pool = SnapshotPool()
    pool.take([torch.arange(10.0)], in_use=lambda: False)
    pool.take([torch.arange(100.0)], in_use=lambda: False)
    assert allocations == [40, 400] and pool.nbytes == 400


def test_a_background_reservation_serves_the_first_snapshot(
    allocations: List[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    real = snapshot_module._shared_bytes

    def slow(nbytes: int) -> torch.Tensor:
        release.wait()  # the reservation is still faulting in its pages
        return real(nbytes)

    monkeypatch.setattr(snapshot_module, "_shared_bytes", slow)  # still counted: real is the counting one
    pool = SnapshotPool()
    pool.reserve(1 << 20, background=True)  # returns at once
    t = torch.arange(1000.0)
    taken: List[torch.Tensor] = []
    taker = threading.Thread(target=lambda: taken.append(pool.take([t], in_use=lambda: False).buffer))
    taker.start()
    release.set()
    taker.join()
    pool.wait_reserved()
    assert allocations == [1 << 20]  # the snapshot waited for the reserved buffer, and used it
    assert taken[0].data_ptr() == pool.buffers[0].data_ptr()
    pool.release()
    assert pool.nbytes == 0


def test_a_reservation_that_fails_in_the_background_leaves_the_pool_usable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = snapshot_module._shared_bytes
    calls: List[int] = []

    def failing_once(nbytes: int) -> torch.Tensor:
        calls.append(nbytes)
        if len(calls) == 1:
            raise OSError(12, "Cannot allocate memory")
        return real(nbytes)

    monkeypatch.setattr(snapshot_module, "_shared_bytes", failing_once)
    pool = SnapshotPool()
    pool.reserve(1 << 30, background=True)
    pool.wait_reserved()
    assert "could not reserve" in caplog.text
    t = torch.arange(8.0)
    assert torch.equal(pool.take([t], in_use=lambda: False).view(0).view(torch.float32), t)


def test_max_buffers_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least one buffer"):
        SnapshotPool(max_buffers=0)
