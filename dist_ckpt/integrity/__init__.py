"""crc32c checksums of stored bytes and the whole-checkpoint verifier."""
