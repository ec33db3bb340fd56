"""Write the torch_dist golden checkpoints with megatron-core's own ``dist_checkpointing.save``.

Run inside a virtualenv holding megatron-core (not the dist_ckpt environment), from the
repository root, once per megatron-core version::

    /opt/mcore-venv/bin/python tests/golden/torch_dist/make_fixtures.py tests/golden/torch_dist
    /opt/mcore015-venv/bin/python tests/golden/torch_dist/make_fixtures.py tests/golden/torch_dist

Each run writes the fixtures of ``expected.FIXTURES`` whose ``mcore_version`` is the installed
megatron-core (0.16.1: tp2, pp2, tp2pp2, dist_opt; 0.15.3: flat_legacy_mcore015), each under
``<out>/<name>/``, and refuses to overwrite an existing directory. Ranks are real processes
(``torch.multiprocessing.spawn``) in a gloo process group on CPU. The only patches are the two
CUDA calls megatron-core makes unconditionally while saving: ``torch.cuda.synchronize`` (after
staging tensors to host memory) and ``torch.cuda.current_device`` (device of a failure flag
that is all-reduced at finalize); on CPU-only torch both raise.

After saving, every fixture is read back by megatron-core itself, at the same world size with
the same sharded state dict and whole with ``load_plain_tensors`` (0.16.1 only, which cannot
read legacy flattened tensors whole), and compared bit for bit with ``expected``; the common
state is compared with ``torch.load(common.pt)``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import expected as E  # noqa: E402  (a plain module: this script runs outside the dist_ckpt tree)


def _patch_cuda() -> None:
    """Make megatron-core's two unconditional CUDA calls harmless on CPU-only torch."""
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]


def _sharded_tensor(spec: E.TensorSpec, piece: E.Piece, data: Any) -> Any:
    """Build the ShardedTensor the way Megatron-Core does, and check it against ``expected``."""
    from megatron.core.dist_checkpointing import ShardedTensor

    if not piece.regular:
        sh = ShardedTensor(
            spec.key,
            data,
            spec.dtype,
            tuple(data.shape),
            spec.global_shape,
            E.global_offset(spec, piece),
            axis_fragmentations=None,
            replica_id=piece.replica_id,
        )
    elif piece.flattened_range is not None:
        start, stop = piece.flattened_range
        sh = ShardedTensor.from_rank_offsets_flat(
            spec.key,
            data,
            E.local_shape(spec, piece),
            *piece.rank_offsets,
            flattened_range=slice(start, stop),
            replica_id=piece.replica_id,
            prepend_axis_num=piece.prepend_axis_num,
        )
    else:
        sh = ShardedTensor.from_rank_offsets(
            spec.key, data, *piece.rank_offsets, replica_id=piece.replica_id, prepend_axis_num=piece.prepend_axis_num
        )
    got = (sh.global_shape, sh.global_offset, sh.local_shape, sh.axis_fragmentations)
    want = (
        spec.global_shape,
        E.global_offset(spec, piece),
        E.local_shape(spec, piece),
        E.axis_fragmentations(spec, piece),
    )
    if got != want:
        raise RuntimeError(f"{spec.key}: megatron built {got}, expected.py says {want}")
    return sh


def _merge(into: Dict[str, Any], extra: Dict[str, Any]) -> None:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def sharded_state(fixture: E.Fixture, rank: int, for_load: bool) -> Dict[str, Any]:
    """What ``rank`` passes to save (or, with ``for_load``, to load: zeros and no object data)."""
    from megatron.core.dist_checkpointing import ShardedObject

    model: Dict[str, Any] = {}
    optim: Dict[str, Any] = {}
    for spec in fixture.tensors:
        for i, piece in enumerate(spec.pieces):
            if piece.rank != rank:
                continue
            data = E.local_data(spec, piece)
            if for_load:
                data = torch.zeros_like(data)
            target = optim if spec.key.startswith("optimizer.") else model
            target[f"{spec.key}#{i}"] = _sharded_tensor(spec, piece, data)
    objects = {
        f"{o.unique_key}": ShardedObject(
            o.key,
            None if for_load else E.object_value(fixture.name, o),
            o.global_shape,
            o.global_offset,
            replica_id=o.replica_id,
        )
        for o in fixture.objects
        if o.rank == rank
    }
    sd: Dict[str, Any] = {"model": model, "rng": objects}
    if optim:
        sd["optimizer"] = {"param_state": optim}
    common = E.expected_common(fixture.name)
    common.pop("content_metadata", None)
    _merge(sd, common)
    return sd


