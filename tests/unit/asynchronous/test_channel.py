"""The writer's channel: pickles over a Unix socket, shared-memory tensors passed as descriptors."""

from __future__ import annotations

import gc
import os
import pickle
import resource
import socket
import sys

import pytest
import torch

from dist_ckpt.asynchronous.channel import FrameReader, PassedFd, decode, encode, map_shared, recv_frame, send_frame
from dist_ckpt.asynchronous.snapshot import SnapshotPool


def _roundtrip(obj: object) -> object:
    a, b = socket.socketpair()
    with a, b:
        payload, fds = encode(obj)
        send_frame(a, payload, fds)
        received, got = recv_frame(b)
        try:
            return decode(received, got)
        finally:
            for fd in got:
                os.close(fd)


def test_shared_tensors_travel_as_descriptors_of_the_same_memory() -> None:
    snap = SnapshotPool().take([torch.arange(10.0), torch.arange(6).reshape(2, 3)], in_use=lambda: True)
    view = snap.buffer[64:112].view(torch.int64).view(2, 3).t()  # a strided view of the same storage
    payload, fds = encode((snap, view))
    assert len(fds) == 1  # one storage, one descriptor, however many tensors use it
    assert len(payload) < 1000  # no data in the pickle
    snap2, view2 = _roundtrip((snap, view))  # type: ignore[misc]
    assert torch.equal(snap2.view(0).view(torch.float32), torch.arange(10.0))
    assert torch.equal(view2, torch.arange(6).reshape(2, 3).t())
    snap2.buffer[0] = 7  # the same memory, not a copy
    assert int(snap.buffer[0]) == 7


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MAP_POPULATE is Linux's")
def test_received_snapshots_are_mapped_with_every_page_present() -> None:
    """The writer reads every byte of a snapshot: mapped lazily it took a page fault every few
    pages (12,000 faults, a quarter of the write's CPU for 768 MiB); mapped populated, none."""
    nbytes = 64 << 20
    snap = SnapshotPool().take([torch.ones(nbytes // 4)], in_use=lambda: True)
    (received,) = _roundtrip((snap,))  # type: ignore[misc]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    total = int(received.buffer[::4096].sum())  # one byte of every page
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert total == (nbytes // 4096) * int(torch.ones(1).view(torch.uint8)[0])
    assert faults < 64, f"{faults} page faults reading a populated mapping of {nbytes >> 20} MiB"


def test_a_mapping_outlives_the_objects_that_made_it() -> None:
    snap = SnapshotPool().take([torch.arange(1000.0)], in_use=lambda: True)
    _, fds = encode((snap,))
    storage = map_shared(fds[0], snap.buffer.untyped_storage().nbytes())
    tensor = torch.empty(0, dtype=torch.uint8).set_(storage)[:4000].view(torch.float32)
    del storage
    gc.collect()
    assert torch.equal(tensor, torch.arange(1000.0))  # still mapped: the tensor holds the mapping


def test_other_objects_are_pickled_by_value() -> None:
    plain = torch.arange(4.0)
    obj = {"t": plain, "s": "x", "n": [1, 2]}
    payload, fds = encode(obj)
    assert fds == []
    out = _roundtrip(obj)
    assert out["s"] == "x" and out["n"] == [1, 2] and torch.equal(out["t"], plain)  # type: ignore[index]


def test_frame_reader_splits_frames_as_they_come() -> None:
    a, b = socket.socketpair()
    with a, b:
        for message in ("first", {"second": 2}):
            send_frame(a, pickle.dumps(message))
        data = b.recv(1 << 16)
    reader = FrameReader()
    frames = reader.feed(data[:5]) + reader.feed(data[5:-1])
    assert [pickle.loads(f) for f in frames] == ["first"]
    assert [pickle.loads(f) for f in reader.feed(data[-1:])] == [{"second": 2}]


def test_a_passed_descriptor_reaches_the_same_pipe() -> None:
    read_end, write_end = os.pipe()
    sent = PassedFd(read_end)
    (received,) = _roundtrip((sent,))  # type: ignore[misc]
    assert isinstance(received, PassedFd) and received.fd != read_end
    os.write(write_end, b"ok")
    os.close(write_end)
    assert os.read(received.fd, 10) == b"ok"
    received.close()
    received.close()  # once only
    sent.close()
    with pytest.raises(OSError):
        os.fstat(read_end)


def test_a_passed_descriptor_is_closed_with_its_object_and_never_plainly_pickled() -> None:
    read_end, write_end = os.pipe()
    os.close(write_end)
    passed = PassedFd(read_end)
    with pytest.raises(TypeError, match="channel"):
        pickle.dumps(passed)
    del passed
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(read_end)
