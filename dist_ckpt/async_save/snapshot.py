"""Snapshots of tensors in shared memory, for saves that write from another process.

An asynchronous save must hold the values the tensors had when it was called, while training
goes on changing them. `SnapshotPool.take()` copies the tensors' bytes (device-to-host for
GPU tensors, a memory copy for CPU ones) into one buffer in shared memory; the background
writer process maps the same buffer (`channel` passes it as a file descriptor,
never as a pickled copy of the data) and writes the files from it.

Touching fresh shared memory costs page faults (on the 2-core test VM a first copy into it ran
at about a third of the speed of a copy into memory already touched), so the pool keeps its
buffer for the next save, once the previous save's writer is done with it. The save strategies
share one pool per process (`PROCESS_SNAPSHOTS`): a save with a new strategy object -- as
``save(..., async_sharded_save=True)`` with the default strategy, or Megatron-Core's training
loop creating its strategy at every save, do -- reuses the buffer of the previous save instead
of faulting in a fresh one (on the test VM that took an async save's blocking time at 0.5 GB per
rank from about 1 s to about the time of a memory copy). Memory bound: the process keeps one
buffer, at most the size of the largest snapshot taken (or reserved) since it was last released
([`release()`][dist_ckpt.async_save.snapshot.SnapshotPool.release]) -- a snapshot that finds the
kept buffer too small or still in use gets a new one of its own size, which becomes the kept
one -- plus the buffers of saves still writing when a new one starts (the writer process lets
go of a save's buffer within a second of finishing it).

Snapshots of CUDA tensors page-lock the kept buffer for CUDA once (``cudaHostRegister``), so
that the device-to-host copies run at the link's speed: on an H200 a copy of 4 GiB took 0.079 s
into pinned memory and 0.274 s into pageable memory. The buffer is unlocked when the pool lets go
of it.

Example:

```python
pool = SnapshotPool()
snap = pool.take([w, b], in_use=lambda: not outcome.done)
w.add_(1.0)                                  # the snapshot keeps the old values
old_w_bytes = snap.view(0)                   # uint8 view of the copy of w
```
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from dist_ckpt.model.dtypes import align_up
from dist_ckpt.storage.direct_io import DIRECT_IO_ALIGN

__all__ = ["PROCESS_SNAPSHOTS", "Snapshot", "SnapshotPool", "file_order_layout", "snapshot_layout"]

logger = logging.getLogger(__name__)


def snapshot_layout(nbytes: Sequence[int]) -> Tuple[List[Tuple[int, int]], int]:
    """``([(offset, nbytes), ...], total)``: where each tensor's bytes go in a snapshot buffer.

    Example:

    ```python
    snapshot_layout([10, 0, 70])   # ([(0, 10), (64, 0), (64, 70)], 134)
    ```
    """
    slots = []
    offset = 0
    for n in nbytes:
        slots.append((offset, n))
        offset = align_up(offset + n)
    total = slots[-1][0] + slots[-1][1] if slots else 0
    return slots, total


def file_order_layout(regions: Sequence[Tuple[int, Sequence[int]]]) -> Tuple[List[Tuple[int, int]], int]:
    """``([(offset, nbytes), ...], total)`` for tensors that are written as byte ranges of files:
    each region ``(file_offset, [nbytes, ...])`` holds the tensors of one range back to back, as
    in the file, starting at a buffer offset congruent to ``file_offset`` modulo
    `DIRECT_IO_ALIGN`, so that the region can go to the file with ``O_DIRECT``
    (`dist_ckpt.storage.direct_io`). Costs less than `DIRECT_IO_ALIGN` bytes of padding per region.

    Example:

    ```python
    file_order_layout([(100, [10, 20]), (8, [4])])   # ([(100, 10), (110, 20), (4104, 4)], 4108)
    ```
    """
    slots = []
    end = 0
    for file_offset, sizes in regions:
        offset = end + (file_offset - end) % DIRECT_IO_ALIGN
        for n in sizes:
            slots.append((offset, n))
            offset += n
        end = offset if sizes else end
    return slots, end


@dataclass(frozen=True)
class Snapshot:
    """Copies of tensors' bytes in one shared-memory buffer.

    Attributes:
        buffer: a uint8 CPU tensor in shared memory (possibly larger than needed).
        slots: ``(offset, nbytes)`` of each tensor's bytes in ``buffer``, in the order taken.
    """

    buffer: torch.Tensor
    slots: Tuple[Tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        """Bytes held (the sum of the slots)."""
        return sum(n for _, n in self.slots)

    def view(self, i: int) -> torch.Tensor:
        """The bytes of tensor ``i`` (a uint8 view of the buffer, no copy)."""
        offset, n = self.slots[i]
        return self.buffer[offset : offset + n]


def _shared_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` in shared memory, allocated there directly
    (``Tensor.share_memory_`` would allocate private memory first and copy it over), backed by a
    file descriptor whatever torch's sharing strategy, so that it reaches the writer uncopied."""
    new_shared = getattr(torch.UntypedStorage, "_new_using_fd_cpu", None) or getattr(
        torch.UntypedStorage, "_new_shared", None
    )
    if new_shared is None:  # an older or newer torch without it: the public, slower way
        shared: torch.Tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
        return shared
    storage = new_shared(max(nbytes, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _from_cuda(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a snapshot of ``tensors`` copies from a CUDA device."""
    return any(t.is_cuda for t in tensors)


def _page_lock(buffer: torch.Tensor) -> bool:
    """Register ``buffer`` with CUDA as page-locked host memory (``cudaHostRegister``, portable),
    so that device-to-host copies into it run at the link's speed: on an H200 a copy of 4 GiB took
    0.079 s into pinned memory and 0.274 s into pageable memory. False, logged, where CUDA refuses
    (the snapshot is then taken into pageable memory)."""
    code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), max(buffer.numel(), 1), 1))  # type: ignore[no-untyped-call]
    if code != 0:
        logger.warning("could not page-lock the %d-byte snapshot buffer (CUDA error %d)", buffer.numel(), code)
        return False
    return True


def _page_unlock(buffer: torch.Tensor) -> None:
    """Undo `_page_lock()` (before the buffer's memory can be freed)."""
    code = int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))  # type: ignore[no-untyped-call]
    if code != 0:
        logger.warning("could not unlock the snapshot buffer (CUDA error %d)", code)


def _target(buffer: torch.Tensor, offset: int, nbytes: int, tensor: torch.Tensor) -> torch.Tensor:
    """Where ``tensor``'s values go in ``buffer``: a view of its dtype and shape over the slot,
    or the slot's bytes where no view of the dtype fits (a file-order slot at an offset that is
    not a multiple of the dtype's size)."""
    slot = buffer[offset : offset + nbytes]
    if offset % tensor.element_size():
        return slot
    return slot.view(tensor.dtype).view(tensor.shape) if tensor.dim() else slot.view(tensor.dtype)[0]


def _copy_into(target: torch.Tensor, tensor: torch.Tensor) -> None:
    """Copy ``tensor``'s values, row-major, into ``target`` (from `_target()`)."""
    if tensor.numel() == 0:
        return
    if target.dtype != tensor.dtype:  # the slot's bytes: made contiguous where they are (on a GPU, there)
        target.copy_(tensor.detach().reshape(-1).contiguous().view(torch.uint8))
        return
    target.copy_(tensor.detach())  # from any device and any strides; waits for a GPU copy


class SnapshotPool:
    """Takes snapshots into a shared-memory buffer that it reuses once no save is using it.

    The save strategies of a process share one (`PROCESS_SNAPSHOTS`); snapshots of overlapping
    saves (a save scheduled before the previous one finished writing) get buffers of their own.
    """

    def __init__(self) -> None:
        self._buffer: Optional[torch.Tensor] = None
        self._in_use: Callable[[], bool] = lambda: False
        #: the key and views of the last take (`_targets_for()`); dropped with the buffer they view
        self._targets: Tuple[object, List[torch.Tensor]] = ((), [])
        self._lock = threading.Lock()  # saves may run from several threads of one process
        #: whether the kept buffer is page-locked for CUDA (`_page_lock()`): None until a snapshot
        #: of CUDA tensors uses it, then True, or False where CUDA refused
        self._page_locked: Optional[bool] = None

    def _acquire(self, nbytes: int) -> torch.Tensor:
        if self._buffer is not None and self._buffer.numel() >= nbytes and not self._in_use():
            return self._buffer
        # a fresh buffer; the previous one, if still in use, lives on with its save
        logger.debug("allocating a %d-byte shared-memory snapshot buffer", nbytes)
        self._drop_buffer()  # before the new one is allocated: at most one idle buffer here
        self._buffer = _shared_bytes(nbytes)
        return self._buffer

    def __del__(self) -> None:
        # a pool let go of with its buffer page-locked: unlocked, or its pages would stay pinned
        if getattr(self, "_page_locked", None):
            try:
                self._drop_buffer()
            except Exception:  # noqa: BLE001 -- at interpreter exit CUDA may be gone already
                pass

    def _drop_buffer(self) -> None:
        """Let go of the kept buffer (unlocked first: a save still writing from it keeps its memory
        mapped, and its device copies are done)."""
        if self._buffer is not None and self._page_locked:
            _page_unlock(self._buffer)
        self._page_locked = None
        self._buffer = None
        self._targets = ((), [])
        self._in_use = lambda: False

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer the pool keeps (0 if none)."""
        return 0 if self._buffer is None else self._buffer.numel()

    def release(self) -> None:
        """Drop the kept buffer, e.g. after the last checkpoint of a job, or before a phase that
        needs the memory. Its memory is freed once no save uses it (the async writer process lets
        go of a save's buffer within a second of finishing it: `dist_ckpt.async_save.writer`)."""
        with self._lock:
            self._drop_buffer()

    def reserve(self, nbytes: int) -> None:
        """Allocate the buffer for snapshots of up to ``nbytes`` now, and touch every page of it,
        so that the first snapshot copies at the speed of the later ones (fresh memory costs a
        page fault per page: on the test VM a first copy into 512 MiB took 0.3 s, a later one
        0.05 s). Does nothing if the pool already has a large enough buffer.

        Example:

        ```python
        pool.reserve(512 << 20)   # at start-up, before the first checkpoint
        ```
        """
        with self._lock:
            if self._buffer is not None and self._buffer.numel() >= nbytes:
                return
            self._acquire(nbytes).zero_()

    def take(
        self,
        tensors: Sequence[torch.Tensor],
        in_use: Callable[[], bool],
        layout: Optional[Tuple[List[Tuple[int, int]], int]] = None,
        on_copied: Optional[Callable[[torch.Tensor, int], None]] = None,
    ) -> Snapshot:
        """Copy ``tensors`` into shared memory; ``in_use`` says whether the save that owns the
        snapshot still needs it (the buffer is not reused until it returns False). ``layout``:
        where each tensor goes (`file_order_layout()`); by default `snapshot_layout()`.
        ``on_copied(buffer, i)`` is called once tensor ``i`` is in the buffer (to start writing
        it while the next ones are copied).

        Example:

        ```python
        snap = pool.take(tensors, in_use=lambda: not outcome.done)
        ```
        """
        slots, total = layout or snapshot_layout([t.numel() * t.element_size() for t in tensors])
        if len(slots) != len(tensors):
            raise ValueError(f"a snapshot layout of {len(slots)} slots for {len(tensors)} tensors")
        with self._lock:
            buffer = self._acquire(total)
            if self._page_locked is None and _from_cuda(tensors):
                self._page_locked = _page_lock(buffer)
            self._in_use = in_use  # before the copy: no other save may take this buffer now
            targets = self._targets_for(buffer, slots, tensors)
        for i, (target, tensor) in enumerate(zip(targets, tensors)):
            _copy_into(target, tensor)
            if on_copied is not None:
                on_copied(buffer, i)
        return Snapshot(buffer, tuple(slots))

    def _targets_for(
        self, buffer: torch.Tensor, slots: Sequence[Tuple[int, int]], tensors: Sequence[torch.Tensor]
    ) -> List[torch.Tensor]:
        """The views of ``buffer`` the tensors are copied into: those of the previous take when
        it laid out tensors of the same dtypes and shapes the same way in the same buffer (a
        training job saves the same tensors every time), else new ones, kept for the next take.
        Making them costs a slice and two views per tensor (about 10-20 ms of a 585-tensor
        snapshot on the test VM), which is time the caller blocks. Views made under
        ``torch.inference_mode()`` cannot be written outside it, so the mode is part of the key."""
        key = (
            buffer.data_ptr(),
            torch.is_inference_mode_enabled(),
            tuple(slots),
            tuple((t.dtype, t.shape) for t in tensors),
        )
        if self._targets[0] != key:
            self._targets = (key, [_target(buffer, offset, n, t) for (offset, n), t in zip(slots, tensors)])
        return self._targets[1]


#: the pool the save strategies of this process share (see the module's docstring)
PROCESS_SNAPSHOTS = SnapshotPool()
