"""Which load strategies fit a checkpoint: read ``metadata.json`` and check backend and version."""

from __future__ import annotations

import logging
from typing import Any, Tuple

from dist_ckpt.backends.base import LoadCommonStrategy, LoadShardedStrategy
from dist_ckpt.backends.registry import StrategyAction, StrategySpec, resolve_strategy
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import IncompatibleStrategyError
from dist_ckpt.record.commit import DCP_CONFIG, HF_CONFIG, detect_config, read_integrity_records
from dist_ckpt.storage.location import LocationLike, resolve_location

logger = logging.getLogger(__name__)


def validate_sharded_objects_handling(sharded_strategy: Any, common_strategy: Any) -> None:
    """Raise unless the sharded or the common strategy handles ShardedObjects."""
    if not sharded_strategy.can_handle_sharded_objects and not common_strategy.can_handle_sharded_objects:
        raise IncompatibleStrategyError(
            f"neither {sharded_strategy} nor {common_strategy} can handle ShardedObjects; "
            f"use a common strategy that can (e.g. the default 'torch' one)"
        )


def verify_checkpoint_and_load_strategy(
    checkpoint_dir: LocationLike, sharded_strategy: StrategySpec = None, common_strategy: StrategySpec = None
) -> Tuple[LoadShardedStrategy, LoadCommonStrategy]:
    """Read ``metadata.json`` and return load strategies compatible with it.

    A folder holding HuggingFace weights and no ``metadata.json`` is read with the ``hf``
    strategies (see [`dist_ckpt.record.commit.detect_config()`][dist_ckpt.record.commit.detect_config]).

    Strategies the caller passes are checked for compatibility; missing ones come from the
    registry, keyed by the backend and version the checkpoint records. On an object store
    (``s3://``), each must also be able to read from one (``check_location``).
    """
    location = resolve_location(checkpoint_dir)
    config = detect_config(location)
    sharded = resolve_strategy(
        sharded_strategy, StrategyAction.LOAD_SHARDED, (config.sharded_backend, config.sharded_backend_version)
    )
    common = resolve_strategy(
        common_strategy, StrategyAction.LOAD_COMMON, (config.common_backend, config.common_backend_version)
    )
    assert isinstance(sharded, LoadShardedStrategy) and isinstance(common, LoadCommonStrategy)
    for strategy, backend, version in (
        (sharded, config.sharded_backend, config.sharded_backend_version),
        (common, config.common_backend, config.common_backend_version),
    ):
        try:
            strategy.check_backend_compatibility(backend)
            strategy.check_version_compatibility(version)
        except IncompatibleStrategyError as e:
            raise IncompatibleStrategyError(f"checkpoint {location.url!r}: {e}") from e
        strategy.check_location(location)
    if config not in (HF_CONFIG, DCP_CONFIG) and get_rank() == 0 and read_integrity_records(location) is None:
        logger.warning(
            "checkpoint %s was saved before dist_ckpt recorded its integrity records in metadata.json: its checksum "
            "manifests and index cannot be checked against the commit record, so it loads unverified (a deleted "
            "manifest would go unnoticed); save it again to protect it",
            location.url,
        )
    return sharded, common


__all__ = ["validate_sharded_objects_handling", "verify_checkpoint_and_load_strategy"]
