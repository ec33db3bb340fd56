"""Messages between a training process and its async writer process, over a Unix socket.

A message is a pickle. Tensors in shared memory (an async save's snapshot, see
`dist_ckpt.asynchronous.snapshot`) are not copied into it: each distinct shared storage is
passed as a file descriptor beside the bytes (``SCM_RIGHTS``), and the receiver maps the same
memory. So is a `PassedFd` (e.g. the read end of a pipe): the receiver gets its own descriptor
of the same file. Every other object is pickled as usual.

A frame on the socket is a header (payload length, number of descriptors; the descriptors ride
on the header's bytes) followed by the payload.

Example:

```python
payload, fds = encode((fn, args, kwargs))        # in the caller: errors raise here
send_frame(sock, payload, fds)
...
payload, fds = recv_frame(sock)                  # in the writer
fn, args, kwargs = decode(payload, fds)
```
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import select
import socket
import struct
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["FrameReader", "PassedFd", "decode", "encode", "readable", "recv_frame", "send_frame"]

#: payload bytes, number of file descriptors
_HEADER = struct.Struct("!QI")
#: the most descriptors one frame carries (Linux's SCM_MAX_FD)
MAX_FDS = 253
#: persistent-id tag of a tensor whose storage travels as a descriptor
_SHARED_TENSOR = "dist_ckpt.shared_tensor"
#: persistent-id tag of a `PassedFd`
_PASSED_FD = "dist_ckpt.passed_fd"


class PassedFd:
    """A file descriptor that travels with a message: the receiver gets a descriptor of its own
    for the same open file. Each side's descriptor is closed by `close()` or once its
    ``PassedFd`` is collected.

    Example:

    ```python
    read_end, write_end = os.pipe()
    payload, fds = encode((fn, (PassedFd(read_end),), {}))
    ```
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._closer = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        """Close the descriptor now (once; later calls do nothing)."""
        self._closer()

    def __reduce__(self) -> Any:
        raise TypeError("a PassedFd travels only through dist_ckpt.asynchronous.channel, not a plain pickle")


