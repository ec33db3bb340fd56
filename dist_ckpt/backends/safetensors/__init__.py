"""The ``safetensors`` sharded backend, and the safetensors reading and writing it shares.

Modules, dependencies pointing one way (format <- write <- index_parts <- index_v3 <- index <-
index_write/load/verify <- stream <- strategy; tensor_index <- index_v3, index, load):
``format`` (the file format: headers, zero-copy writes), ``io`` (planned positional reads),
``blocks`` (checksums checked as reads complete), ``tensor_index`` (where stored shards live: the
data model), ``index`` (the backend's ``index.json``; ``index_v3``: its binary shard table),
``index_parts`` (each rank's compact part of the index and rank 0's merge), ``index_write`` (rank
0 writing the index), ``write`` / ``stream`` (saves), ``load``, ``verify``, ``strategy``.

What other packages use (HuggingFace folders in [`dist_ckpt.hf`][dist_ckpt.hf], completeness checks in
`dist_ckpt.training`) is exported here; everything else is the backend's own.
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
from dist_ckpt.backends.safetensors.io import ReadOptions
from dist_ckpt.backends.safetensors.load import load_from_index
from dist_ckpt.backends.safetensors.tensor_index import (
    StoredShard,
    StoredTensor,
    TensorIndex,
    describe_tensor_index,
    tensors_metadata,
)

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
