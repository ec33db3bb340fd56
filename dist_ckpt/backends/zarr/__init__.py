"""The ``zarr`` sharded backend (version 1): zarr v3 arrays, one chunk per saved shard.

Two engines read and write the same format: zarr-python (``zarr_python``, the default) and
TensorStore (``tensorstore_engine``).
"""
