"""Helpers shipped with dist_ckpt for testing code that checkpoints: launch N local ranks."""

from dist_ckpt.tools.launch import RankError, free_port, init_process_group, spawn_ranks

__all__ = ["RankError", "free_port", "init_process_group", "spawn_ranks"]
