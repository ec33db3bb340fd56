"""The ``safetensors`` sharded backend, and the safetensors reading and writing it shares.

Modules, dependencies pointing one way (format <- index <- write/load/verify <- strategy):
``format`` (the file format: headers, zero-copy writes), ``io`` (planned positional reads),
``blocks`` (checksums checked as reads complete), ``index`` (where stored shards live: the data
model and ``index.json``), ``write`` / ``stream`` (saves), ``load``, ``verify``, ``strategy``.

What other packages use (HuggingFace folders in :mod:`dist_ckpt.hf`, completeness checks in
:mod:`dist_ckpt.training`) is exported here; everything else is the backend's own.
"""

from dist_ckpt.backends.safetensors.format import (
    MAX_HEADER_BYTES,
    SafetensorsFileWriter,
    SafetensorsHeader,
    is_whole,
    read_header,
    read_header_at,
    write_safetensors_file,
)
from dist_ckpt.backends.safetensors.index import (
    StoredShard,
    StoredTensor,
    TensorIndex,
    describe_tensor_index,
    tensors_metadata,
)
from dist_ckpt.backends.safetensors.io import ReadOptions
from dist_ckpt.backends.safetensors.load import load_from_index

__all__ = [
    "MAX_HEADER_BYTES",
    "ReadOptions",
    "SafetensorsFileWriter",
    "SafetensorsHeader",
    "StoredShard",
    "StoredTensor",
    "TensorIndex",
    "describe_tensor_index",
    "is_whole",
    "load_from_index",
    "read_header",
    "read_header_at",
    "tensors_metadata",
    "write_safetensors_file",
]