class _Pickler(pickle.Pickler):
    """Pickles CPU tensors in shared memory as a reference to a descriptor of their storage."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.fds: List[int] = []
        self._slots: Dict[int, Tuple[int, int]] = {}  # storage address -> (index in fds, bytes)

    def persistent_id(self, obj: Any) -> Optional[Tuple[Any, ...]]:
        if isinstance(obj, PassedFd):
            if len(self.fds) >= MAX_FDS:
                raise pickle.PicklingError(f"a message can carry at most {MAX_FDS} file descriptors")
            self.fds.append(obj.fd)
            return (_PASSED_FD, len(self.fds) - 1)
        if type(obj) is not torch.Tensor or obj.device.type != "cpu" or obj.requires_grad:
            return None
        storage = obj.untyped_storage()
        if storage.nbytes() == 0 or not storage.is_shared():
            return None
        slot = self._slots.get(storage.data_ptr())
        if slot is None:
            try:
                fd, size = storage._share_fd_cpu_()
            except (AttributeError, RuntimeError):  # shared by file name (torch's "file_system" strategy)
                return None  # pickled by value: slower, still correct
            if len(self.fds) >= MAX_FDS:
                return None
            slot = (len(self.fds), int(size))
            self.fds.append(int(fd))
            self._slots[storage.data_ptr()] = slot
        return (_SHARED_TENSOR, slot[0], slot[1], obj.dtype, obj.storage_offset(), tuple(obj.shape), obj.stride())


class _Unpickler(pickle.Unpickler):
    """Maps the storages of shared tensors from the descriptors received with the frame."""

    def __init__(self, file: io.BytesIO, fds: Sequence[int]) -> None:
        super().__init__(file)
        self._fds = fds
        self._storages: Dict[int, torch.UntypedStorage] = {}

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 2 and pid[0] == _PASSED_FD:
            return PassedFd(os.dup(self._fds[pid[1]]))
        if not isinstance(pid, tuple) or not pid or pid[0] != _SHARED_TENSOR:
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        _, slot, size, dtype, offset, shape, stride = pid
        storage = self._storages.get(slot)
        if storage is None:
            storage = map_shared(self._fds[slot], size)
            self._storages[slot] = storage
        return torch.empty((0,), dtype=dtype).set_(storage, offset, shape, stride)


def map_shared(fd: int, size: int) -> torch.UntypedStorage:
    """The ``size`` bytes of shared memory behind ``fd`` (a duplicate is kept; the caller closes
    ``fd``), mapped with every page present.

    Why not ``torch.UntypedStorage._new_shared_fd_cpu``: it maps lazily, and the writer then takes
    a page fault for every few pages it writes out (on the 2-core test VM 12,000 faults and about
    0.25 s of CPU for a 768 MiB snapshot, a quarter of the write's CPU); ``MAP_POPULATE`` maps
    the pages in one pass of the kernel (0.03 s).
    """
    if size == 0:
        return torch.empty(0, dtype=torch.uint8).untyped_storage()
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mapped = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapped, dtype=torch.uint8).untyped_storage()


def encode(obj: Any) -> Tuple[bytes, List[int]]:
    """``obj`` pickled, and the descriptors of the shared storages it refers to (still owned by
    those storages: keep ``obj`` alive until the frame is sent)."""
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(obj)
    return buf.getvalue(), pickler.fds


def decode(payload: bytes, fds: Sequence[int] = ()) -> Any:
    """The object `encode()` pickled, its shared tensors mapped from ``fds`` (which the
    caller closes afterwards)."""
    return _Unpickler(io.BytesIO(payload), fds).load()


def send_frame(sock: socket.socket, payload: bytes, fds: Sequence[int] = ()) -> None:
    """Send one frame (blocking, within the socket's timeout)."""
    header = _HEADER.pack(len(payload), len(fds))
    if fds:
        sent = socket.send_fds(sock, [header], list(fds))
        if sent < len(header):
            sock.sendall(header[sent:])
    else:
        sock.sendall(header)
    sock.sendall(payload)


def readable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether ``sock`` has data (or EOF) to read, waiting up to ``timeout_s`` seconds.

    ``poll``, not ``select``: a training process may hold more than 1024 descriptors.
    """
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(max(0, int(timeout_s * 1000))))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("the other end closed the socket in the middle of a message")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> Tuple[bytes, List[int]]:
    """Receive one frame (blocking): its payload and the descriptors that came with it.

    Raises:
        EOFError: the other end closed the socket.
    """
    data, fds, flags, _ = socket.recv_fds(sock, _HEADER.size, MAX_FDS)
    if not data:
        raise EOFError("the other end closed the socket")
    if flags & getattr(socket, "MSG_CTRUNC", 0):
        raise OSError("file descriptors of a message were truncated")
    header = data + _recv_exactly(sock, _HEADER.size - len(data))
    length, count = _HEADER.unpack(header)
    if count != len(fds):
        raise OSError(f"a message announced {count} file descriptors but {len(fds)} arrived")
    return _recv_exactly(sock, length), list(fds)


class FrameReader:
    """Splits bytes read from a socket, as they come, into frames that carry no descriptors
    (what the writer sends back: statuses and results).

    Example:

    ```python
    reader = FrameReader()
    for payload in reader.feed(sock.recv(65536)):
        message = pickle.loads(payload)
    ```
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> List[bytes]:
        """Add ``data``; return the payloads of the frames now complete."""
        self._buf += data
        out = []
        while len(self._buf) >= _HEADER.size:
            length, count = _HEADER.unpack_from(self._buf)
            if count:
                raise OSError("the async writer sent file descriptors, which it never does")
            if len(self._buf) < _HEADER.size + length:
                break
            out.append(bytes(self._buf[_HEADER.size : _HEADER.size + length]))
            del self._buf[: _HEADER.size + length]
        return out
