"""A backend-neutral description of how each tensor of a checkpoint is stored.

``dist-ckpt inspect`` shows, for every tensor, how many pieces it was saved in, their shape (or
flattened ranges) and the files that hold them, whatever the backend. A load strategy provides
this through [`describe_stored_shards()`][dist_ckpt.backends.base.LoadShardedStrategy.describe_stored_shards],
returning [`StoredShardInfo`][dist_ckpt.backends.stored_shards.StoredShardInfo] records built from its metadata alone
(no tensor data is read). Each backend builds them from its own metadata: the safetensors backend (and HuggingFace
folders) in `dist_ckpt.backends.safetensors.index.describe_tensor_index()`, the zarr backend
in `dist_ckpt.backends.zarr.metadata.describe_zarr()`.

Example:

```python
strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, "safetensors", 1)
shards = strategy.describe_stored_shards(LocalStorage("ckpt/iter_1000"))
shards["decoder.w"][0].file     # "safetensors/rank00000_0.safetensors"
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from dist_ckpt.errors import CorruptCheckpointError, InvalidKeyError
from dist_ckpt.storage import validate_key

__all__ = ["StoredShardInfo", "stored_key"]

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class StoredShardInfo:
    """One stored piece of a tensor.

    Attributes:
        global_offset: offset of the piece's box in the global tensor.
        shape: shape of the box (every global axis).
        flat_range: ``(start, stop)`` of the box's row-major flattening the piece holds (a
            distributed-optimizer shard), or None for the whole box.
        file: the file (or, for a zarr fragment, the directory) holding it, relative to the
            checkpoint directory, ``/``-separated.
        nbytes: bytes stored for it.
    """

    global_offset: Shape
    shape: Shape
    flat_range: Optional[Tuple[int, int]]
    file: str
    nbytes: int

    def to_json(self) -> Dict[str, Any]:
        """A JSON-serializable dict (``dist-ckpt inspect --json --shards``)."""
        return {
            "global_offset": list(self.global_offset),
            "shape": list(self.shape),
            "flat_range": None if self.flat_range is None else list(self.flat_range),
            "file": self.file,
            "nbytes": self.nbytes,
        }


def stored_key(key: str, where: str) -> str:
    """``key``, read from the checkpoint file ``where``, once the key validator accepts it.

    Every key a loader reads from a file (a ``zarr.json``, the safetensors index, DCP's
    ``.metadata``) is returned to callers (``load_tensors_metadata``, ``unshard``, ``convert``)
    who may use it as a path: a key a save would refuse (``../../x``) is damage.

    Raises:
        CorruptCheckpointError: from the validator's [`InvalidKeyError`][dist_ckpt.errors.InvalidKeyError].

    Example:

    ```python
    stored_key("decoder.w", "ckpt/zarr/decoder.w/zarr.json")    # "decoder.w"
    ```
    """
    try:
        validate_key(key)
    except InvalidKeyError as e:
        raise CorruptCheckpointError(f"{where} holds a key no save writes: {e}") from e
    return key
