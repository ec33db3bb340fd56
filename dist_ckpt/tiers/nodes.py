"""Which node each rank runs on, and which ranks of other nodes hold a rank's replicas.

The node of a rank comes from the launcher: ``DIST_CKPT_NODE_ID`` when set (tests simulate nodes
with it), else ``rank // LOCAL_WORLD_SIZE`` under torchrun, else the host name. Replica placement
is a pure, deterministic function of the ranks' nodes, so every rank computes the same plan
without communicating.
"""

from __future__ import annotations

import os
import socket
from typing import Dict, List, Mapping, Optional, Sequence

from dist_ckpt.errors import CheckpointManagementError

NODE_ID_ENV = "DIST_CKPT_NODE_ID"

__all__ = ["NODE_ID_ENV", "node_identity", "replica_ranks"]


def node_identity(rank: int, environ: Optional[Mapping[str, str]] = None) -> str:
    """The name of the node that ``rank`` runs on (see the module docstring for the order)."""
    env = os.environ if environ is None else environ
    override = env.get(NODE_ID_ENV)
    if override:
        return override
    local_world = env.get("LOCAL_WORLD_SIZE")
    if local_world:
        try:
            size = int(local_world)
        except ValueError:
            raise CheckpointManagementError(
                f"[rank {rank}] LOCAL_WORLD_SIZE={local_world!r} is not an int; set {NODE_ID_ENV} to name the node"
            ) from None
        if size > 0:
            return f"node{rank // size}"
    return socket.gethostname()


def replica_ranks(nodes: Sequence[str], replicas: int) -> Dict[int, List[int]]:
    """For each rank, the ranks (one per other node) that also hold its files.

    ``nodes[r]`` is rank r's node. The i-th replica of a rank goes to the rank with the same index
    within its node on the i-th next node (in order of first appearance), or that node's first rank
    when it has fewer: a spread that does not depend on the host names' sort order.

    Raises:
        CheckpointManagementError: fewer than ``replicas + 1`` nodes (a replica on the same node
            does not survive losing it).
    """
    order: List[str] = list(dict.fromkeys(nodes))
    if replicas > 0 and len(order) < replicas + 1:
        raise CheckpointManagementError(
            f"replicas={replicas} needs at least {replicas + 1} nodes, the job has {len(order)} ({', '.join(order)}); "
            f"lower replicas or set {NODE_ID_ENV} per node"
        )
    members: Dict[str, List[int]] = {name: [] for name in order}
    for rank, name in enumerate(nodes):
        members[name].append(rank)
    plan: Dict[int, List[int]] = {}
    for rank, name in enumerate(nodes):
        index = members[name].index(rank)
        position = order.index(name)
        peers = []
        for i in range(1, replicas + 1):
            other = members[order[(position + i) % len(order)]]
            peers.append(other[index] if index < len(other) else other[0])
        plan[rank] = peers
    return plan
