"""Which process is which, across machines: enough to prove that a process is gone.

A `ProcessIdentity` names one process: the machine's kernel boot (``boot_id``), its PID
namespace, its PID and that process's start time (so a reused PID is not mistaken for it).
`ProcessIdentity.running()` answers True or False only for a process of this machine and
namespace, None elsewhere: a process on another machine can never be proven dead from here.

Used by `dist_ckpt.engine.save_claim` (may an interrupted save's files be cleared?) and
`dist_ckpt.collectives.distributed` (which rank died during a collective?).

Example:

```python
me = ProcessIdentity.current()
me.running()                      # True
```
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

__all__ = ["ProcessIdentity"]


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def process_start(pid: int) -> Optional[str]:
    """The start time (clock ticks since boot) of process ``pid``, or None if it is not running
    (exited -- a zombie not yet reaped by its parent counts as exited -- or this is not Linux)."""
    stat = _read_text(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rpartition(")")[2].split()
    if len(fields) <= 19 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


@dataclass(frozen=True)
class ProcessIdentity:
    """One process: host name (for messages), kernel boot, PID namespace, PID, start time."""

    host: str
    boot_id: Optional[str]
    pid_namespace: Optional[str]
    pid: int
    pid_start: Optional[str]

    @classmethod
    def current(cls) -> "ProcessIdentity":
        """The identity of the calling process."""
        pid = os.getpid()
        return cls(
            socket.gethostname(),
            _read_text("/proc/sys/kernel/random/boot_id"),
            _pid_namespace(),
            pid,
            process_start(pid),
        )

    def running(self) -> Optional[bool]:
        """Whether the process runs: True/False for one of this machine's current boot and this
        PID namespace, None (cannot tell) otherwise."""
        here = ProcessIdentity.current()
        if self.pid <= 0 or self.boot_id is None or self.pid_namespace is None:
            return None
        if (self.boot_id, self.pid_namespace) != (here.boot_id, here.pid_namespace):
            return None
        start = process_start(self.pid)
        return start is not None and (self.pid_start is None or start == self.pid_start)

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: Any) -> Optional["ProcessIdentity"]:
        """The identity in ``doc`` (a dict as `to_json()` writes), or None if malformed."""
        if not isinstance(doc, dict):
            return None

        def text(name: str) -> Optional[str]:
            value = doc.get(name)
            return value if isinstance(value, str) else None

        pid = doc.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool):
            return None
        return cls(str(doc.get("host")), text("boot_id"), text("pid_namespace"), pid, text("pid_start"))

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True).encode("utf-8")
