"""Megatron-Core module path ``dist_ckpt.mapping``: re-exports [`dist_ckpt.model.sharded`][dist_ckpt.model.sharded].

Code written for ``megatron.core.dist_checkpointing.mapping`` imports from here unchanged.
"""

from dist_ckpt.model.sharded import (
    CommonStateDict,
    FactoryBuildFn,
    FactoryMergeFn,
    LocalNonPersistentObject,
    LocalNonpersistentObject,
    LocalNonpersitentObject,
    ReplicaId,
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

__all__ = [
    "CommonStateDict",
    "FactoryBuildFn",
    "FactoryMergeFn",
    "LocalNonPersistentObject",
    "LocalNonpersistentObject",
    "LocalNonpersitentObject",
    "ReplicaId",
    "ShardedBase",
    "ShardedObject",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StateDict",
    "apply_factories",
    "apply_factory_merges",
    "is_main_replica",
]
