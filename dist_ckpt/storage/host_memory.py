"""The host-memory budget: one bound on the extra host memory of every path that stages bytes.

Async snapshots, device-to-host copies of a save, host-to-device copies of a load, HF exports and
conversions all hold tensor bytes in host memory on their way between a device and the storage.
``host_memory_budget_bytes`` bounds what they hold at once, beyond the tensors themselves:

* per process: [`set_host_memory_budget()`][dist_ckpt.storage.host_memory.set_host_memory_budget],
  or the environment variable ``DIST_CKPT_HOST_MEMORY_BUDGET`` (bytes; read when no budget was set);
* per call: the ``host_memory_budget_bytes=`` argument of ``save``, ``load``, ``async_save``,
  ``save_model_and_optim_state`` and ``Checkpointer``, which opens a
  [`host_memory_budget()`][dist_ckpt.storage.host_memory.host_memory_budget] scope for the call.

The strategies read [`get_host_memory_budget()`][dist_ckpt.storage.host_memory.get_host_memory_budget] on
the calling thread (a scope is a ``ContextVar``: threads a strategy starts do not see it, so the
strategy reads it before it starts them). None means no bound: every path behaves as without this
module. A scope also tallies what an async save did with its budget
([`HostMemoryUse`][dist_ckpt.storage.host_memory.HostMemoryUse]), which its report shows.

Tensors are moved in pieces by [`host_pieces()`][dist_ckpt.storage.host_memory.host_pieces]: a contiguous
host tensor as views of its own memory (no copy), any other (a GPU tensor, a strided view) through
one reusable host buffer of at most the piece size. Every non-host tensor takes the same code, so
a non-contiguous CPU tensor exercises the device path on a machine without a GPU.

Example:

```python
set_host_memory_budget(256 << 20)              # every later save and load of this process
with host_memory_budget(64 << 20) as use:      # one call (what dc.save(..., host_memory_budget_bytes=) does)
    request = dc.save(sd, "ckpt/iter_10", async_sharded_save=True)
print(use.snapshot_nbytes, use.written_before_return_nbytes)
```
"""

from __future__ import annotations

import contextlib
import os
import threading
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from dist_ckpt.errors import ArgumentTypeError

__all__ = [
    "BUDGET_ENV_VAR",
    "DEFAULT_STAGING_BYTES",
    "MIN_PIECE_BYTES",
    "HostMemoryUse",
    "check_budget",
    "get_host_memory_budget",
    "host_memory_budget",
    "host_pieces",
    "needs_staging",
    "note_async_split",
    "piece_bytes",
    "set_host_memory_budget",
]

#: the environment variable read for the process's budget (bytes) when none was set in code
BUDGET_ENV_VAR = "DIST_CKPT_HOST_MEMORY_BUDGET"

#: the smallest piece a staged copy uses, whatever the budget: below it the cost per copy dominates
#: (so a budget under ``MIN_PIECE_BYTES`` times the writer threads is exceeded by that much)
MIN_PIECE_BYTES = 1 << 20

#: each staging buffer's size without a budget (one per writer or reader thread)
DEFAULT_STAGING_BYTES = 64 << 20

_process_budget: Optional[int] = None
_process_budget_set = False


@dataclass
class HostMemoryUse:
    """What the calls inside one [`host_memory_budget()`][..host_memory_budget] scope did with it.

    Attributes:
        budget: the budget in force in the scope (None: unbounded).
        snapshot_nbytes: bytes async saves copied into their snapshot.
        written_before_return_nbytes: bytes async saves wrote before returning, because they did
            not fit the budget.
    """

    budget: Optional[int]
    snapshot_nbytes: int = 0
    written_before_return_nbytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)


_scope: ContextVar[Optional[HostMemoryUse]] = ContextVar("dist_ckpt_host_memory_scope", default=None)


def check_budget(value: object, what: str = "host_memory_budget_bytes") -> Optional[int]:
    """``value`` as a budget (an int >= 0, or None for no bound).

    Raises:
        ArgumentTypeError: anything else, naming ``what``.
    """
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ArgumentTypeError(f"{what} must be an int >= 0 (bytes) or None (no bound), got {value!r}")
    return value


def set_host_memory_budget(nbytes: Optional[int]) -> None:
    """Set the budget of every later save and load of this process (None: no bound, and the
    environment variable is no longer read). A per-call argument takes precedence.

    Example:

    ```python
    set_host_memory_budget(256 << 20)
    ```
    """
    global _process_budget, _process_budget_set
    _process_budget = check_budget(nbytes)
    _process_budget_set = True


