"""Errors of the storage layer, members of the [`CheckpointingException`][dist_ckpt.errors.CheckpointingException]
family.

Each also inherits the builtin a caller would catch for the same problem on a local disk
(``FileNotFoundError``, ``FileExistsError``, ``PermissionError``, ``OSError``, ``ValueError``),
names the object (``s3://bucket/key`` or a path) and the operation, and says how to fix it.
Messages never contain credentials: the S3 implementation redacts them before raising.
"""

from __future__ import annotations

import errno as errno_codes
import os
from typing import Optional

from dist_ckpt.errors import AsyncSaveError, CheckpointingException, CorruptCheckpointError, with_rank

__all__ = [
    "AsyncStorageError",
    "BucketNotFoundError",
    "NotARegularFileError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "RetriesExhaustedError",
    "StorageAuthError",
    "StorageConfigError",
    "StorageError",
    "TruncatedObjectError",
    "storage_error_in",
    "write_failed",
]


class StorageError(CheckpointingException, OSError):
    """A storage operation failed (the base of the errors below).

    A failed write of a local file (a full disk, a quota, an I/O error) is one too, made by
    `write_failed()`: its ``errno`` is that of the ``OSError`` it replaces (``ENOSPC`` for a
    full disk), which is its cause.

    Attributes:
        url: the object or prefix concerned (``s3://bucket/key`` or a local path).
        operation: what was attempted (``"GET"``, ``"PUT"``, ``"LIST"``, ...).
        wanted_bytes: for a failed write, how many bytes it was writing (None otherwise).
    """

    def __init__(self, message: str, *, url: str = "", operation: str = "", wanted_bytes: Optional[int] = None) -> None:
        super().__init__(message)
        self.message = message
        self.url = url
        self.operation = operation
        self.wanted_bytes = wanted_bytes

    def __str__(self) -> str:  # OSError would format (errno, strerror) tuples; keep the message
        return self.message

    def at_rank(self, rank: int) -> "StorageError":
        """This error with its message prefixed by ``[rank N]`` (unchanged if it names a rank):
        the storage layer does not know ranks, the engine that runs its writes adds it.

        Example:

        ```python
        raise error.at_rank(get_rank()) from error
        ```
        """
        return self if self.message.startswith("[rank") else self.reworded(with_rank(self.message, rank))

    def reworded(self, message: str) -> "StorageError":
        """A new error of this type and attributes with ``message`` (a `StorageError` where the
        type's constructor takes other arguments), for a caller that says more (which tensor
        the file was for); raise it ``from`` this one.

        Example:

        ```python
        raise error.reworded(f"writing the zarr files of 'w': {error}") from error
        ```
        """
        try:
            error = type(self)(message, url=self.url, operation=self.operation, wanted_bytes=self.wanted_bytes)
        except TypeError:  # a subclass with a constructor of its own
            error = StorageError(message, url=self.url, operation=self.operation, wanted_bytes=self.wanted_bytes)
        error.errno = self.errno
        return error


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object (or local file) does not exist."""


class BucketNotFoundError(StorageError, FileNotFoundError):
    """The bucket of an ``s3://bucket/...`` URL does not exist (or is not visible to these credentials)."""


class ObjectExistsError(StorageError, FileExistsError):
    """A create-if-absent write (``put_if_absent``) found the object already there."""


class StorageAuthError(StorageError, PermissionError):
    """The server refused the credentials (unknown key, wrong secret, expired token, access denied)."""


class RetriesExhaustedError(StorageError):
    """A request kept failing with transient errors (5xx, throttling, connection errors) until the
    retry bound was reached.

    Attributes:
        attempts: how many times the request was sent.
        last_status: HTTP status of the last response, or None when no response arrived
            (connection refused, timeout).
    """

    def __init__(
        self, message: str, *, url: str = "", operation: str = "", attempts: int = 0, last_status: Optional[int] = None
    ) -> None:
        super().__init__(message, url=url, operation=operation)
        self.attempts = attempts
        self.last_status = last_status


