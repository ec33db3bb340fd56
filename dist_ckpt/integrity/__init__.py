"""crc32c checksums of stored bytes, integrity records and the safe JSON reader (pure: no I/O of their own)."""
