"""What a checkpoint is made of: ShardedTensor and its kin, factories, shard geometry, dtypes.

Pure data and arithmetic: nothing here does I/O or talks to other ranks.
"""