class AsyncStorageError(AsyncSaveError, StorageError):
    """The background part of an asynchronous save failed to write (a full disk, an I/O error):
    both an [`AsyncSaveError`][dist_ckpt.errors.AsyncSaveError] (what an asynchronous save raises) and
    a [`StorageError`][dist_ckpt.storage.errors.StorageError] (what a write that fails raises), so
    that ``except StorageError`` catches a failed write whether the save was synchronous or not."""


#: what to do about a write that failed with these ``errno`` values
_WRITE_HINTS = {
    errno_codes.ENOSPC: "the file system is full: free space on it, or save to another location",
    errno_codes.EDQUOT: "the disk quota is exhausted: free space within it, or save to another location",
    errno_codes.EROFS: "the file system is read-only: save to another location",
    errno_codes.EACCES: "this process may not write there: fix the permissions, or save to another location",
}


def write_failed(
    error: OSError,
    url: str,
    wanted_bytes: Optional[int] = None,
    *,
    offset: Optional[int] = None,
    operation: str = "write",
) -> StorageError:
    """The `StorageError` for a local write of ``url`` that failed with ``error``: the one message
    of every failed write (the file, the bytes it wanted, at which byte, why and what to do); its
    ``errno`` is ``error``'s. Raise it ``from error``. An error of the family is returned as it is.

    Example:

    ```python
    try:
        os.write(fd, data)
    except OSError as e:
        raise write_failed(e, path, len(data), offset=position) from e
    ```
    """
    if isinstance(error, StorageError):
        return error
    amount = f"{wanted_bytes} bytes" if wanted_bytes is not None else "data"
    at = f" at byte {offset}" if offset is not None else ""
    reason = error.strerror or str(error) or type(error).__name__
    code = f" [errno {errno_codes.errorcode.get(error.errno, error.errno)}]" if error.errno else ""
    hint = _WRITE_HINTS.get(error.errno or 0)
    message = f"{operation} of {amount}{at} to {url} failed: {reason}{code}" + (f" ({hint})" if hint else "")
    storage_error = StorageError(message, url=url, operation=operation, wanted_bytes=wanted_bytes)
    storage_error.errno = error.errno
    storage_error.strerror = error.strerror
    return storage_error


def storage_error_in(
    error: BaseException, url: Optional[str] = None, wanted_bytes: Optional[int] = None
) -> Optional[StorageError]:
    """``error`` if it is a `StorageError`, else a copy of the one it was caused by (a new error, so
    that it can be raised ``from error``), else one made by `write_failed()`
    from the raw ``OSError`` it is or was caused by (of ``url``, default the file the ``OSError``
    names, and ``wanted_bytes``), else None. For writes that pass through code not ours
    (``torch.save`` and DCP's writer turn an ``OSError`` of their stream into a ``RuntimeError``),
    so that they still surface as a ``StorageError``.

    Example:

    ```python
    except Exception as e:
        found = storage_error_in(e)
        if found is not None:
            raise found from e
        raise
    ```
    """
    seen: Optional[BaseException] = error
    raw: Optional[OSError] = None
    visited = set()
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        if isinstance(seen, StorageError):
            return seen if seen is error else seen.reworded(seen.message)
        if isinstance(seen, CheckpointingException):
            return None  # a problem of its own kind, caused by an OSError it describes
        if raw is None and isinstance(seen, OSError):
            raw = seen
        seen = seen.__cause__ or seen.__context__
    if raw is None:
        return None
    if url is None:
        url = os.fsdecode(raw.filename) if raw.filename is not None else "a file"
    return write_failed(raw, url, wanted_bytes)


class StorageConfigError(CheckpointingException, ValueError):
    """A storage URL, key or option is malformed (e.g. ``s3://`` without a bucket, part size below 5 MiB)."""


class TruncatedObjectError(CorruptCheckpointError):
    """An object holds fewer bytes than a ranged read asked for: it was truncated or the index lies.

    A [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError], so loaders treat a short object on S3
    exactly like a short file on disk.
    """


class NotARegularFileError(CorruptCheckpointError):
    """A file to be read is not a regular file (a FIFO, a socket, a device): it is not opened for
    reading, since reading a FIFO blocks until something writes to it -- forever, in a checkpoint.

    A [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError]: no save writes one.
    """
