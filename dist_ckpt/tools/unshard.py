"""Full (unsharded) tensors from any checkpoint, in one process, without a process group.

A checkpoint saved by N ranks holds each tensor in pieces. [`iter_unsharded()`][dist_ckpt.tools.unshard.iter_unsharded]
yields the whole tensors one at a time -- each is read, assembled and handed over before the next one is
allocated -- so a consumer that writes them elsewhere (an export, a conversion) needs memory for
one tensor, not for the state. [`unshard()`][dist_ckpt.tools.unshard.unshard] collects them into a dict. Both work for
every registered backend (they use its load strategy, asking for each tensor whole), for checkpoints
on object stores (``s3://bucket/prefix``) and for HuggingFace folders (``model.safetensors`` or an
index), which ``dist_ckpt.load`` also reads.

Example:

```python
import dist_ckpt as dc
full = dc.unshard("ckpt/iter_1000", keys=["embedding.word_embeddings.weight"])
for key, tensor in dc.iter_unsharded("ckpt/iter_1000"):
    writer.add(key, tensor)   # one tensor in memory at a time
```
"""

from __future__ import annotations

import logging
from typing import Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch

from dist_ckpt.backends.base import LoadShardedStrategy
from dist_ckpt.backends.registry import StrategySpec
from dist_ckpt.engine.checks.compatibility import verify_checkpoint_and_load_strategy
from dist_ckpt.errors import KeyMismatchError, format_keys
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.storage import Storage
from dist_ckpt.storage.location import LocationLike, resolve_location

__all__ = ["iter_unsharded", "unshard", "unsharded_metadata"]

logger = logging.getLogger(__name__)

Device = Union[str, torch.device]


def unsharded_metadata(
    checkpoint_dir: LocationLike, sharded_strategy: StrategySpec = None
) -> Tuple[LoadShardedStrategy, Dict[str, ShardedTensor]]:
    """The checkpoint's load strategy and ``{key: ShardedTensor}`` (global shape and dtype, no
    data) of every stored tensor, read from the metadata alone.

    Example:

    ```python
    strategy, meta = unsharded_metadata("ckpt/iter_1000")
    sizes = {k: sh.global_shape for k, sh in meta.items()}
    ```
    """
    location = resolve_location(checkpoint_dir)
    strategy, _ = verify_checkpoint_and_load_strategy(location, sharded_strategy)
    metadata = strategy.load_tensors_metadata(location)
    return strategy, {k: v for k, v in metadata.items() if isinstance(v, ShardedTensor)}


def _select(metadata: Dict[str, ShardedTensor], keys: Optional[Iterable[str]], checkpoint_dir: Storage) -> List[str]:
    if keys is None:
        return sorted(metadata)
    wanted = list(dict.fromkeys(keys))
    absent = [k for k in wanted if k not in metadata]
    if absent:
        raise KeyMismatchError(
            f"keys {format_keys(absent)} are not stored in checkpoint {checkpoint_dir.url!r} "
            f"(it holds {len(metadata)} tensors, e.g. {format_keys(list(metadata)[:5])})",
            unexpected_keys=absent,
        )
    return wanted


def iter_unsharded(
    checkpoint_dir: LocationLike,
    keys: Optional[Iterable[str]] = None,
    device: Device = "cpu",
    sharded_strategy: StrategySpec = None,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(key, full tensor)`` for the stored tensors, one at a time.

    Steps: read the checkpoint's metadata and pick its load strategy; check that every
    requested key exists (before reading anything); then, per key, allocate the full tensor on
    ``device`` and have the strategy fill it in place.

    Args:
        checkpoint_dir: a committed dist_ckpt checkpoint (a directory, an ``s3://`` URL or a
            storage), or a HuggingFace folder.
        keys: the keys to yield, in this order (default: every stored tensor, sorted by key).
        device: where the tensors are allocated.
        sharded_strategy: a load strategy or ``(backend, version)`` instead of the registered one.

    Raises:
        KeyMismatchError: a requested key is not stored (nothing is read then).

    Example:

    ```python
    for key, tensor in iter_unsharded("ckpt/iter_1000", device="cuda"):
        print(key, tuple(tensor.shape))
    ```
    """
    location = resolve_location(checkpoint_dir)
    strategy, metadata = unsharded_metadata(location, sharded_strategy)
    selected = _select(metadata, keys, location)
    return iter_with(strategy, metadata, selected, location, device)


def iter_with(
    strategy: LoadShardedStrategy,
    metadata: Dict[str, ShardedTensor],
    keys: Iterable[str],
    checkpoint_dir: Storage,
    device: Device = "cpu",
) -> Iterator[Tuple[str, torch.Tensor]]:
    """[`iter_unsharded()`][dist_ckpt.tools.unshard.iter_unsharded] with the strategy and metadata already at hand (for
    callers that iterate over several groups of keys, such as the HF export)."""
    for key in keys:
        meta = metadata[key]
        dest = torch.empty(meta.global_shape, dtype=meta.dtype, device=device)
        tensor = strategy.load({key: ShardedTensor.from_rank_offsets(key, dest)}, checkpoint_dir)[key]
        del dest  # the generator keeps no reference of its own while the consumer holds the tensor...
        logger.debug("unsharded %r %s %s", key, tuple(meta.global_shape), meta.dtype)
        yield key, tensor
        del tensor  # ...nor once it asks for the next one: one tensor is alive at a time


def unshard(
    checkpoint_dir: LocationLike,
    keys: Optional[Iterable[str]] = None,
    device: Device = "cpu",
    sharded_strategy: StrategySpec = None,
) -> Dict[str, torch.Tensor]:
    """Every stored tensor (or ``keys``), whole, keyed by its checkpoint key.

    Needs no process group and works for every backend; see [`iter_unsharded()`][dist_ckpt.tools.unshard.iter_unsharded]
    to stream the tensors with memory for one at a time.

    Example:

    ```python
    state = unshard("ckpt/iter_1000", keys=["decoder.final_layernorm.weight"])
    ```
    """
    return dict(iter_unsharded(checkpoint_dir, keys, device, sharded_strategy))
