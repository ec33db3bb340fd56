"""The plain standard-library types the common-state loader rebuilds without full pickle.

``torch.load(weights_only=True)`` rebuilds tensors, containers, numbers and strings and refuses
every other class, so a checkpoint cannot run code on load. Megatron-Core trainers also keep
plain standard-library data in their common state and ShardedObjects: ``io.BytesIO`` buffers
(data-loader and RNG states), ``argparse.Namespace`` (the training arguments), dates, paths.
Rebuilding those runs no code from the file either, so `PLAIN_DATA_TYPES` adds them to
torch's allow-list for the duration of dist_ckpt's own loads (`plain_data_allowed()`).

What the unpickler may do with an allowed class is fixed by torch: call the class itself, or
``cls.__new__(cls, *args)`` followed by ``__setstate__(state)`` (or an update of ``__dict__``),
with arguments that are themselves plain data from the file. Each class below is allowed
because those calls only build a value:

* ``io.BytesIO``: ``__setstate__`` copies bytes into a new buffer (and its position);
* ``argparse.Namespace``: ``__dict__`` is updated with the stored attributes;
* ``datetime.date``, ``time``, ``datetime``, ``timedelta``, ``timezone``: C constructors of
  numbers, bytes and strings;
* ``decimal.Decimal``, ``fractions.Fraction``, ``uuid.UUID``: parse a number or a string;
* ``pathlib.PurePosixPath``, ``PureWindowsPath``, ``PosixPath``, ``WindowsPath``: string
  manipulation only (building a path opens no file);
* ``frozenset``, ``slice``, ``range``: builtin constructors of plain values.

Left out, on purpose:

* ``collections.defaultdict`` and ``deque``: torch's unpickler fills only dicts, lists,
  ``OrderedDict`` and ``Counter``, and a ``defaultdict`` stores a callable from the file;
* ``enum.Enum`` subclasses: each is user code (``Enum(value)`` may run ``_missing_``); allow
  the ones you trust with ``TorchCommonLoadStrategy(safe_globals=[MyEnum])`` (for dist_ckpt's
  loads) or ``torch.serialization.add_safe_globals`` (process-wide);
* ``zoneinfo.ZoneInfo`` (reads time-zone files named in the checkpoint) and numpy arrays
  (rebuilt through numpy's internals): ``allow_pickle=True`` for checkpoints you trust.

Anything else still fails the load with [`UnsafeObjectError`][dist_ckpt.errors.UnsafeObjectError].

Example:

```python
with plain_data_allowed():
    state = torch.load(io.BytesIO(data), weights_only=True)   # may hold BytesIO, Namespace, ...
```
"""

from __future__ import annotations

import argparse
import datetime
import decimal
import fractions
import io
import pathlib
import threading
import uuid
from contextlib import contextmanager
from typing import Any, Iterator, Sequence, Tuple

import torch

__all__ = ["PLAIN_DATA_TYPES", "plain_data_allowed"]

#: classes dist_ckpt's loads rebuild with ``weights_only`` (see the module docstring for why)
PLAIN_DATA_TYPES: Tuple[type, ...] = (
    io.BytesIO,
    argparse.Namespace,
    datetime.date,
    datetime.time,
    datetime.datetime,
    datetime.timedelta,
    datetime.timezone,
    decimal.Decimal,
    fractions.Fraction,
    uuid.UUID,
    pathlib.PurePosixPath,
    pathlib.PureWindowsPath,
    pathlib.PosixPath,
    pathlib.WindowsPath,
    frozenset,
    slice,
    range,
)

# torch keeps one process-wide allow-list; scopes are serialized so that one load leaving its
# scope never removes a class another of our loads still needs
_SCOPE_LOCK = threading.Lock()


@contextmanager
def plain_data_allowed(extra: Sequence[Any] = ()) -> Iterator[None]:
    """Allow `PLAIN_DATA_TYPES` (and ``extra``) in ``torch.load(weights_only=True)`` inside
    the block.

    Only the classes torch's allow-list lacks are added, and exactly those are removed on exit,
    so the caller's own ``torch.serialization.add_safe_globals`` settings are kept as they were.
    The allow-list is process-wide: another thread's ``torch.load`` during the block sees the
    same classes (they are plain data there too).

    Example:

    ```python
    with plain_data_allowed([MyEnum]):
        torch.load(buffer, weights_only=True)
    ```
    """
    with _SCOPE_LOCK:
        present = torch.serialization.get_safe_globals()
        added = [g for g in dict.fromkeys([*PLAIN_DATA_TYPES, *extra]) if g not in present]
        with torch.serialization.safe_globals(added):
            yield