def _env_budget() -> Optional[int]:
    raw = os.environ.get(BUDGET_ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ArgumentTypeError(f"{BUDGET_ENV_VAR}={raw!r}: expected a number of bytes") from None
    return check_budget(value, BUDGET_ENV_VAR)


def get_host_memory_budget() -> Optional[int]:
    """The budget in force on this thread: the innermost call's, else the process's (set in code,
    else ``DIST_CKPT_HOST_MEMORY_BUDGET``), else None (no bound)."""
    scope = _scope.get()
    if scope is not None:
        return scope.budget
    if _process_budget_set:
        return _process_budget
    return _env_budget()


@contextlib.contextmanager
def host_memory_budget(nbytes: Optional[int]) -> Iterator[HostMemoryUse]:
    """A scope in which the budget is ``nbytes`` (None: the process's budget); yields the tally
    of what async saves inside it snapshotted and wrote before returning.

    Example:

    ```python
    with host_memory_budget(64 << 20) as use:
        dc.load(sd, "ckpt/iter_10")
    ```
    """
    budget = check_budget(nbytes)
    use = HostMemoryUse(budget if budget is not None else get_host_memory_budget())
    token = _scope.set(use)
    try:
        yield use
    finally:
        _scope.reset(token)


def note_async_split(snapshot_nbytes: int, written_before_return_nbytes: int) -> None:
    """Record, in the current scope (if any), what an async save snapshotted and wrote at once."""
    scope = _scope.get()
    if scope is None:
        return
    with scope._lock:
        scope.snapshot_nbytes += snapshot_nbytes
        scope.written_before_return_nbytes += written_before_return_nbytes


def piece_bytes(default: int, shares: int = 1) -> int:
    """The size of each of ``shares`` staging buffers used at once: ``default`` without a budget,
    else the budget's share (at least `MIN_PIECE_BYTES`) when that is smaller."""
    budget = get_host_memory_budget()
    if budget is None:
        return default
    return max(MIN_PIECE_BYTES, min(default, budget // max(1, shares)))


def needs_staging(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes must be copied to host memory to be written: it is not a
    contiguous CPU tensor (a device tensor, or a strided view)."""
    return tensor.device.type != "cpu" or not tensor.is_contiguous()


def _blocks(tensor: torch.Tensor, max_bytes: int) -> Iterator[torch.Tensor]:
    """Sub-tensors of ``tensor`` (views), each at most ``max_bytes`` (or one element), whose
    row-major concatenation is ``tensor``'s row-major values."""
    size = tensor.element_size()
    if tensor.is_contiguous() or tensor.dim() == 0:
        flat = tensor.reshape(-1)
        step = max(1, max_bytes // size)
        for start in range(0, flat.numel(), step):
            yield flat[start : start + step]
        return
    row_bytes = (tensor.numel() // max(1, tensor.shape[0])) * size
    if row_bytes > max_bytes:
        for row in tensor:
            yield from _blocks(row, max_bytes)
        return
    rows = max(1, max_bytes // max(1, row_bytes))
    for start in range(0, tensor.shape[0], rows):
        yield tensor[start : start + rows]


def host_pieces(
    tensor: torch.Tensor, max_bytes: int, buffer: Optional[torch.Tensor] = None, force: bool = False
) -> Iterator[memoryview]:
    """``tensor``'s bytes, row-major, as host memory in pieces of at most ``max_bytes``.

    A contiguous CPU tensor yields views of its own memory (unless ``force``); any other goes
    piece by piece through ``buffer`` (a uint8 CPU tensor of at least ``max_bytes``, e.g. pinned;
    one is allocated if None), which each piece overwrites: consume a piece before asking for the
    next. The copy is synchronous, so the buffer may be reused at once.
    """
    detached = tensor.detach()
    if detached.numel() == 0:
        return
    if not force and not needs_staging(detached):
        data = detached.reshape(-1).view(torch.uint8).numpy().data
        for start in range(0, len(data), max_bytes):
            yield data[start : start + max_bytes]
        return
    limit = max(max_bytes, detached.element_size())
    if buffer is None or buffer.numel() < limit:
        buffer = torch.empty(limit, dtype=torch.uint8)
    for block in _blocks(detached, limit):
        nbytes = block.numel() * block.element_size()
        host = buffer[:nbytes]
        host.view(block.dtype).view(block.shape).copy_(block)  # strided or device-to-host, in place
        yield host.numpy().data
