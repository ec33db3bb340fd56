"""Where checkpoint bytes go: a local directory or an S3-compatible object store.

:class:`Storage` (``base.py``) is the interface: whole-object writes, streaming writers,
create-if-absent for the commit marker, concurrent ranged reads into caller buffers, list,
delete, with declared capabilities. :class:`LocalStorage` (``local.py``) keeps files on disk with
atomic renames and fsync; ``S3Storage`` (``s3.py``, the ``s3`` extra) talks to S3 through
obstore and is imported only when an ``s3://`` URL is opened. :func:`open_storage` picks one
from a path or URL. ``paths.py`` turns checkpoint keys into safe names.
"""

from dist_ckpt.storage.base import (
    IOStats,
    ObjectInfo,
    ObjectWriter,
    RangeRead,
    Storage,
    open_storage,
    validate_object_key,
)
from dist_ckpt.storage.errors import (
    BucketNotFoundError,
    ObjectExistsError,
    ObjectNotFoundError,
    RetriesExhaustedError,
    StorageAuthError,
    StorageConfigError,
    StorageError,
    TruncatedObjectError,
)
from dist_ckpt.storage.local import (
    LocalStorage,
    LocalStorageOptions,
    atomic_write,
    fsync_dir,
    fsync_file,
    write_bytes_atomic,
)
from dist_ckpt.storage.paths import decode_key, encode_key, is_shortened, safe_join, validate_key

__all__ = [
    "BucketNotFoundError",
    "IOStats",
    "LocalStorage",
    "LocalStorageOptions",
    "ObjectExistsError",
    "ObjectInfo",
    "ObjectNotFoundError",
    "ObjectWriter",
    "RangeRead",
    "RetriesExhaustedError",
    "Storage",
    "StorageAuthError",
    "StorageConfigError",
    "StorageError",
    "TruncatedObjectError",
    "atomic_write",
    "decode_key",
    "encode_key",
    "is_shortened",
    "fsync_dir",
    "fsync_file",
    "open_storage",
    "safe_join",
    "validate_key",
    "validate_object_key",
    "write_bytes_atomic",
]
