"""Where a checkpoint lives, as the save and load paths see it: always a [`Storage`][dist_ckpt.storage.base.Storage].

Entry points (``save``, ``load``, ``unshard``, the CLI, ...) accept a path, a ``file://`` or
``s3://`` URL, or an opened [`Storage`][dist_ckpt.storage.base.Storage] (`LocationLike`).
`resolve_location()` turns any of them into the storage that strategies receive as
``checkpoint_dir``: a [`LocalStorage`][dist_ckpt.storage.local.LocalStorage] for a local directory, an
``S3Storage`` for an object store. There is one I/O path; what only a local disk can do is a
capability of the storage (``local_paths``, ``positional_reads``, ...), never a second type.

A strategy that declares ``object_storage = False`` (one written for directories) is refused on
object stores before any byte moves; on a local disk it receives a ``LocalStorage``, which is
``os.PathLike`` (``Path(checkpoint_dir)`` is the directory) and has ``local_dir``.

Example:

```python
location = resolve_location("s3://bucket/run/iter_1000")   # an S3Storage
location = resolve_location("ckpt/iter_1000")              # LocalStorage('ckpt/iter_1000')
location.exists("metadata.json")
```
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

from dist_ckpt.errors import IncompatibleStrategyError
from dist_ckpt.storage.base import S3_SCHEMES, Storage, open_storage
from dist_ckpt.storage.errors import StorageConfigError

__all__ = ["LocationLike", "require_local", "resolve_location"]

LocationLike = Union[str, "os.PathLike[str]", Storage]
"""What entry points accept: a path, a ``file://`` or ``s3://`` URL, or an opened storage."""


def resolve_location(location: LocationLike) -> Storage:
    """The storage of a path, URL or storage (a storage is returned as given, with its options).

    Local paths and ``file://`` URLs give a ``LocalStorage``; object-store URLs are opened
    ([`open_storage()`][dist_ckpt.storage.base.open_storage], configured from the AWS environment).

    Raises:
        StorageConfigError: a malformed URL, an unknown scheme, or an ``s3://`` URL that went
            through `pathlib.Path` (which folds ``//``: pass URLs as strings).

    Example:

    ```python
    resolve_location("s3://bucket/ckpt")      # S3Storage('s3://bucket/ckpt')
    resolve_location(Path("/ckpt"))           # LocalStorage('/ckpt')
    ```
    """
    if isinstance(location, Storage):
        return location
    text = os.fspath(location)
    if isinstance(location, os.PathLike) and any(text.lower().startswith(f"{s}:/") for s in S3_SCHEMES):
        raise StorageConfigError(
            f"checkpoint location {text!r} looks like an object-store URL that went through pathlib.Path, which "
            "folds '//' into '/': pass the URL as a string ('s3://bucket/prefix')"
        )
    return open_storage(text)


def require_local(location: Storage, what: str) -> Path:
    """The directory of a storage with local files; for an object store, an error naming ``what``.

    Example:

    ```python
    directory = require_local(checkpoint_dir, "the HuggingFace folder reader")
    ```
    """
    if location.local_paths:
        return location.local_dir
    raise IncompatibleStrategyError(
        f"{what} works on local directories only, not on object storage ({location.url}); use a local path"
    )
