"""Megatron-Core module path ``dist_ckpt.strategies.cached_metadata_filesystem_reader``: re-exports
``CachedMetadataFileSystemReader`` of
[`dist_ckpt.backends.torch_dist.planners`][dist_ckpt.backends.torch_dist.planners].

Code written for ``megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader`` imports from
here unchanged.
"""

from dist_ckpt.backends.torch_dist.planners import CachedMetadataFileSystemReader

__all__ = ["CachedMetadataFileSystemReader"]
