"""A complete custom sharded backend: raw ``.bin`` shard files plus a JSON index per rank.

This file is the worked example of docs/backends/custom.md and is executed by the test suite
(tests/unit/test_docs_examples.py), so it stays correct. It shows the whole contract:

* every method receives ``checkpoint_dir``, a `Storage`; these
  strategies are written for local directories (they leave ``object_storage`` False, so they are
  refused on object stores before any byte moves) and take the directory from
  ``checkpoint_dir.local_dir``;
* a save strategy writes this rank's main-replica shards and returns once they are durable;
* a load strategy declares the backends and versions it reads, checks the request before
  reading, and fills each requested shard from the stored shards it overlaps (any resharding,
  via `dist_ckpt.model.geometry`);
* both are registered under ``("rawbin", 1)``; ``dist_ckpt.save`` commits ``metadata.json``
  and ``dist_ckpt.load`` picks the loader from it.

Run it: ``python docs/examples/custom_backend.py`` (one process, no process group).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Tuple

import torch

import dist_ckpt as dc
from dist_ckpt.backends.base import LoadShardedStrategy, SaveShardedStrategy
from dist_ckpt.backends.registry import StrategyAction
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.model.dict_utils import dict_list_map_inplace, nested_values
from dist_ckpt.model.dtypes import dtype_from_name, dtype_to_name
from dist_ckpt.model.geometry import Box, piece_view, shard_pieces, sub_view
from dist_ckpt.model.stored_metadata import stored_tensor_metadata
from dist_ckpt.storage import Storage, write_bytes_atomic

DIR = "rawbin"


class RawBinSave(SaveShardedStrategy):
    """Each main-replica shard becomes ``rawbin/<rank>_<n>.bin``; ``<rank>.json`` lists them."""

    owned_paths: ClassVar[Tuple[str, ...]] = (DIR,)

    def __init__(self) -> None:
        super().__init__("rawbin", 1)

    def save(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: Storage) -> None:
        root = checkpoint_dir.local_dir / DIR  # a LocalStorage: the checkpoint's directory
        root.mkdir(parents=True, exist_ok=True)
        rank, entries = get_rank(), []
        for n, sh in enumerate(s for s in nested_values(sharded_state_dict) if isinstance(s, dc.ShardedTensor)):
            if not dc.is_main_replica(sh.replica_id):
                continue  # only one copy of each shard is written
            name = f"{rank}_{n}.bin"
            data = sh.data.detach().cpu().contiguous().reshape(-1)
            write_bytes_atomic(root / name, data.view(torch.uint8).numpy().tobytes())  # fsynced
            rng = None if sh.flattened_range is None else [sh.flattened_range.start, sh.flattened_range.stop]
            entries.append(
                {
                    "file": name,
                    "key": sh.key,
                    "dtype": dtype_to_name(sh.dtype),
                    "global_shape": list(sh.global_shape),
                    "global_offset": list(sh.global_offset),
                    "chunk_shape": list(sh.full_local_shape),
                    "flat_range": rng,
                }
            )
        write_bytes_atomic(root / f"{rank}.json", json.dumps(entries).encode())


class RawBinLoad(LoadShardedStrategy):
    """Loads ``rawbin`` checkpoints into any sharding, reading the stored shards it overlaps."""

    supported_backends: ClassVar[Tuple[str, ...]] = ("rawbin",)
    supported_versions: ClassVar[Tuple[int, ...]] = (1,)

    def _index(self, checkpoint_dir: Storage) -> Dict[str, List[Dict[str, Any]]]:
        by_key: Dict[str, List[Dict[str, Any]]] = {}
        for path in sorted((checkpoint_dir.local_dir / DIR).glob("*.json")):
            for entry in json.loads(path.read_text()):
                by_key.setdefault(entry["key"], []).append(entry)
        return by_key

    def load(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: Storage) -> Dict[str, Any]:
        index = self._index(checkpoint_dir)
        requested = [s for s in nested_values(sharded_state_dict) if isinstance(s, dc.ShardedTensor)]
        absent = sorted({sh.key for sh in requested if sh.key not in index})
        if absent:  # check everything before reading anything
            raise dc.KeyMismatchError(
                f"[rank {get_rank()}] not in {checkpoint_dir.url}: {absent}", unexpected_keys=absent
            )

        def load_one(sh: Any) -> Any:
            if not isinstance(sh, dc.ShardedTensor):
                return sh
            shape = (
                sh.local_shape if sh.flattened_range is None else (sh.flattened_range.stop - sh.flattened_range.start,)
            )
            dest = torch.empty(shape, dtype=sh.dtype)
            holder = Box(sh.global_offset, sh.full_local_shape)
            rng = None if sh.flattened_range is None else (sh.flattened_range.start, sh.flattened_range.stop)
            for want in shard_pieces(sh.global_offset, sh.local_shape, sh.prepend_axis_num, rng):
                target = piece_view(dest, want, sh.prepend_axis_num, holder)
                for entry in index[sh.key]:
                    self._copy_overlap(checkpoint_dir.local_dir / DIR, entry, want.box, target)
            return dest

        return dict_list_map_inplace(load_one, sharded_state_dict)  # type: ignore[no-any-return]

    @staticmethod
    def _copy_overlap(root: Path, entry: Dict[str, Any], want: Box, target: torch.Tensor) -> None:
        """Copy the part of stored shard ``entry`` that overlaps ``want`` into ``target``."""
        rng = None if entry["flat_range"] is None else tuple(entry["flat_range"])
        stored = None
        for have in shard_pieces(entry["global_offset"], entry["chunk_shape"], 0, rng):
            overlap = want.intersect(have.box)
            if overlap is None:
                continue
            if stored is None:  # read the file once, only if some part of it is needed
                raw = torch.frombuffer(bytearray((root / entry["file"]).read_bytes()), dtype=torch.uint8)
                stored = raw.view(dtype_from_name(entry["dtype"]))
            holder = Box(tuple(entry["global_offset"]), tuple(entry["chunk_shape"]))
            source = piece_view(stored if rng else stored.view(entry["chunk_shape"]), have, 0, holder)
            sub_view(target, want, overlap).copy_(sub_view(source, have.box, overlap))

    def load_tensors_metadata(self, checkpoint_dir: Storage) -> Dict[str, Any]:
        # each tensor as it was saved: one saved as flattened ranges is described as one range
        # covering all of it (so load_plain_tensors returns it flat, as Megatron-Core does)
        return {
            key: stored_tensor_metadata(
                key,
                dtype_from_name(entries[0]["dtype"]),
                entries[0]["global_shape"],
                flattened=any(e["flat_range"] is not None for e in entries),
            )
            for key, entries in self._index(checkpoint_dir).items()
        }


def register() -> None:
    """Make ``("rawbin", 1)`` available to ``dist_ckpt.save`` / ``dist_ckpt.load``."""
    dc.register_default_strategy(StrategyAction.SAVE_SHARDED, "rawbin", 1, RawBinSave, override=True)
    dc.register_default_strategy(StrategyAction.LOAD_SHARDED, "rawbin", 1, RawBinLoad, override=True)


def main(workdir: str) -> None:
    """Save a tensor as 4 row shards, load it back as 2 column shards and whole, and check."""
    register()
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    # one process may hold several shards of a tensor: here 4 row blocks, as 4 TP ranks would
    saved = {
        f"w{i}": dc.ShardedTensor.from_rank_offsets("w", full[2 * i : 2 * i + 2].clone(), (0, i, 4)) for i in range(4)
    }
    # distributed-optimizer style: the flattened tensor split into 3 uneven ranges
    flat = full.flatten()
    for i, (a, b) in enumerate([(0, 5), (5, 30), (30, 48)]):
        saved[f"m{i}"] = dc.ShardedTensor.from_rank_offsets_flat(
            "m", flat[a:b].clone(), (8, 6), flattened_range=slice(a, b)
        )
    saved["step"] = 10
    ckpt = os.path.join(workdir, "iter_10")
    dc.save(saved, ckpt, sharded_strategy=("rawbin", 1))

    request = {f"c{j}": dc.ShardedTensor.from_rank_offsets("w", torch.empty(8, 3), (1, j, 2)) for j in range(2)}
    loaded = dc.load(request, ckpt)
    assert torch.equal(loaded["c0"], full[:, :3]) and torch.equal(loaded["c1"], full[:, 3:])
    assert loaded["step"] == 10
    plain = dc.load_plain_tensors(ckpt)
    assert torch.equal(plain["w"], full) and torch.equal(plain["m"], full.flatten())
    assert torch.equal(dc.unshard(ckpt)["m"], full)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(tmp)
    print("custom backend round trip: OK")
