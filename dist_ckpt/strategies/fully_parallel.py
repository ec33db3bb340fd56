"""Megatron-Core module path ``dist_ckpt.strategies.fully_parallel``:
re-exports [`dist_ckpt.parallel.fully_parallel`][dist_ckpt.parallel.fully_parallel].

Code written for ``megatron.core.dist_checkpointing.strategies.fully_parallel`` imports from here unchanged.
"""

from dist_ckpt.parallel.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
    distribute_main_replicas,
)

__all__ = ["FullyParallelLoadStrategyWrapper", "FullyParallelSaveStrategyWrapper", "distribute_main_replicas"]
