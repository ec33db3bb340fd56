"""The commit record: ``metadata.json`` (names, ``CheckpointingConfig``) and its integrity records."""
