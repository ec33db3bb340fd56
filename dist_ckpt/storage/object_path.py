"""A key under an object-store :class:`Storage`, usable where code walks a directory tree.

The zarr layout (:mod:`dist_ckpt.backends.zarr.layout`) and its checksums address nodes and
chunk files as paths: ``root / key / "zarr.json"``, ``read_bytes()``, ``stat().st_size``,
listing a directory. :class:`ObjectPath` gives an object-store key that part of the
:class:`pathlib.Path` interface, so the same layout code serves a local directory (a ``Path``)
and an ``s3://`` checkpoint (an ``ObjectPath``); :data:`Node` is either.

"Directories" of an object store are key prefixes: one exists when an object lives under it.
There is no ``mkdir`` (nothing to create) and no ``fsync`` (an object is durable when its PUT
returns).

Example::

    root = ObjectPath(open_storage("s3://bucket/ckpt/iter_10"), "zarr")
    doc = (root / "layer.weight" / "zarr.json").read_bytes()
    str(root / "layer.weight")        # "s3://bucket/ckpt/iter_10/zarr/layer.weight"
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Union

from dist_ckpt.storage.base import BufferLike, Storage

__all__ = ["Node", "ObjectPath", "ObjectStat", "node_files", "subdirs"]


@dataclass(frozen=True)
class ObjectStat:
    """What :meth:`ObjectPath.stat` reports (the field :func:`os.stat` callers here use)."""

    st_size: int


class ObjectPath:
    """Key ``key`` ("" for the root) under ``storage``; compares and hashes by URL."""

    def __init__(self, storage: Storage, key: str = "") -> None:
        self.storage = storage
        self.key = key.strip("/")

    def __truediv__(self, name: str) -> "ObjectPath":
        return ObjectPath(self.storage, f"{self.key}/{name}" if self.key else name)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> "ObjectPath":
        return ObjectPath(self.storage, self.key.rsplit("/", 1)[0] if "/" in self.key else "")

    def read_bytes(self) -> bytes:
        """The whole object; :class:`~dist_ckpt.storage.errors.ObjectNotFoundError` (a
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
        return bool(self.storage.list_dirs(self.key)) or bool(self.storage.list(self.key))

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

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


Node = Union[Path, ObjectPath]
"""A directory or file of a checkpoint: a local :class:`Path` or an object-store key."""


def subdirs(node: Node) -> List[str]:
    """Names directly under ``node`` that may be directories: :func:`os.listdir` of a local
    directory (its callers skip the files), the common prefixes (one LIST request, not a
    listing of every chunk below) of an object-store prefix.

    Raises:
        FileNotFoundError: a local directory that does not exist (an object-store prefix
            without objects is empty, not missing).
    """
    if isinstance(node, Path):
        return os.listdir(node)
    return node.storage.list_dirs(node.key)


def node_files(node: Node) -> List[Node]:
    """Every file under ``node``, recursively (hidden local names included; callers filter)."""
    if isinstance(node, Path):
        return [p for p in node.rglob("*") if p.is_file()]
    return list(node.files())
