"""The ``zarr`` sharded backend (version 1): zarr v3 arrays, one chunk per saved shard.

Two engines read and write the same format, each in three modules with one public face:

- zarr-python (the default): ``zarr_python`` (public names, registration) over
  ``zarr_python_save`` (save, streaming), ``zarr_python_load`` (load, removing tensors) and
  ``zarr_python_stores`` (the stores zarr-python reads and writes through);
- TensorStore: ``tensorstore_engine`` (public names, registration) over ``tensorstore_save``,
  ``tensorstore_load`` and ``tensorstore_arrays`` (the one module importing TensorStore).

Both share the format's modules: ``layout``, ``metadata``, ``read_plan``, ``nodes``, ``direct``,
``checksums``, ``dtypes`` and ``megatron``; on a local disk both save through ``local_save``
(the whole tree written as plain files, no array library).
"""
