"""Load strategies that let ``dist_ckpt.load`` read HuggingFace folders like any checkpoint.

A folder with ``model.safetensors`` or ``model.safetensors.index.json`` and no ``metadata.json``
is read with the built-in backend ``("hf", 1)`` (see
[`dist_ckpt.record.commit.detect_config()`][dist_ckpt.record.commit.detect_config]): each rank asks for the slices its
ShardedTensors describe -- any TP split, flattened ranges, prepended axes -- and reads only those bytes, in place, from
the files that hold them. The common state of such a checkpoint is empty, and it holds no ShardedObjects.

Example:

```python
sd = {"embed": ShardedTensor.from_rank_offsets("model.embed_tokens.weight", local, (0, tp_rank, tp))}
dist_ckpt.load(sd, "Llama-3-8B")                       # reads this rank's rows only
tied = HFLoadShardedStrategy(aliases={"lm_head.weight": "model.embed_tokens.weight"})
dist_ckpt.load(sd, path, sharded_strategy=tied)
```
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar, Dict, List, Mapping, Optional, Tuple

from dist_ckpt.backends.base import LoadCommonStrategy, LoadShardedStrategy
from dist_ckpt.backends.request_checks import refuse_sharded_objects
from dist_ckpt.backends.safetensors import ReadOptions, describe_tensor_index, load_from_index, tensors_metadata
from dist_ckpt.backends.stored_shards import StoredShardInfo
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import KeyMismatchError, format_keys
from dist_ckpt.hf.folder import HFFolder, open_folder
from dist_ckpt.model.dict_utils import nested_values
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor, StateDict
from dist_ckpt.storage import Storage
from dist_ckpt.storage.location import LocationLike, require_local, resolve_location

__all__ = ["HF_BACKEND", "HFCommonLoadStrategy", "HFLoadShardedStrategy"]

HF_BACKEND = ("hf", 1)


class HFLoadShardedStrategy(LoadShardedStrategy):
    """Reads slices of the tensors of a HuggingFace folder into ShardedTensors.

    Args:
        options: read threads and buffer sizes; ``allow_dtype_cast`` (default True) converts
            tensors stored in another dtype than the requested one.
        aliases: tied names absent from the files -> the stored name (for checkpoints that omit
            tied weights without recording the tie; recorded ties are used anyway).

    Example:

    ```python
    strategy = HFLoadShardedStrategy(aliases={"lm_head.weight": "model.embed_tokens.weight"})
    dc.load(sharded_state_dict, "Llama-3-8B", sharded_strategy=strategy)
    ```
    """

    supported_backends: ClassVar[Tuple[str, ...]] = (HF_BACKEND[0],)
    supported_versions: ClassVar[Tuple[int, ...]] = (HF_BACKEND[1],)

    def __init__(self, options: Optional[ReadOptions] = None, aliases: Optional[Mapping[str, str]] = None) -> None:
        self.options = options or ReadOptions()
        self.aliases: Dict[str, str] = dict(aliases or {})

    def _folder(self, checkpoint_dir: LocationLike) -> HFFolder:
        folder = open_folder(require_local(resolve_location(checkpoint_dir), "reading a HuggingFace folder"))
        folder.extra_aliases.update(self.aliases)
        return folder

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> StateDict:
        folder = self._folder(checkpoint_dir)
        keys = [sh.key for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)]
        available = set(folder.names())
        absent = sorted({k for k in keys if k not in available})
        if absent:
            raise KeyMismatchError(
                f"[rank {get_rank()}] tensors requested by load but absent from HuggingFace checkpoint "
                f"{resolve_location(checkpoint_dir).url!r}: {format_keys(absent)}",
                unexpected_keys=absent,
            )
        index = folder.tensor_index(keys)
        return load_from_index(sharded_state_dict, index, self.options)

    def with_dtype_cast(self, allow: bool) -> "HFLoadShardedStrategy":
        """This loader with ``ReadOptions.allow_dtype_cast`` set to ``allow``."""
        if self.options.allow_dtype_cast == allow:
            return self
        return HFLoadShardedStrategy(replace(self.options, allow_dtype_cast=allow), self.aliases)

    def load_tensors_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        return tensors_metadata(self._folder(checkpoint_dir).tensor_index())

    def describe_stored_shards(self, checkpoint_dir: Storage) -> Optional[Dict[str, List[StoredShardInfo]]]:
        """Each tensor is one whole piece in the file the index (or ``model.safetensors``) names."""
        return describe_tensor_index(self._folder(checkpoint_dir).tensor_index())


class HFCommonLoadStrategy(LoadCommonStrategy):
    """The common part of a HuggingFace folder: an empty state, and no ShardedObjects."""

    supported_backends: ClassVar[Tuple[str, ...]] = (HF_BACKEND[0],)
    supported_versions: ClassVar[Tuple[int, ...]] = (HF_BACKEND[1],)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def load_common(self, checkpoint_dir: Storage) -> StateDict:
        return {}

    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Storage) -> StateDict:
        return refuse_sharded_objects(
            sharded_objects_state_dict,
            f"HuggingFace checkpoint {resolve_location(checkpoint_dir).url!r} holds tensors only",
        )

    def load_sharded_metadata(self, checkpoint_dir: Storage) -> ShardedStateDict:
        return {}
