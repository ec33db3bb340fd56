"""Megatron-Core module path ``dist_ckpt.strategies.filesystem_async``: re-exports
``FileSystemWriterAsync`` of [`dist_ckpt.backends.torch_dist.async_writer`][dist_ckpt.backends.torch_dist.async_writer].

Code written for ``megatron.core.dist_checkpointing.strategies.filesystem_async`` imports from here unchanged.
"""

from dist_ckpt.backends.torch_dist.async_writer import FileSystemWriterAsync, WriteBucket

__all__ = ["FileSystemWriterAsync", "WriteBucket"]
