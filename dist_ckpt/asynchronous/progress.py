"""Progress that a call run by the async writer reports without using CPU.

The training process stops a writer whose CPU time stops growing for too long, taking it as
hung (`dist_ckpt.asynchronous.worker`). A call that waits on purpose -- for the training
process's own writes of an async save (`dist_ckpt.backends.safetensors.early_writes`) -- calls
`note_progress()` whenever what it waits for moves on; the writer's status carries the count,
and a count that grows is progress as well.

Example:

```python
for mark in marks_from_the_training_process():
    note_progress()
```
"""

from __future__ import annotations

import threading

__all__ = ["note_progress", "progress_count"]

_lock = threading.Lock()
_count = 0


def note_progress() -> None:
    """Record that the running call moved on (any thread)."""
    global _count
    with _lock:
        _count += 1


def progress_count() -> int:
    """How many times progress was noted in this process so far."""
    with _lock:
        return _count
