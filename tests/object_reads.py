"""Which storage objects a piece of code reads, for tests of what a load touches."""

from __future__ import annotations

from typing import List

import pytest

from dist_ckpt.storage.object_path import ObjectPath


def record_object_reads(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """From now on (until ``monkeypatch`` is undone), append the key of every object read through
    ``ObjectPath.read_bytes`` -- how the zarr layout reads its metadata -- to the returned list."""
    read: List[str] = []
    real = ObjectPath.read_bytes

    def recording(self: ObjectPath) -> bytes:
        read.append(self.key)
        return real(self)

    monkeypatch.setattr(ObjectPath, "read_bytes", recording)
    return read
