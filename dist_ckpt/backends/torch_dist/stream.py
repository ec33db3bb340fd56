"""Streaming saves of the ``torch_dist`` backend: whole tensors, one at a time, one process.

What ``dist-ckpt convert --to torch_dist`` writes with: the checkpoint a one-rank save of whole
tensors produces -- one file ``__0_0.distcp`` holding one DCP item per tensor (a ``torch.save``
archive, as DCP's writer makes it) and one per ShardedObject, then DCP's ``.metadata`` and the
checksum manifest -- written tensor by tensor, so memory holds one tensor at a time:

1. `TorchDistStreamWriter.add()` appends a tensor's item (to the file in the staging directory,
   see [`staging`][dist_ckpt.backends.torch_dist.staging]) and keeps only its byte range and crc32c;
2. `TorchDistStreamWriter.add_object()` appends a ShardedObject (after the tensors);
3. `TorchDistStreamWriter.finish()` fsyncs the file; DCP's planner builds the ``Metadata``,
   the file is renamed into place and DCP's ``FileSystemWriter.finish`` writes ``.metadata`` (see
   [`save`][dist_ckpt.backends.torch_dist.save]).

Example:

```python
writer = TorchDistSaveShardedStrategy().begin_stream(LocalStorage("out"), [("w", torch.float32, (4, 4))])
writer.add("w", torch.zeros(4, 4))
writer.add_object("rng/shard_0_1", {"seed": 1})
writer.finish()          # then commit metadata.json
```
"""

from __future__ import annotations

import io
import os
from typing import IO, Any, Dict, List, Optional, Sequence

import torch

from dist_ckpt.backends.base import TensorLayout, TensorStreamWriter, check_stream_entry
from dist_ckpt.backends.torch_dist.checksums import FileSpans, RecordingStream
from dist_ckpt.backends.torch_dist.save import ChunkEntry, TorchDistSaveOptions, write_global_metadata
from dist_ckpt.backends.torch_dist.staging import staging_dir
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.model.dtypes import dtype_to_name
from dist_ckpt.storage import Storage, fsync_dir

__all__ = ["TorchDistStreamWriter"]

_FILE = "__0_0.distcp"


class TorchDistStreamWriter(TensorStreamWriter):
    """Writes whole tensors, then ShardedObjects, into one DCP file of a new checkpoint.

    Args:
        storage: the new checkpoint (a storage with ``local_paths``: DCP's files are written in its
            directory, created if missing).
        layout: every tensor to be added, in order.
        options: the save strategy's options (checksums, fsync).
    """

    def __init__(self, storage: Storage, layout: Sequence[TensorLayout], options: TorchDistSaveOptions) -> None:
        self.storage = storage
        self.layout = list(layout)
        self.options = options
        storage.make_dir()
        self._staging = staging_dir(storage.local_dir)
        self._raw: Optional[IO[bytes]] = open(self._staging / _FILE, "wb")
        self._spans: Dict[str, FileSpans] = {}
        self._stream = RecordingStream(self._raw, _FILE, self._spans.__setitem__)
        self._chunks: List[Dict[str, Any]] = []
        self._objects: List[str] = []
        self._results: List[Dict[str, Any]] = []

    def _append(self, key: str, offsets: Optional[Sequence[int]], write: Any) -> None:
        start = self._stream.tell()
        write(self._stream)
        end = self._stream.tell()
        self._results.append(
            {
                "key": key,
                "offsets": None if offsets is None else list(offsets),
                "file": _FILE,
                "offset": start,
                "length": end - start,
            }
        )

    def add(self, key: str, tensor: torch.Tensor) -> None:
        check_stream_entry(self.layout, len(self._chunks), key, tensor)
        if self._objects:
            raise CheckpointingException(f"tensor {key!r} added after ShardedObjects; add every tensor first")
        data = tensor.detach().to("cpu").contiguous()
        if data.untyped_storage().nbytes() != data.nbytes:
            data = data.clone()  # torch.save writes whole storages
        shape = tuple(data.shape)
        entry = ChunkEntry(key, (0,) * len(shape), shape, shape, dtype_to_name(data.dtype))
        self._chunks.append(entry.to_json())
        self._append(key, entry.offsets, lambda stream: torch.save(data, stream))

    def add_object(self, unique_key: str, value: Any) -> None:
        """Append a ShardedObject, stored as Megatron-Core stores it: ``torch.save([value])``."""
        if len(self._chunks) != len(self.layout):
            raise CheckpointingException(
                f"ShardedObject {unique_key!r} added after {len(self._chunks)} of the {len(self.layout)} tensors; "
                f"add every tensor first"
            )
        buf = io.BytesIO()
        torch.save([value], buf)
        payload = buf.getvalue()
        self._objects.append(unique_key)
        self._append(unique_key, None, lambda stream: stream.write(payload))

    def finish(self) -> None:
        if len(self._chunks) != len(self.layout):
            raise CheckpointingException(
                f"finish() after {len(self._chunks)} of the {len(self.layout)} tensors of the stream's layout"
            )
        assert self._raw is not None
        self._stream.flush()
        if self.options.sync_files:
            os.fsync(self._raw.fileno())
        self._stream.close()
        self._raw.close()
        self._raw = None
        fsync_dir(self._staging)
        written = {
            "rank": 0,
            "chunks": self._chunks,
            "objects": self._objects,
            "results": self._results,
            "names": [_FILE],
            "files": {name: spans.to_json() for name, spans in self._spans.items()},
        }
        write_global_metadata(self.storage, [written], self.options)

    def abort(self) -> None:
        if self._raw is not None:
            self._raw.close()
            self._raw = None
