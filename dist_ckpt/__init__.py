"""dist_ckpt: distributed checkpointing of sharded model and optimizer state.

Save a sharded state dict from N processes, load it back under another parallel layout::

    import dist_ckpt as dc
    sd = {"layer.weight": dc.ShardedTensor.from_rank_offsets("layer.weight", w, (0, tp_rank, tp_size)),
          "step": 1000}
    dc.save(sd, "ckpt/iter_1000")
    state = dc.load(sd_in_new_layout, "ckpt/iter_1000")

This module re-exports the public API; importing it imports no optional backend.
"""

from ._version import __version__
from .checkpointer import (
    CheckpointMetadata,
    Checkpointer,
    TensorMetadata,
    load_model_and_optim_state,
    save_model_and_optim_state,
    unshard_model_state,
    unshard_optim_state,
)
from .convert import ConvertResult, convert
from .core import CheckpointingConfig, check_is_distributed_checkpoint, maybe_load_config
from .errors import (
    AsyncSaveError,
    CheckpointExistsError,
    CheckpointingException,
    ChecksumMismatchError,
    CorruptCheckpointError,
    IncompatibleStrategyError,
    InvalidKeyError,
    InvalidShardedTensorError,
    KeyMismatchError,
    LoadMismatchError,
    MissingDependencyError,
    NotACheckpointError,
    ProcessGroupMismatchError,
    RankFailedError,
    ShardingIntegrityError,
    StateDictStructureError,
    StrategyRegistrationError,
    UnknownStrategyError,
    UnsafeObjectError,
)
from .mapping import (
    LocalNonPersistentObject,
    LocalNonpersistentObject,
    LocalNonpersitentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from .inspection import CheckpointInfo, TensorInfo, inspect_checkpoint
from .report import CheckpointReport, ProgressEvent
from .serialization import (
    LoadResult,
    SaveResult,
    load,
    load_common_state_dict,
    load_plain_tensors,
    load_sharded_metadata,
    load_sharded_objects,
    load_tensors_metadata,
    load_with_report,
    remove_sharded_tensors,
    save,
    save_with_report,
)
from .strategies.base import (
    StrategyAction,
    StrategyKey,
    get_default_strategy,
    register_default_strategy,
    registered_strategies,
)
from .strategies.async_utils import AsyncCallsQueue, AsyncRequest
from .unshard import iter_unsharded, unshard
from .validation import StrictHandling, validate_sharding_integrity
from .verify import VerifyReport, verify_checkpoint


__all__ = [
    "AsyncCallsQueue",
    "AsyncRequest",
    "AsyncSaveError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointMetadata",
    "CheckpointReport",
    "Checkpointer",
    "CheckpointingConfig",
    "CheckpointingException",
    "ChecksumMismatchError",
    "ConvertResult",
    "CorruptCheckpointError",
    "IncompatibleStrategyError",
    "InvalidKeyError",
    "InvalidShardedTensorError",
    "KeyMismatchError",
    "LoadMismatchError",
    "LoadResult",
    "LocalNonPersistentObject",
    "LocalNonpersistentObject",
    "LocalNonpersitentObject",
    "MissingDependencyError",
    "NotACheckpointError",
    "ProcessGroupMismatchError",
    "ProgressEvent",
    "RankFailedError",
    "SaveResult",
    "ShardedBase",
    "ShardedObject",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "ShardingIntegrityError",
    "StateDict",
    "StateDictStructureError",
    "StrategyAction",
    "StrategyKey",
    "StrategyRegistrationError",
    "StrictHandling",
    "TensorInfo",
    "TensorMetadata",
    "UnknownStrategyError",
    "UnsafeObjectError",
    "VerifyReport",
    "__version__",
    "apply_factories",
    "apply_factory_merges",
    "check_is_distributed_checkpoint",
    "convert",
    "get_default_strategy",
    "inspect_checkpoint",
    "is_main_replica",
    "iter_unsharded",
    "load",
    "load_common_state_dict",
    "load_model_and_optim_state",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_sharded_objects",
    "load_tensors_metadata",
    "load_with_report",
    "maybe_load_config",
    "register_default_strategy",
    "registered_strategies",
    "remove_sharded_tensors",
    "save",
    "save_model_and_optim_state",
    "save_with_report",
    "unshard",
    "unshard_model_state",
    "unshard_optim_state",
    "validate_sharding_integrity",
    "verify_checkpoint",
]