def _collect(loaded: Dict[str, Any], fixture: E.Fixture, rank: int) -> None:
    """Compare what megatron loaded into ``rank``'s own pieces and objects with ``expected``."""
    for spec in fixture.tensors:
        for i, piece in enumerate(spec.pieces):
            if piece.rank != rank:
                continue
            group = loaded["optimizer"]["param_state"] if spec.key.startswith("optimizer.") else loaded["model"]
            E.assert_same(group[f"{spec.key}#{i}"], E.local_data(spec, piece), f"rank {rank} {spec.key}#{i}")
    stored = E.expected_objects(fixture.name)  # a replica loads what its main replica stored
    for o in fixture.objects:
        if o.rank == rank:
            E.assert_same(loaded["rng"][o.unique_key], stored[o.unique_key], f"rank {rank} {o.unique_key}")


def _verify(fixture: E.Fixture, rank: int, ckpt: str) -> None:
    from megatron.core import dist_checkpointing as dc

    loaded = dc.load(sharded_state(fixture, rank, for_load=True), ckpt)
    _collect(loaded, fixture, rank)
    if fixture.mcore_version == E.MCORE_VERSION:
        # load_plain_tensors returns the common state too, despite its docstring: compare tensors.
        want = E.expected_tensors(fixture.name)
        plain = dc.load_plain_tensors(ckpt)
        E.assert_same({k: plain[k] for k in want}, want, f"rank {rank} load_plain_tensors")
    if rank == 0:
        common = torch.load(os.path.join(ckpt, "common.pt"), weights_only=False)
        E.assert_same(common, E.expected_common(fixture.name), "common.pt")


def _rank_main(rank: int, fixture: E.Fixture, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=fixture.world)
    _patch_cuda()
    # Megatron-LM's training loop allows Namespace the same way before loading its common.pt.
    torch.serialization.add_safe_globals([argparse.Namespace])
    from megatron.core import dist_checkpointing as dc

    os.chdir(out)  # DCP records the checkpoint path as given: keep it relative ("<name>")
    if rank == 0:
        os.makedirs(fixture.name)
    dist.barrier()
    dc.save(sharded_state(fixture, rank, for_load=False), fixture.name, content_metadata=fixture.content_metadata)
    dist.barrier()
    _verify(fixture, rank, fixture.name)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: List[str]) -> None:
    from importlib.metadata import version

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="directory that receives <name>/ per fixture")
    parser.add_argument("names", nargs="*", help="fixtures to write (default: all for this megatron-core)")
    args = parser.parse_args(argv)
    mcore = version("megatron-core")
    names = args.names or [f.name for f in E.FIXTURES.values() if f.mcore_version == mcore]
    if not names:
        raise SystemExit(f"no fixture is made with megatron-core {mcore}")
    for name in names:
        fixture = E.FIXTURES[name]
        if fixture.mcore_version != mcore:
            raise SystemExit(f"{name} is made with megatron-core {fixture.mcore_version}, not {mcore}")
        if (args.out / name).exists():
            raise SystemExit(f"{args.out / name} exists; golden checkpoints are never rewritten")
        mp.spawn(_rank_main, args=(fixture, str(args.out.resolve()), _free_port()), nprocs=fixture.world)
        files = sorted(p for p in (args.out / name).rglob("*") if p.is_file())
        total = sum(p.stat().st_size for p in files)
        made_by = f"megatron-core {mcore}, torch {torch.__version__}"
        print(f"wrote {args.out / name}: {len(files)} files, {total} bytes ({made_by})")


if __name__ == "__main__":
    main(sys.argv[1:])
