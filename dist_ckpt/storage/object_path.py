"""A key under a [`Storage`][dist_ckpt.storage.base.Storage], usable where code walks a directory tree.

The zarr layout (`dist_ckpt.backends.zarr.metadata`) and its checksums address nodes and
chunk files as paths: ``root / key / "zarr.json"``, ``read_bytes()``, ``stat().st_size``,
listing a directory. `ObjectPath` gives a storage key that part of the
`pathlib.Path` interface, so the same layout code serves a local directory (under a
``LocalStorage``) and an ``s3://`` checkpoint alike.

"Directories" of an object store are key prefixes: one exists when an object lives under it,
and `ObjectPath.mkdir()` has nothing to create there (on a local disk it creates the
directory durably).

Example:

```python
root = ObjectPath(open_storage("s3://bucket/ckpt/iter_10"), "zarr")
doc = (root / "layer.weight" / "zarr.json").read_bytes()
str(root / "layer.weight")        # "s3://bucket/ckpt/iter_10/zarr/layer.weight"
```
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Union

from dist_ckpt.storage.base import Storage
from dist_ckpt.storage.ranges import BufferLike

__all__ = ["ObjectPath", "ObjectStat", "node_files", "subdirs"]


@dataclass(frozen=True)
class ObjectStat:
    """What `ObjectPath.stat()` reports (the field `os.stat()` callers here use)."""

    st_size: int


class ObjectPath:
    """Key ``key`` ("" for the root) under ``storage``; compares and hashes by URL."""

    def __init__(self, storage: Storage, key: str = "") -> None:
        self.storage = storage
        self.key = key.strip("/")

    @classmethod
    def of(cls, path: Union[str, "os.PathLike[str]", "ObjectPath"]) -> "ObjectPath":
        """``path`` as a node: a local file or directory becomes its entry in a ``LocalStorage``
        of its parent directory (a node is returned as given).

        Example:

        ```python
        ObjectPath.of("ckpt/zarr/w").local_path()    # the directory, resolved
        ```
        """
        if isinstance(path, ObjectPath):
            return path
        from dist_ckpt.storage.local import LocalStorage  # local imports base: no cycle at import time

        local = Path(path)
        return cls(LocalStorage(local.parent), local.name)

    def __truediv__(self, name: str) -> "ObjectPath":
        return ObjectPath(self.storage, f"{self.key}/{name}" if self.key else name)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> "ObjectPath":
        return ObjectPath(self.storage, self.key.rsplit("/", 1)[0] if "/" in self.key else "")

    def read_bytes(self) -> bytes:
        """The whole object; [`ObjectNotFoundError`][dist_ckpt.storage.errors.ObjectNotFoundError] (a
        ``FileNotFoundError``) if it does not exist."""
        return self.storage.read(self.key)

    def write_bytes(self, data: BufferLike) -> None:
        """Write the whole object (it appears whole or not at all)."""
        self.storage.write(self.key, data)

    def stat(self) -> ObjectStat:
        return ObjectStat(self.storage.size(self.key))

    def is_file(self) -> bool:
        return bool(self.key) and self.storage.exists(self.key)

    def is_dir(self) -> bool:
        return self.storage.dir_exists(self.key)

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def mkdir(self) -> None:
        """Create this directory and its parents where the storage has directories (durably)."""
        self.storage.make_dir(self.key)

    def local_path(self) -> Path:
        """The file or directory this key is (storages with ``local_paths`` only)."""
        return self.storage.local_path(self.key) if self.key else self.storage.local_dir

    def files(self) -> List["ObjectPath"]:
        """Every object under this prefix (recursively), sorted: ``Path.rglob`` of files."""
        return [ObjectPath(self.storage, o.key) for o in self.storage.list(self.key)]

    def relative_to(self, root: "ObjectPath") -> str:
        """This key relative to ``root``'s (``/``-separated)."""
        if root.key and not self.key.startswith(f"{root.key}/"):
            raise ValueError(f"{self} is not under {root}")
        return self.key[len(root.key) + 1 :] if root.key else self.key

    def __str__(self) -> str:
        return self.storage.url_of(self.key) if self.key else self.storage.url

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __lt__(self, other: "ObjectPath") -> bool:
        return self.key < other.key


def subdirs(node: ObjectPath) -> List[str]:
    """Names of the directories directly under ``node``: one listing of one level (on an object
    store, one LIST request for the common prefixes, not a listing of every chunk below). A
    missing directory has none."""
    return node.storage.list_dirs(node.key)


def node_files(node: ObjectPath) -> List[ObjectPath]:
    """Every file under ``node``, recursively, sorted (in-progress temporary files excluded)."""
    return node.files()
