"""HuggingFace interoperability: HF-format checkpoints (safetensors), partial loads, export.

* `index` -- shard indexes and tied parameters: ``make_shard_index``, ``save_shard_index``,
  ``load_shard_index``, ``index_file_name``, ``create_sharing_metadata``, ``retie_parameters``;
* `io` -- whole checkpoints from modules or dicts: ``save_checkpoint``,
  ``load_checkpoint``, ``save_sharded_checkpoint``, ``load_sharded_checkpoint``;
* `partial` -- a process loads only what it owns: ``is_in_safetensors_format``,
  ``load_sharded_state_dict``, ``load_state_dict_to_shards``, ``save_sharded_model``,
  ``set_submodule``;
* `export` -- ``export(src, dst, max_shard_size, include=, exclude=, rename=, config=)``:
  the model weights of any dist_ckpt checkpoint to an HF folder (optimizer state left out by
  default; `select` decides which keys and under which names);
* `strategy` -- the ``("hf", 1)`` load strategies with which ``dist_ckpt.load`` reads an HF
  folder into a sharded state dict, each rank reading only its slices.

Only safetensors is read and written; ``.bin`` (pickle) checkpoints are refused with an error
that says why (loading one would run code from the file).

Example:

```python
from dist_ckpt import hf
hf.save_checkpoint("out/model", model, max_shard_size=2**30)
state = hf.load_checkpoint("out/model", None, keys={"lm_head.weight"})
hf.export("ckpt/iter_1000", "hf/iter_1000", rename={"model.": ""}, config="config.json")
```
"""

from dist_ckpt.hf.export import ExportResult, export
from dist_ckpt.hf.index import (
    ShardIndex,
    SharingMetadataT,
    StateDictLike,
    create_sharing_metadata,
    index_file_name,
    load_shard_index,
    make_shard_index,
    retie_parameters,
    save_shard_index,
)
from dist_ckpt.hf.io import load_checkpoint, load_sharded_checkpoint, save_checkpoint, save_sharded_checkpoint
from dist_ckpt.hf.partial import (
    is_in_safetensors_format,
    load_sharded_state_dict,
    load_state_dict_to_shards,
    save_sharded_model,
    set_submodule,
)
from dist_ckpt.hf.select import is_optimizer_key, rename_keys, select_keys
from dist_ckpt.hf.strategy import HFCommonLoadStrategy, HFLoadShardedStrategy

__all__ = [
    "ExportResult",
    "HFCommonLoadStrategy",
    "HFLoadShardedStrategy",
    "ShardIndex",
    "SharingMetadataT",
    "StateDictLike",
    "create_sharing_metadata",
    "export",
    "index_file_name",
    "is_in_safetensors_format",
    "is_optimizer_key",
    "load_checkpoint",
    "load_shard_index",
    "load_sharded_checkpoint",
    "load_sharded_state_dict",
    "load_state_dict_to_shards",
    "make_shard_index",
    "rename_keys",
    "retie_parameters",
    "save_checkpoint",
    "save_shard_index",
    "save_sharded_checkpoint",
    "save_sharded_model",
    "select_keys",
    "set_submodule",
]
