"""Where checkpoint bytes go: safe names for keys, atomic and durable local writes."""

from .local import atomic_write, fsync_dir, fsync_file, write_bytes_atomic
from .paths import decode_key, encode_key, is_shortened, safe_join, validate_key

__all__ = [
    "atomic_write",
    "decode_key",
    "encode_key",
    "is_shortened",
    "fsync_dir",
    "fsync_file",
    "safe_join",
    "validate_key",
    "write_bytes_atomic",
]
