"""Errors of the storage layer, members of the [`CheckpointingException`][dist_ckpt.errors.CheckpointingException]
family.

Each also inherits the builtin a caller would catch for the same problem on a local disk
(``FileNotFoundError``, ``FileExistsError``, ``PermissionError``, ``OSError``, ``ValueError``),
names the object (``s3://bucket/key`` or a path) and the operation, and says how to fix it.
Messages never contain credentials: the S3 implementation redacts them before raising.
"""

from __future__ import annotations

from typing import Optional

from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError

__all__ = [
    "BucketNotFoundError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "RetriesExhaustedError",
    "StorageAuthError",
    "StorageConfigError",
    "StorageError",
    "TruncatedObjectError",
]


class StorageError(CheckpointingException, OSError):
    """A storage operation failed (the base of the errors below).

    Attributes:
        url: the object or prefix concerned (``s3://bucket/key`` or a local path).
        operation: what was attempted (``"GET"``, ``"PUT"``, ``"LIST"``, ...).
    """

    def __init__(self, message: str, *, url: str = "", operation: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.url = url
        self.operation = operation

    def __str__(self) -> str:  # OSError would format (errno, strerror) tuples; keep the message
        return self.message


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


class StorageConfigError(CheckpointingException, ValueError):
    """A storage URL, key or option is malformed (e.g. ``s3://`` without a bucket, part size below 5 MiB)."""


class TruncatedObjectError(CorruptCheckpointError):
    """An object holds fewer bytes than a ranged read asked for: it was truncated or the index lies.

    A [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError], so loaders treat a short object on S3
    exactly like a short file on disk.
    """
