"""What a storage moved: running I/O counters, shared by a storage and its children."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["IOCounters", "IOStats"]


@dataclass(frozen=True)
class IOStats:
    """A snapshot of what a storage (and its children) moved, for tests and reports.

    Attributes:
        bytes_read: payload bytes received by reads (``read`` and ``read_ranges``).
        bytes_written: payload bytes handed to writes that completed.
        read_requests: read requests issued (one per ranged GET / ``pread`` piece; retries
            inside the S3 client are not counted here -- the test server counts those).
        objects_written: objects written (a multipart upload counts once).
        metadata_requests: ``size`` / ``exists`` / ``list`` / ``delete`` calls.
    """

    bytes_read: int = 0
    bytes_written: int = 0
    read_requests: int = 0
    objects_written: int = 0
    metadata_requests: int = 0


@dataclass
class IOCounters:
    """Thread-safe running totals behind `Storage.stats` (shared by a storage and its children)."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _totals: IOStats = field(default_factory=IOStats)

    def add(
        self,
        *,
        bytes_read: int = 0,
        bytes_written: int = 0,
        read_requests: int = 0,
        objects_written: int = 0,
        metadata_requests: int = 0,
    ) -> None:
        """Add to the totals."""
        with self._lock:
            t = self._totals
            self._totals = IOStats(
                t.bytes_read + bytes_read,
                t.bytes_written + bytes_written,
                t.read_requests + read_requests,
                t.objects_written + objects_written,
                t.metadata_requests + metadata_requests,
            )

    def snapshot(self) -> IOStats:
        """The totals so far."""
        with self._lock:
            return self._totals

    def reset(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self._totals = IOStats()
