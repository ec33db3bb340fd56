"""The common-state backend (``torch``, version 1): ``common.pt`` and ShardedObject files."""
