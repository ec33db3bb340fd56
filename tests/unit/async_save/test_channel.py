"""The writer's channel: pickles over a Unix socket, shared-memory tensors passed as descriptors."""

from __future__ import annotations

import os
import pickle
import socket

import torch

from dist_ckpt.async_save.channel import FrameReader, decode, encode, recv_frame, send_frame
from dist_ckpt.async_save.snapshot import SnapshotPool


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
