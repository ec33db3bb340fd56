"""Where checkpoint bytes go: a local directory or an S3-compatible object store, one interface.

[`Storage`][dist_ckpt.storage.base.Storage] (``base.py``) is the interface: whole-object writes, streaming writers,
create-if-absent for the commit marker, concurrent ranged reads and positional readers into
caller buffers, list, delete, with declared capabilities for what only a local disk can do
(``local_paths``, ``positional_reads``, ...). [`LocalStorage`][dist_ckpt.storage.local.LocalStorage] (``local.py``)
keeps files on disk with atomic renames, fsync and ``os.preadv``; ``S3Storage`` (``s3.py``, the ``s3``
extra) talks to S3 through obstore and is imported only when an ``s3://`` URL is opened.
[`open_storage()`][dist_ckpt.storage.base.open_storage] picks one from a path or URL; ``location.py`` does the same for
the entry points. ``files.py`` writes and reads local files durably, ``paths.py`` holds the rules for
keys, ``ranges.py`` buffers and byte ranges,
``stats.py`` the I/O counters, ``object_path.py`` a path-like view of keys.
"""

from dist_ckpt.storage.base import S3_SCHEMES, ObjectInfo, ObjectReader, ObjectWriter, Storage, open_storage
from dist_ckpt.storage.errors import (
    BucketNotFoundError,
    NotARegularFileError,
    ObjectExistsError,
    ObjectNotFoundError,
    RetriesExhaustedError,
    StorageAuthError,
    StorageConfigError,
    StorageError,
    TruncatedObjectError,
)
from dist_ckpt.storage.files import (
    FileReader,
    atomic_write,
    check_regular,
    fsync_dir,
    fsync_file,
    make_dirs,
    open_regular,
    preadv_into,
    write_bytes_atomic,
)
from dist_ckpt.storage.local import LocalStorage, LocalStorageOptions
from dist_ckpt.storage.paths import (
    confined,
    decode_key,
    encode_key,
    is_shortened,
    safe_join,
    validate_key,
    validate_object_key,
    validate_prefix,
)
from dist_ckpt.storage.ranges import BufferLike, RangeRead
from dist_ckpt.storage.stats import IOStats

__all__ = [
    "S3_SCHEMES",
    "BucketNotFoundError",
    "BufferLike",
    "FileReader",
    "IOStats",
    "LocalStorage",
    "LocalStorageOptions",
    "NotARegularFileError",
    "ObjectExistsError",
    "ObjectInfo",
    "ObjectNotFoundError",
    "ObjectReader",
    "ObjectWriter",
    "RangeRead",
    "RetriesExhaustedError",
    "Storage",
    "StorageAuthError",
    "StorageConfigError",
    "StorageError",
    "TruncatedObjectError",
    "atomic_write",
    "check_regular",
    "confined",
    "decode_key",
    "encode_key",
    "is_shortened",
    "fsync_dir",
    "fsync_file",
    "make_dirs",
    "open_regular",
    "open_storage",
    "preadv_into",
    "safe_join",
    "validate_key",
    "validate_object_key",
    "validate_prefix",
    "write_bytes_atomic",
]
