"""Where a checkpoint lives, as the save and load paths see it: a local directory or a storage.

Entry points (``save``, ``load``, ``unshard``, the CLI, ...) accept a path, an ``s3://`` URL or
an opened :class:`~dist_ckpt.storage.base.Storage`. :func:`resolve_location` turns that into a
:data:`CheckpointLocation`, which is what strategies receive as ``checkpoint_dir``:

* a :class:`pathlib.Path` for a local directory -- exactly what strategies received before object
  stores were supported, so local saves and loads keep their code paths (``preadv`` straight into
  tensors, early writeback, fsync) and third-party strategies written for paths keep working;
* a :class:`Storage` without local paths (``S3Storage``) for an object store. Only strategies
  that declare ``object_storage = True`` are handed one; the others are refused with an error
  naming the strategy and the URL before any byte moves.

Example::

    location = resolve_location("s3://bucket/run/iter_1000")   # an S3Storage
    location = resolve_location("ckpt/iter_1000")              # Path("ckpt/iter_1000")
    storage_of(location).exists("metadata.json")
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from dist_ckpt.errors import IncompatibleStrategyError
from dist_ckpt.storage.base import Storage, open_storage
from dist_ckpt.storage.errors import StorageConfigError
from dist_ckpt.storage.local import LocalStorage

__all__ = [
    "CheckpointLocation",
    "LocationLike",
    "child_location",
    "is_remote",
    "location_str",
    "remote_storage",
    "require_local",
    "resolve_location",
    "storage_of",
]

CheckpointLocation = Union[Path, Storage]
"""What strategies receive as ``checkpoint_dir``: a local directory, or an object-store storage."""

LocationLike = Union[str, "os.PathLike[str]", Storage]
"""What entry points accept: a path, a ``file://`` or ``s3://`` URL, or an opened storage."""

_OBJECT_SCHEMES = ("s3", "s3a")


def resolve_location(location: LocationLike) -> CheckpointLocation:
    """The :data:`CheckpointLocation` of a path, URL or storage.

    Local locations (paths, ``file://`` URLs, a ``LocalStorage``) become a :class:`Path`; object
    store URLs are opened (:func:`~dist_ckpt.storage.base.open_storage`, configured from the AWS
    environment); an object-store :class:`Storage` is returned as given, with its options.

    Raises:
        StorageConfigError: a malformed URL, an unknown scheme, or an ``s3://`` URL that went
            through :class:`pathlib.Path` (which folds ``//``: pass URLs as strings).

    Example::

        resolve_location("s3://bucket/ckpt")      # S3Storage('s3://bucket/ckpt')
        resolve_location(Path("/ckpt"))           # PosixPath('/ckpt')
    """
    if isinstance(location, Storage):
        if isinstance(location, LocalStorage):
            return location.root
        if location.local_paths:
            raise StorageConfigError(
                f"{location!r} declares local_paths but is not a LocalStorage; pass its directory instead"
            )
        return location
    text = os.fspath(location)
    if isinstance(location, os.PathLike) and any(text.lower().startswith(f"{s}:/") for s in _OBJECT_SCHEMES):
        raise StorageConfigError(
            f"checkpoint location {text!r} looks like an object-store URL that went through pathlib.Path, which "
            "folds '//' into '/': pass the URL as a string ('s3://bucket/prefix')"
        )
    scheme, sep, _ = text.partition("://")
    if sep and scheme.lower() in _OBJECT_SCHEMES:
        return open_storage(text)
    if sep:
        opened = open_storage(text)  # file:// (or an error naming the unsupported scheme)
        return resolve_location(opened)
    return Path(text)


def is_remote(location: CheckpointLocation) -> bool:
    """Whether ``location`` is an object store (not a local directory)."""
    return not isinstance(location, Path)


def remote_storage(location: CheckpointLocation) -> Optional[Storage]:
    """The storage of an object-store location, or None for a local directory."""
    return None if isinstance(location, Path) else location


def storage_of(location: CheckpointLocation) -> Storage:
    """A storage for ``location``: the object store itself, or a ``LocalStorage`` of the directory.

    Example::

        storage_of(Path("ckpt")).read("metadata.json")
    """
    return open_storage(location)


def location_str(location: CheckpointLocation) -> str:
    """``location`` for messages: the directory path or the ``s3://`` URL (never credentials)."""
    return str(location) if isinstance(location, Path) else location.url


def require_local(location: CheckpointLocation, what: str) -> Path:
    """The directory of a local location; for an object store, an error naming ``what`` and the URL.

    Example::

        directory = require_local(checkpoint_dir, "the HuggingFace folder reader")
    """
    if isinstance(location, Path):
        return location
    raise IncompatibleStrategyError(
        f"{what} works on local directories only, not on object storage ({location.url}); use a local path"
    )


def child_location(location: CheckpointLocation, name: str) -> CheckpointLocation:
    """The location ``name`` under ``location`` (a subdirectory, or a child prefix).

    Example::

        child_location(resolve_location("s3://bucket/run"), "iter_0000010")   # s3://bucket/run/iter_0000010
    """
    if isinstance(location, Path):
        return location / name
    return location.child(name)
