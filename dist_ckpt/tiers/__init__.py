"""Recovery tiers (issue 37): node-local checkpoints replicated to peers, persisted behind.

This package holds the parts that decide without I/O: the tiers' configuration and memory bound
(`config`), node identity and replica placement (`nodes`), and the choice of the tier to restore
from (`restore_plan`). It sits above the engine, beside ``training/``.
"""

from dist_ckpt.tiers.config import TierConfig, local_tier_bytes
from dist_ckpt.tiers.nodes import NODE_ID_ENV, node_identity, replica_ranks
from dist_ckpt.tiers.restore_plan import (
    FileRecord,
    LocalRestorePlan,
    Unrestorable,
    newest_restorable,
    plan_local_restore,
)

__all__ = [
    "NODE_ID_ENV",
    "FileRecord",
    "LocalRestorePlan",
    "TierConfig",
    "Unrestorable",
    "local_tier_bytes",
    "newest_restorable",
    "node_identity",
    "plan_local_restore",
    "replica_ranks",
]
