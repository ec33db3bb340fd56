"""Where the zarr-python engine of the zarr backend finds a node, and how the S3 client's errors
leave it.

Both halves of the engine (`zarr_python_save`, `zarr_python_load`) hand zarr-python a store per
node: a local path on local disks, or one ``zarr.storage.ObjectStore`` per S3 storage (one
obstore client, its connection pool shared by every array of the checkpoint). A writable store
records the digest of every file it writes or object it PUTs, from the very bytes it sends, so
the checksum manifest needs no second read or download. Errors the S3 client raises inside
zarr-python leave as the storage's errors, naming the URL with credentials redacted.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Optional, Tuple

import zarr

from dist_ckpt.backends.zarr.layout import s3_storage
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.integrity.checksums import FileDigest, bytes_digest
from dist_ckpt.storage.object_path import ObjectPath

__all__ = ["ENGINE", "Stores", "as_storage_errors", "client_error"]

#: how the engine's errors name it (e.g. when a checkpoint's storage is refused)
ENGINE = "the zarr backend (zarr-python)"


class Stores:
    """Where zarr-python finds a node: a local path (storages with ``local_paths``), or a path
    under one ``ObjectStore`` per S3 storage (one client, its connection pool shared by every
    array of the checkpoint).

    A writable store records the digest of every object it PUTs or file it writes (``digests``,
    by node), from the very bytes it sends, so that the checksum manifest needs no download or
    second read."""

    def __init__(self, read_only: bool) -> None:
        self.read_only = read_only
        self.digests: Dict[ObjectPath, FileDigest] = {}
        self._object_stores: Dict[str, Any] = {}

    def at(self, node: ObjectPath) -> Tuple[Any, str]:
        """``(store, path)`` of ``node`` for ``zarr.open_array(store=..., path=...)``."""
        if node.storage.local_paths:
            if self.read_only:
                return str(node.local_path()), ""
            return _recording_local_store(node, self.digests), ""
        url = node.storage.url
        if url not in self._object_stores:
            obstore_store = s3_storage(node).obstore_store()
            if self.read_only:
                self._object_stores[url] = zarr.storage.ObjectStore(obstore_store, read_only=True)
            else:
                self._object_stores[url] = _recording_store(obstore_store, ObjectPath(node.storage), self.digests)
        return self._object_stores[url], node.key


def client_error(node: ObjectPath, error: BaseException, operation: str) -> Optional[BaseException]:
    """The storage error for ``error`` if it is the S3 client's (raised inside zarr-python while
    it read or wrote objects under ``node``), naming the URL, credentials redacted; else None."""
    if not node.storage.s3_compatible or isinstance(error, CheckpointingException):
        return None
    try:
        import obstore
    except ImportError:  # pragma: no cover -- an S3 node needs obstore
        return None
    if not isinstance(error, (obstore.exceptions.BaseError, OSError)):
        return None
    return s3_storage(node).storage_error(error, operation, node.key)


@contextlib.contextmanager
def as_storage_errors(node: ObjectPath, operation: str) -> Iterator[None]:
    """Raise the S3 client's errors from inside zarr-python as storage errors (see
    `client_error()`); everything else unchanged."""
    try:
        yield
    except Exception as e:
        typed = client_error(node, e, operation)
        if typed is None:
            raise
        raise typed from e


def _recording_local_store(node: ObjectPath, digests: Dict[ObjectPath, FileDigest]) -> Any:
    """A writable ``zarr.storage.LocalStore`` at ``node`` that records the digest of each file it
    writes, from the bytes it writes: the checksum manifest then needs no second read of every
    chunk (which cost a save as much as a read of the whole checkpoint from the page cache)."""

    class _Recording(zarr.storage.LocalStore):
        async def set(self, key: str, value: Any) -> None:
            await super().set(key, value)
            digests[node / key] = bytes_digest(value.as_numpy_array())

    return _Recording(str(node.local_path()), read_only=False)


def _recording_store(obstore_store: Any, root: ObjectPath, digests: Dict[ObjectPath, FileDigest]) -> Any:
    """A writable ``zarr.storage.ObjectStore`` that records the digest of each object it PUTs."""

    class _Recording(zarr.storage.ObjectStore):  # type: ignore[type-arg]
        async def set(self, key: str, value: Any) -> None:
            await super().set(key, value)
            digests[root / key] = bytes_digest(value.as_numpy_array())

    return _Recording(obstore_store, read_only=False)
