"""``torch.distributed.checkpoint`` with dist_ckpt's I/O: a storage writer and reader.

Any DCP user (torchtitan, Lightning's FSDP strategy, Accelerate, plain ``dcp.save``) switches by
passing them:

```python
import torch.distributed.checkpoint as dcp
import dist_ckpt.dcp

dcp.save(state_dict, storage_writer=dist_ckpt.dcp.StorageWriter("ckpt/step_100"))
dcp.load(state_dict, storage_reader=dist_ckpt.dcp.StorageReader("ckpt/step_100"))
```

DCP still plans (resharding is DCP's); dist_ckpt writes each rank's files from several threads
through its `Storage` (local disk or ``s3://``), records a crc32c of every item and checks it on
load, and commits by writing ``.metadata`` last. Modules: `items` (one rank's files and their
checksums), `writer` ([`StorageWriter`][dist_ckpt.dcp.StorageWriter]), `reader`
([`StorageReader`][dist_ckpt.dcp.StorageReader]).
"""

from dist_ckpt.dcp.reader import StorageReader
from dist_ckpt.dcp.writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter"]
