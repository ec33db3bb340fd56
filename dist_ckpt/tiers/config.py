"""The recovery tiers' configuration and the memory bound it implies (issue 37).

A job keeps two tiers: frequent local checkpoints in node-local directories (tmpfs such as
``/dev/shm`` or NVMe), each rank's files also held by ``replicas`` ranks of other nodes, and every
``persist_every``-th one also written to the durable location. The local tier keeps at most
``keep_local`` steps, so the memory it holds per node is bounded by
[`local_tier_bytes()`][dist_ckpt.tiers.config.local_tier_bytes].
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dist_ckpt.errors import CheckpointManagementError

__all__ = ["TierConfig", "local_tier_bytes"]


@dataclass(frozen=True)
class TierConfig:
    """Where and how often the recovery tiers save; checked on construction.

    Args:
        local_dir: this node's local directory (each node passes its own; ranks of one node share it).
        replicas: how many ranks of other nodes also hold each rank's files (0: none).
        persist_every: every how many local checkpoints one is also written to the durable location
            (1: each one).
        keep_local: local checkpoints kept per node (the oldest is removed after a newer one commits).

    Example:

    ```python
    TierConfig(local_dir="/dev/shm/run1", replicas=1, persist_every=10, keep_local=2)
    ```
    """

    local_dir: str
    replicas: int = 1
    persist_every: int = 10
    keep_local: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.local_dir, (str, os.PathLike)) or not os.fspath(self.local_dir):
            raise CheckpointManagementError(f"TierConfig.local_dir must be a non-empty path, got {self.local_dir!r}")
        for name, least in (("replicas", 0), ("persist_every", 1), ("keep_local", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise CheckpointManagementError(
                    f"TierConfig(local_dir={os.fspath(self.local_dir)!r}).{name} must be an int >= {least}, "
                    f"got {value!r}"
                )

    def persists(self, local_index: int) -> bool:
        """Whether the ``local_index``-th local checkpoint of this run (1 for the first) is also
        written to the durable location."""
        return local_index % self.persist_every == 0


def local_tier_bytes(checkpoint_bytes_per_node: int, config: TierConfig) -> int:
    """The most bytes the local tier holds on one node: each kept step's files of the node's own
    ranks plus the replicas it holds for other nodes, ``bytes x (1 + replicas) x keep_local``.

    Example: a checkpoint of 40 GB per node, ``replicas=1``, ``keep_local=2`` holds at most 160 GB.
    """
    if checkpoint_bytes_per_node < 0:
        raise CheckpointManagementError(f"checkpoint_bytes_per_node must be >= 0, got {checkpoint_bytes_per_node}")
    return checkpoint_bytes_per_node * (1 + config.replicas) * config.keep_local
