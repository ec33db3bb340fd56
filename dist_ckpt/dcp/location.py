"""The checkpoint a DCP storage writer or reader works on: shared by `StorageWriter` and
`StorageReader`, which DCP re-targets with ``reset(checkpoint_id)``."""

from __future__ import annotations

import os
from typing import Optional, Union

from dist_ckpt.storage import Storage, open_storage
from dist_ckpt.storage.base import StorageOptions
from dist_ckpt.storage.location import LocationLike


class CheckpointLocation:
    """A checkpoint location, opened as a `Storage` on first use in this process (a writer is
    pickled to DCP's async process without its connection)."""

    def __init__(self, path: LocationLike, storage_options: Optional[StorageOptions]) -> None:
        super().__init__()
        self._location: LocationLike = path
        self._options = storage_options
        self._storage: Optional[Storage] = None

    @property
    def storage(self) -> Storage:
        """The storage of the checkpoint (opened on first use, in this process)."""
        if self._storage is None:
            self._storage = open_storage(self._location, self._options)
        return self._storage

    def reset(self, checkpoint_id: Optional[LocationLike] = None) -> None:
        """Point at ``checkpoint_id`` (DCP's ``dcp.save(..., checkpoint_id=...)``), if given."""
        if checkpoint_id is not None:
            self._location = checkpoint_id
            self._storage = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, "os.PathLike[str]"]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike, Storage))
