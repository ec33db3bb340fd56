"""A sharded state dict as tensors plus everything else: Megatron-Core's ``MCoreTensorAwareStateDict``.

Megatron-Core's local (in-memory, node-local) checkpoints, through NVIDIA Resiliency Extension's
checkpoint manager, need a state dict split into its tensors -- which the manager copies, sends
to other nodes and stores -- and the rest (the common state, the shards' descriptions). The
[`MCoreTensorAwareStateDict`][dist_ckpt.engine.tensor_aware.MCoreTensorAwareStateDict] is that
split, made from a model's sharded state dict with `from_state_dict()` and turned back into a
loaded state dict with `to_state_dict()`:

* ``algo="fully_parallel"``: a shard replicated on several ranks of the parallelization group is
  kept (has data) on one of them only -- the same distribution dist_ckpt's fully-parallel save
  uses (`determine_main_replica_uniform_distribution`) -- and at `to_state_dict()` the ranks
  exchange the shards each needs (``exchange_algo``); ``algo="atomic"``: every rank keeps its own;
* in between, the manager may `pop_tensors()` (the dict is then *hollow*: descriptions only) and
  `insert_tensors()` back, `copy_tensors_to_cpu()` and `restore_tensor_device()`, or
  `init_tensors()` (empty tensors to receive a restore).

This class does not derive from NVRx's ``TensorAwareStateDict`` (NVRx is not a dependency): it
has the same methods, and NVRx's manager uses it by them.

Example:

```python
tasd, distribution = MCoreTensorAwareStateDict.from_state_dict(model.sharded_state_dict(), algo="atomic")
tensors = tasd.pop_tensors()              # what the checkpoint manager stores
tasd.insert_tensors(tensors)              # after a restore
state_dict = tasd.to_state_dict(model.sharded_state_dict())
```
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Set, Tuple, Union

import torch

from dist_ckpt.collectives.distributed import ProcessGroup, get_rank
from dist_ckpt.engine.checks.strict import StrictHandling, parse_strict_flag, validate_integrity_and_strict_load
from dist_ckpt.engine.preprocess import load_preprocess, save_preprocess
from dist_ckpt.errors import ArgumentTypeError, KeyMismatchError, StateDictStructureError
from dist_ckpt.model.dict_utils import dict_list_map_inplace, dict_list_map_outplace, merge, nested_values
from dist_ckpt.model.factories import apply_factory_merges
from dist_ckpt.model.sharded import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from dist_ckpt.model.state_dict_utils import extract_sharded_base
from dist_ckpt.parallel.shard_distribution import (
    ShardDistribution,
    determine_main_replica_uniform_distribution,
    exchange_by_distribution,
    sharded_tensor_shard_id,
)

__all__ = ["MCoreTensorAwareStateDict"]

logger = logging.getLogger(__name__)

#: the split algorithms: every rank keeps its shards, or one rank of the group per shard
ALGORITHMS = ("atomic", "fully_parallel")

#: where a popped (or CPU-copied) tensor came from, kept on its ShardedTensor (Megatron-Core's attribute)
_ORIG_DEVICE = "orig_device"

#: what _get_distribution returns without a fully-parallel split (Megatron-Core's empty distribution)
_NO_DISTRIBUTION: Tuple[None, None, None, None] = (None, None, None, None)


def _check_algo(algo: str) -> None:
    if algo not in ALGORITHMS:
        raise ArgumentTypeError(f"MCoreTensorAwareStateDict: algo must be one of {ALGORITHMS}, got {algo!r}")


@dataclass
class MCoreTensorAwareStateDict:
    """A sharded state dict split into its tensors and the rest (see the module docstring).

    Attributes:
        common: the common (non-sharded) state.
        sharded_state_dict: the ShardedTensors and ShardedObjects (with data, or hollow).
    """

    common: StateDict
    sharded_state_dict: ShardedStateDict
    _is_hollow: bool = False

    # ------------------------------------------------------------------ making one

    @staticmethod
    def _validate_params(algo: str) -> None:
        _check_algo(algo)

    @staticmethod
    def _get_distribution(
        fully_parallel: bool,
        sharded_part: ShardedStateDict,
        parallelization_group: Optional[ProcessGroup],
        cached_distribution: Optional[ShardDistribution] = None,
    ) -> Union[Optional[ShardDistribution], Tuple[None, None, None, None]]:
        if not fully_parallel:
            return _NO_DISTRIBUTION
        if cached_distribution is not None:
            return cached_distribution
        return determine_main_replica_uniform_distribution(sharded_part, parallelization_group, True)

    @staticmethod
    def _remove_redundant_data(
        fully_parallel: bool,
        sharded_part: ShardedStateDict,
        shard_to_saving_rank: Optional[Dict[Any, int]],
        parallelization_group: Optional[ProcessGroup],
    ) -> None:
        if not fully_parallel or shard_to_saving_rank is None:
            return
        me = get_rank(parallelization_group)
        for sh in nested_values(sharded_part):
            if isinstance(sh, ShardedTensor) and shard_to_saving_rank[sharded_tensor_shard_id(sh)] != me:
                sh.data = None  # another rank of the group keeps this shard

    @classmethod
    def from_state_dict(
        cls,
        sharded_state_dict: ShardedStateDict,
        algo: str = "fully_parallel",
        parallelization_group: Optional[ProcessGroup] = None,
        cached_metadata: Optional[ShardDistribution] = None,
    ) -> Tuple["MCoreTensorAwareStateDict", Union[Optional[ShardDistribution], Tuple[None, None, None, None]]]:
        """Split ``sharded_state_dict`` (collective over ``parallelization_group``, None: all ranks).

        Factories are applied and the sharding validated as for a save (unless a cached
        distribution is given: the structure is then known to be valid).

        Args:
            sharded_state_dict: the model's (and optimizer's) sharded state dict.
            algo: ``"fully_parallel"`` or ``"atomic"`` (see the module docstring).
            parallelization_group: the group a fully-parallel split spreads replicas over.
            cached_metadata: the distribution an earlier call returned, for the same structure.

        Returns:
            The split, and the distribution to pass as ``cached_metadata`` next time (for
            ``"atomic"``, four Nones; None for a group of one rank).

        Raises:
            ArgumentTypeError: an unknown ``algo``.
        """
        cls._validate_params(algo)
        fully_parallel = algo == "fully_parallel"
        sharded_part, common = save_preprocess(sharded_state_dict, cached_metadata is None)
        distribution = cls._get_distribution(fully_parallel, sharded_part, parallelization_group, cached_metadata)
        if distribution is not None:
            cls._remove_redundant_data(fully_parallel, sharded_part, distribution[0], parallelization_group)
        return cls(common=common, sharded_state_dict=sharded_part), distribution

    # ------------------------------------------------------------------ the tensors

    @property
    def is_hollow(self) -> bool:
        """True when the tensors were popped and not inserted back."""
        return self._is_hollow

    def _require(self, hollow: bool, what: str) -> None:
        if self._is_hollow != hollow:
            state = "hollow (its tensors were popped)" if self._is_hollow else "not hollow"
            raise StateDictStructureError(
                f"[rank {get_rank()}] MCoreTensorAwareStateDict.{what}: the state dict is {state}"
            )

    @property
    def _sharded_tensors(self) -> Iterator[ShardedTensor]:
        """The ShardedTensors this rank keeps: with data, or (hollow) those that were popped."""
        for sh in nested_values(self.sharded_state_dict):
            if not isinstance(sh, ShardedTensor):
                continue
            if hasattr(sh, _ORIG_DEVICE) if self._is_hollow else sh.data is not None:
                yield sh

    @property
    def tensors(self) -> Iterator[torch.Tensor]:
        """The tensors this rank keeps, in a fixed order (that of `pop_tensors()`)."""
        self._require(False, "tensors")
        return (sh.data for sh in self._sharded_tensors if sh.data is not None)

    @property
    def common_state_dict(self) -> StateDict:
        """The common state."""
        return self.common

    def pop_tensors(self) -> List[torch.Tensor]:
        """Take the tensors out (the dict becomes hollow; their devices are remembered)."""
        self._require(False, "pop_tensors")
        popped = []
        for sh in list(self._sharded_tensors):
            assert sh.data is not None
            popped.append(sh.data)
            setattr(sh, _ORIG_DEVICE, sh.data.device.type)
            sh.data = None
        self._is_hollow = True
        return popped

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Put tensors back, in the order `pop_tensors()` gave them (the inverse of it).

        Raises:
            StateDictStructureError: not hollow, or not exactly as many tensors as were popped.
        """
        self._require(True, "insert_tensors")
        shards = list(self._sharded_tensors)
        tensors = list(tensor_data)
        if len(tensors) != len(shards):
            raise StateDictStructureError(
                f"[rank {get_rank()}] insert_tensors got {len(tensors)} tensors for the {len(shards)} popped"
            )
        for sh, t in zip(shards, tensors):
            if getattr(sh, _ORIG_DEVICE) == t.device.type:
                delattr(sh, _ORIG_DEVICE)  # back where it was; otherwise remembered for restore_tensor_device
            sh.data = t
        self._is_hollow = False

    def init_tensors(self) -> None:
        """Give every popped ShardedTensor an empty tensor on its original device (to restore into)."""
        self._require(True, "init_tensors")
        for sh in list(self._sharded_tensors):
            sh.init_data(getattr(sh, _ORIG_DEVICE))
            delattr(sh, _ORIG_DEVICE)
        self._is_hollow = False

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace the tensors with host copies (the originals are left intact; their devices
        remembered for `restore_tensor_device()`)."""
        self._require(False, "copy_tensors_to_cpu")
        for sh in self._sharded_tensors:
            assert sh.data is not None
            if sh.data.device.type == "cpu":
                if not hasattr(sh, _ORIG_DEVICE):
                    sh.data = sh.data.clone()
            else:
                if not hasattr(sh, _ORIG_DEVICE):
                    setattr(sh, _ORIG_DEVICE, sh.data.device.type)
                sh.data = sh.data.detach().to("cpu", non_blocking=non_blocking)

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move every tensor back to the device it was copied or popped from."""
        self._require(False, "restore_tensor_device")
        for sh in self._sharded_tensors:
            if hasattr(sh, _ORIG_DEVICE):
                assert sh.data is not None
                sh.data = sh.data.to(getattr(sh, _ORIG_DEVICE), non_blocking=non_blocking)
                delattr(sh, _ORIG_DEVICE)

    # ------------------------------------------------------------------ back to a state dict

    def _insert_sharded_data(
        self,
        fully_parallel: bool,
        sharded_part: ShardedStateDict,
        parallelization_group: Optional[ProcessGroup],
        exchange_algo: str,
    ) -> None:
        loaded: Dict[Any, torch.Tensor] = {}
        for sh in self._sharded_tensors:
            assert sh.data is not None
            loaded[sharded_tensor_shard_id(sh)] = sh.data
        if fully_parallel:
            distribution = self._get_distribution(True, sharded_part, parallelization_group)
            if distribution is not None and distribution[0] is not None:
                unloaded = {
                    sharded_tensor_shard_id(sh): sh
                    for sh in nested_values(sharded_part)
                    if isinstance(sh, ShardedTensor) and sharded_tensor_shard_id(sh) not in loaded
                }
                assert isinstance(distribution, ShardDistribution)
                loaded = exchange_by_distribution(loaded, unloaded, distribution, parallelization_group, exchange_algo)
        objects = {
            sh.unique_key: sh.data for sh in nested_values(self.sharded_state_dict) if isinstance(sh, ShardedObject)
        }

        def fill(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                shard = sharded_tensor_shard_id(x)
                if shard not in loaded:
                    raise KeyMismatchError(
                        f"[rank {get_rank()}] {x.key!r} at offset {tuple(x.global_offset)} is not in the tensor-aware "
                        f"state dict (it holds {len(loaded)} shards)"
                    )
                return loaded[shard]
            if isinstance(x, ShardedObject):
                if x.unique_key not in objects:
                    raise KeyMismatchError(
                        f"[rank {get_rank()}] {x.unique_key!r} is not in the tensor-aware state dict"
                    )
                return objects[x.unique_key]
            return x

        dict_list_map_inplace(fill, sharded_part)

    def to_state_dict(
        self,
        sharded_state_dict: ShardedStateDict,
        algo: str = "atomic",
        exchange_algo: str = "broadcast",
        validate_access_integrity: bool = True,
        parallelization_group: Optional[ProcessGroup] = None,
        strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
        return_mismatch_keys: bool = False,
    ) -> Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]:
        """The loaded state dict for the request ``sharded_state_dict`` (collective).

        As ``dist_ckpt.load`` builds it: the common state, the request's non-persistent values,
        and each ShardedTensor / ShardedObject replaced by the held value (exchanged between the
        ranks of the group first with ``algo="fully_parallel"``), factories merged back.

        Args:
            sharded_state_dict: the request (the model's sharded state dict).
            algo: how the dict was split (``"atomic"`` or ``"fully_parallel"``).
            exchange_algo: ``"broadcast"``, ``"gather_rounds"`` or ``"gather_object"``.
            validate_access_integrity: check the request's sharding first (collective).
            parallelization_group: the group of a fully-parallel split.
            strict: what to do about keys the request and the dict do not share.
            return_mismatch_keys: return ``(state_dict, missing_keys, unexpected_keys)``.

        Raises:
            StateDictStructureError: the dict is hollow.
            ArgumentTypeError: an unknown ``algo``.
            KeyMismatchError: a requested shard that this rank does not hold and no exchange gave.
        """
        self._require(False, "to_state_dict")
        _check_algo(algo)
        fully_parallel = algo == "fully_parallel"
        recreated = dict_list_map_outplace(lambda x: x, self.common)
        if not sharded_state_dict:
            return (recreated, set(), set()) if return_mismatch_keys else recreated
        request, nonpersistent, factories = load_preprocess(sharded_state_dict)
        merge(recreated, nonpersistent)
        sharded_part, _ = extract_sharded_base(request)
        strict = parse_strict_flag(strict)
        held = None
        if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
            held = {sh.key: sh.without_data() for sh in nested_values(self.sharded_state_dict)}
        sharded_part, missing, unexpected = validate_integrity_and_strict_load(
            sharded_part, strict, validate_access_integrity, ckpt_sharded_metadata=held
        )
        self._insert_sharded_data(fully_parallel, sharded_part, parallelization_group, exchange_algo)
        merge(recreated, apply_factory_merges(sharded_part, factories))
        return (recreated, missing, unexpected) if return_mismatch_keys else recreated
