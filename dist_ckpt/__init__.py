"""dist_ckpt: distributed checkpointing of sharded model and optimizer state.

Save a sharded state dict from N processes, load it back under another parallel layout:

```python
import dist_ckpt as dc
sd = {"layer.weight": dc.ShardedTensor.from_rank_offsets("layer.weight", w, (0, tp_rank, tp_size)),
      "step": 1000}
dc.save(sd, "ckpt/iter_1000")
state = dc.load(sd_in_new_layout, "ckpt/iter_1000")
```

This module re-exports the public API; importing it imports no optional backend.
"""

from dist_ckpt._version import __version__
from dist_ckpt.asynchronous.queue import AsyncCallsQueue, AsyncRequest
from dist_ckpt.backends.registry import (
    StrategyAction,
    StrategyKey,
    get_default_strategy,
    register_default_strategy,
    registered_strategies,
)
from dist_ckpt.engine.async_api import AsyncSaveFuture, async_save
from dist_ckpt.engine.checks.sharding import validate_sharding_integrity
from dist_ckpt.engine.checks.strict import StrictHandling
from dist_ckpt.engine.load import LoadResult, load, load_with_report
from dist_ckpt.engine.load_parts import (
    load_common_state_dict,
    load_plain_tensors,
    load_sharded_metadata,
    load_sharded_objects,
    load_tensors_metadata,
    remove_sharded_tensors,
)
from dist_ckpt.engine.report import CheckpointReport, ProgressEvent
from dist_ckpt.engine.save import SaveResult, save, save_with_report
from dist_ckpt.engine.steps import Step
from dist_ckpt.errors import (
    ArgumentTypeError,
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
    SaveConflictError,
    ShardedObjectLayoutError,
    ShardingIntegrityError,
    StateDictStructureError,
    StrategyRegistrationError,
    UnknownStrategyError,
    UnsafeLinkError,
    UnsafeObjectError,
)
from dist_ckpt.model.sharded import (
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
from dist_ckpt.record.commit import CheckpointingConfig, check_is_distributed_checkpoint, maybe_load_config
from dist_ckpt.tools.convert import ConvertResult, convert
from dist_ckpt.tools.inspection import CheckpointInfo, TensorInfo, inspect_checkpoint
from dist_ckpt.tools.unshard import iter_unsharded, unshard
from dist_ckpt.tools.verify import VerifyReport, verify_checkpoint
from dist_ckpt.training.checkpointer import Checkpointer, CheckpointMetadata, TensorMetadata
from dist_ckpt.training.model_optim import (
    async_save_model_and_optim_state,
    load_model_and_optim_state,
    save_model_and_optim_state,
    unshard_model_state,
    unshard_optim_state,
)

__all__ = [
    "AsyncCallsQueue",
    "AsyncRequest",
    "AsyncSaveFuture",
    "ArgumentTypeError",
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
    "SaveConflictError",
    "SaveResult",
    "ShardedBase",
    "ShardedObject",
    "ShardedObjectLayoutError",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "ShardingIntegrityError",
    "StateDict",
    "StateDictStructureError",
    "Step",
    "StrategyAction",
    "StrategyKey",
    "StrategyRegistrationError",
    "StrictHandling",
    "TensorInfo",
    "TensorMetadata",
    "UnknownStrategyError",
    "UnsafeLinkError",
    "UnsafeObjectError",
    "VerifyReport",
    "__version__",
    "apply_factories",
    "apply_factory_merges",
    "async_save",
    "async_save_model_and_optim_state",
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
