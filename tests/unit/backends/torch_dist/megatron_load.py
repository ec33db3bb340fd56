"""Load a checkpoint with megatron-core's own ``dist_checkpointing.load`` (run as a script, in a
process of its own: importing megatron-core widens torch's ``weights_only`` allow-list for the
whole process, which must not leak into dist_ckpt's tests).

Usage: ``python megatron_load.py SPEC_JSON OUT_FILE CKPT_DIR...``. ``SPEC_JSON`` lists what to
request: ``{"tensors": {key: [shape, dtype name]}, "objects": [[key, shape, offset], ...]}``; every
tensor is requested whole (a resharded load of a checkpoint saved by several ranks). For each
checkpoint, the loaded state (tensors, object values, common state) and ``load_tensors_metadata``'s
shapes are written to ``OUT_FILE`` with ``torch.save``, as ``{CKPT_DIR: result}`` (one process
loads them all: megatron-core is imported once). Needs only torch and megatron-core (not dist_ckpt).
"""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist


def main() -> None:
    spec, out, checkpoints = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    results = {}
    for ckpt in checkpoints:
        request = {}
        for key, (shape, dtype) in spec["tensors"].items():
            request[key] = ShardedTensor.from_rank_offsets(key, torch.zeros(shape, dtype=getattr(torch, dtype)))
        for key, shape, offset in spec["objects"]:
            request[f"object:{key}:{offset}"] = ShardedObject(key, None, tuple(shape), tuple(offset))
        loaded = mdc.load(request, ckpt)
        metadata = {k: list(v.global_shape) for k, v in mdc.load_tensors_metadata(ckpt).items()}
        results[ckpt] = {
            "tensors": {k: v for k, v in loaded.items() if k in spec["tensors"]},
            "objects": {k: v for k, v in loaded.items() if k.startswith("object:")},
            "common": {k: v for k, v in loaded.items() if k not in request},
            "metadata": metadata,
        }
    torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
