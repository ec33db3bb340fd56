"""Snapshots of tensors in shared memory, for saves that write from another process.

An asynchronous save must hold the values the tensors had when it was called, while training
goes on changing them. `SnapshotPool.take()` copies the tensors' bytes (device-to-host for
GPU tensors, a memory copy for CPU ones) into one buffer in shared memory; the background
writer process maps the same buffer (`channel` passes it as a file descriptor,
never as a pickled copy of the data) and writes the files from it.

Touching fresh shared memory costs page faults (on the 2-core test VM a first copy into it ran
at about a third of the speed of a copy into memory already touched), so the pool keeps its
buffers for the next saves, once the save that used one is done with it. The save strategies
share one pool per process (`PROCESS_SNAPSHOTS`): a save with a new strategy object -- as
``save(..., async_sharded_save=True)`` with the default strategy, or Megatron-Core's training
loop creating its strategy at every save, do -- reuses the buffer of the previous save instead
of faulting in a fresh one (on the test VM that took an async save's blocking time at 0.5 GB per
rank from about 1 s to about the time of a memory copy). A save scheduled while the previous one
is still writing finds that buffer in use: it gets a second buffer, also kept, so that saves
back to back alternate between two buffers and pay the page faults once.

Memory bound: the process keeps at most two buffers (`MAX_KEPT_BUFFERS`), each at most the size
of the largest snapshot taken into it (or reserved) since the pool was last released
([`release()`][dist_ckpt.asynchronous.snapshot.SnapshotPool.release]), the second only once two
saves overlapped; plus the buffers of saves still writing when a third overlapping one starts
(the writer process lets go of a save's buffer within a second of finishing it). A trainer can
fault a buffer in before its first checkpoint, in the background
([`reserve()`][dist_ckpt.asynchronous.snapshot.SnapshotPool.reserve]).

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

__all__ = ["MAX_KEPT_BUFFERS", "PROCESS_SNAPSHOTS", "Snapshot", "SnapshotPool", "file_order_layout", "snapshot_layout"]

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


@dataclass(eq=False)  # compared by identity: it holds tensors
class _KeptBuffer:
    """A buffer the pool keeps, the save using it, and what the pool knows about it."""

    buffer: torch.Tensor
    #: whether the save that took it last still needs it
    in_use: Callable[[], bool] = lambda: False
    #: whether it is page-locked for CUDA (`_page_lock()`): None until a snapshot of CUDA tensors
    #: uses it, then True, or False where CUDA refused
    page_locked: Optional[bool] = None
    #: the key and views of the last take into it (`SnapshotPool._targets_for()`)
    targets: Tuple[object, List[torch.Tensor]] = ((), [])

    def drop(self) -> None:
        """Let go of it (unlocked first: a save still writing from it keeps its memory mapped,
        and its device copies are done)."""
        if self.page_locked:
            _page_unlock(self.buffer)
        self.page_locked = None
        self.targets = ((), [])


#: buffers a pool keeps: one for the save being written, one for a save scheduled right after it
MAX_KEPT_BUFFERS = 2


class SnapshotPool:
    """Takes snapshots into shared-memory buffers that it reuses once no save is using them.

    The save strategies of a process share one (`PROCESS_SNAPSHOTS`). A snapshot goes into a
    kept buffer that is large enough and that no save still uses; a save scheduled before the
    previous one finished writing finds that buffer in use, and gets a second one, which the pool
    keeps as well (at most ``max_buffers``), so that saves back to back alternate between two
    buffers instead of faulting in a fresh one each time. Spaced saves only ever use one.

    Args:
        max_buffers: how many buffers to keep (each up to the size of the largest snapshot taken
            into it); a snapshot that finds all of them in use gets a new one in place of the
            least recently used, which lives on with its save.
    """

    def __init__(self, max_buffers: int = MAX_KEPT_BUFFERS) -> None:
        if max_buffers < 1:
            raise ValueError(f"a snapshot pool keeps at least one buffer, got max_buffers={max_buffers}")
        self.max_buffers = max_buffers
        self._kept: List[_KeptBuffer] = []  # least recently used first
        self._lock = threading.Lock()  # saves may run from several threads of one process
        self._reserving: Optional[threading.Thread] = None

    def _acquire(self, nbytes: int) -> _KeptBuffer:
        free = [k for k in self._kept if not k.in_use()]
        fitting = [k for k in free if k.buffer.numel() >= nbytes]
        if fitting:
            kept = min(fitting, key=lambda k: k.buffer.numel())
            self._kept.remove(kept)
        else:
            # a fresh buffer, in place of a free one too small, or, with max_buffers kept, of the
            # least recently used (which, still in use, lives on with its save)
            victim = free[0] if free else self._kept[0] if len(self._kept) >= self.max_buffers else None
            if victim is not None:
                self._kept.remove(victim)
                victim.drop()
            logger.debug("allocating a %d-byte shared-memory snapshot buffer", nbytes)
            kept = _KeptBuffer(_shared_bytes(nbytes))
        self._kept.append(kept)
        return kept

    def __del__(self) -> None:
        # a pool let go of with a buffer page-locked: unlocked, or its pages would stay pinned
        for kept in getattr(self, "_kept", ()):
            if kept.page_locked:
                try:
                    kept.drop()
                except Exception:  # noqa: BLE001 -- at interpreter exit CUDA may be gone already
                    pass

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers the pool keeps (0 if none)."""
        return sum(k.buffer.numel() for k in self._kept)

    @property
    def buffers(self) -> Tuple[torch.Tensor, ...]:
        """The buffers the pool keeps, least recently used first."""
        return tuple(k.buffer for k in self._kept)

    def release(self) -> None:
        """Drop the kept buffers, e.g. after the last checkpoint of a job, or before a phase that
        needs the memory. Their memory is freed once no save uses them (the async writer process
        lets go of a save's buffer within a second of finishing it: `dist_ckpt.asynchronous.writer`)."""
        self.wait_reserved()
        with self._lock:
            for kept in self._kept:
                kept.drop()
            self._kept = []

    def reserve(self, nbytes: int, background: bool = False) -> None:
        """Allocate a buffer for snapshots of up to ``nbytes`` now, and touch every page of it,
        so that the first snapshot copies at the speed of the later ones (fresh memory costs a
        page fault per page: on the test VM a first copy into 512 MiB took 0.3 s, a later one
        0.05 s). Does nothing if the pool already keeps a large enough buffer.

        Args:
            nbytes: the snapshot's size (e.g. `SafetensorsSaveShardedStrategy.reserve_snapshot`
                computes it from a state dict).
            background: fault the buffer in on a thread of its own and return at once; a snapshot
                taken meanwhile waits for it (and then uses it) instead of faulting in another.

        Example:

        ```python
        pool.reserve(512 << 20, background=True)   # at start-up, before the first checkpoint
        ```
        """
        if not background:
            with self._lock:
                self._reserve_locked(nbytes)
            return
        self.wait_reserved()
        self._lock.acquire()  # taken here and released by the thread: no take() slips in before it
        thread = threading.Thread(
            target=self._reserve_in_background, args=(nbytes,), name="dist_ckpt-snapshot-reserve", daemon=True
        )
        try:
            thread.start()
        except BaseException:
            self._lock.release()
            raise
        self._reserving = thread

    def _reserve_locked(self, nbytes: int) -> None:
        if any(k.buffer.numel() >= nbytes for k in self._kept):
            return
        self._acquire(nbytes).buffer.zero_()

    def _reserve_in_background(self, nbytes: int) -> None:
        try:
            self._reserve_locked(nbytes)
        except Exception as e:  # noqa: BLE001 -- only an optimisation: the first snapshot faults instead
            logger.warning("could not reserve a %d-byte snapshot buffer: %s", nbytes, e)
        finally:
            self._lock.release()

    def wait_reserved(self) -> None:
        """Wait for a reservation started with ``background=True`` to finish."""
        thread = self._reserving
        if thread is not None:
            thread.join()
            self._reserving = None

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
            kept = self._acquire(total)
            if kept.page_locked is None and _from_cuda(tensors):
                kept.page_locked = _page_lock(kept.buffer)
            kept.in_use = in_use  # before the copy: no other save may take this buffer now
            targets = self._targets_for(kept, slots, tensors)
        buffer = kept.buffer
        for i, (target, tensor) in enumerate(zip(targets, tensors)):
            _copy_into(target, tensor)
            if on_copied is not None:
                on_copied(buffer, i)
        return Snapshot(buffer, tuple(slots))

    @staticmethod
    def _targets_for(
        kept: _KeptBuffer, slots: Sequence[Tuple[int, int]], tensors: Sequence[torch.Tensor]
    ) -> List[torch.Tensor]:
        """The views of the buffer the tensors are copied into: those of the previous take into
        it when that laid out tensors of the same dtypes and shapes the same way (a training job
        saves the same tensors every time), else new ones, kept for the next take. Making them
        costs a slice and two views per tensor (about 10-20 ms of a 585-tensor snapshot on the
        test VM), which is time the caller blocks. Views made under ``torch.inference_mode()``
        cannot be written outside it, so the mode is part of the key."""
        key = (torch.is_inference_mode_enabled(), tuple(slots), tuple((t.dtype, t.shape) for t in tensors))
        if kept.targets[0] != key:
            kept.targets = (key, [_target(kept.buffer, offset, n, t) for (offset, n), t in zip(slots, tensors)])
        return kept.targets[1]


#: the pool the save strategies of this process share (see the module's docstring)
PROCESS_SNAPSHOTS = SnapshotPool()
