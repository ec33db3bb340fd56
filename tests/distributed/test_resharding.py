"""Backend conformance suite: save in one parallel layout, load in another, compare bit-exactly.

Every test runs for every (save strategy, load strategy) combination of
helpers.strategy_combinations(): each registered sharded backend, each alternative engine of a
format against the default one (zarr-python <-> TensorStore), and the two-stage and
fully-parallel wrappers around the defaults; at 2 and at 4 ranks. Layouts may have more
participants than ranks (see dist_ckpt.testing.layouts), so "TP=4" is also exercised at 2
ranks; the 4-rank session runs them on four real processes.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.errors import LoadMismatchError
from dist_ckpt.testing import spawn_ranks
from dist_ckpt.testing.layouts import (
    bitwise_equal,
    expected_data,
    flat_shards,
    full_tensor,
    numel_bytes,
    participants_of,
    tp_shards,
)
from tests.deadlines import scaled

from .helpers import (
    StrategyCombo,
    assert_on_all_ranks,
    combo_named,
    raises_on_all_ranks,
    rank,
    strategy_combinations,
    world,
)

pytestmark = pytest.mark.mpi(min_size=2)

COMBOS = strategy_combinations()
by_name = lambda c: c.name  # noqa: E731 -- test ids
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
SHAPES = {"row": ((16, 12), 0), "col": ((12, 16), 1), "bias": ((16,), 0), "cube": ((8, 4, 8), 2)}


def model_state(tp: int, dtype: torch.dtype, empty: bool = False) -> Dict[str, dc.ShardedTensor]:
    """Row-, column-parallel weights, a bias, a 3-D tensor split on its last axis, and a
    replicated layernorm weight (TP=1 with replicas)."""
    sd: Dict[str, dc.ShardedTensor] = {}
    for name, (shape, axis) in SHAPES.items():
        sd.update(tp_shards(name, full_tensor(name, shape, dtype), axis, tp, rank(), world(), empty=empty))
    sd.update(tp_shards("ln", full_tensor("ln", (16,), dtype), 0, 1, rank(), world(), empty=empty))
    return sd


def check_loaded(loaded: dict, request: Dict[str, dc.ShardedTensor]) -> None:
    bad = []
    for sd_key, sh in request.items():
        full = full_tensor(sh.key, _global_shape(sh), sh.dtype)
        got = loaded[sd_key]
        if not bitwise_equal(got, expected_data(sh, full)):
            bad.append(sd_key)
        if sh.data is not None and got is not sh.data:
            bad.append(f"{sd_key} (not loaded in place)")
    assert_on_all_ranks(not bad, f"mismatched tensors: {bad}")


def _global_shape(sh: dc.ShardedTensor) -> Tuple[int, ...]:
    return sh.global_shape


@pytest.mark.parametrize("combo", COMBOS, ids=by_name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("src_tp,dst_tp", [(4, 2), (2, 4), (4, 1), (1, 4)])
def test_tensor_parallel_resharding(combo: StrategyCombo, dtype, src_tp, dst_tp, shared_tmp_path: Path) -> None:
    dc.save(model_state(src_tp, dtype), shared_tmp_path, sharded_strategy=combo.save())
    request = model_state(dst_tp, dtype, empty=True)
    loaded = dc.load(request, shared_tmp_path, sharded_strategy=combo.load())
    check_loaded(loaded, request)


def stacked_layers(pp: int, tp: int, empty: bool = False) -> Dict[str, dc.ShardedTensor]:
    """8 layers stacked on a leading axis (prepend_axis_num=1); pipeline stage s owns layers
    [s * 8/pp, (s+1) * 8/pp), each split over tp ranks; leftover ranks are DP replicas."""
    layers, full = 8, full_tensor("layers.w", (8, 12, 8), torch.float32)
    dp = max(1, world() // (pp * tp))
    per_stage, size = layers // pp, 12 // tp
    sd: Dict[str, dc.ShardedTensor] = {}
    for v in participants_of(rank(), world(), pp * tp * dp):
        t, stage, d = v % tp, (v // tp) % pp, v // (tp * pp)
        for layer in range(stage * per_stage, (stage + 1) * per_stage):
            local = full[layer].narrow(0, t * size, size).clone()
            if empty:
                local.zero_()
            sd[f"L{layer}tp{t}dp{d}"] = dc.ShardedTensor.from_rank_offsets(
                "layers.w", local, (0, layer, layers), (1, t, tp), replica_id=d, prepend_axis_num=1
            )
    return sd


@pytest.mark.parametrize("combo", COMBOS, ids=by_name)
@pytest.mark.parametrize("src,dst", [((4, 1), (2, 2)), ((2, 2), (4, 1)), ((1, 4), (4, 2))], ids=str)
def test_pipeline_stages_regrouped(combo: StrategyCombo, src, dst, shared_tmp_path: Path) -> None:
    """Layers stacked with prepend_axis_num=1 move between pipeline stages and TP splits."""
    saved = stacked_layers(*src)
    dc.save(saved, shared_tmp_path, sharded_strategy=combo.save())
    request = stacked_layers(*dst, empty=True)
    loaded = dc.load(request, shared_tmp_path, sharded_strategy=combo.load())
    full = full_tensor("layers.w", (8, 12, 8), torch.float32)
    bad = [k for k, sh in request.items() if not bitwise_equal(loaded[k], expected_data(sh, full))]
    assert_on_all_ranks(not bad, f"mismatched layers: {bad}")
    # the whole stacked tensor is readable as one global tensor
    plain = dc.load_plain_tensors(shared_tmp_path)
    assert_on_all_ranks(bitwise_equal(plain["layers.w"], full), "plain load differs")


def _files_bytes(root: Path, exclude=("zarr.json", "metadata.json", "common.pt")) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f not in exclude and not f.endswith(".json"):
                total += os.path.getsize(os.path.join(dirpath, f))
    return total


@pytest.mark.parametrize("combo", COMBOS, ids=by_name)
def test_only_main_replicas_are_written(combo: StrategyCombo, shared_tmp_path: Path) -> None:
    """With DP replicas holding *different* (wrong) data, only the main replica reaches disk.

    A saver that may write any replica (fully parallel) gets identical replicas and must still
    write each shard exactly once."""
    tp, dp = 2, 2
    # large enough that per-file overhead (the torch_dist format: a zip archive per chunk and a
    # pickled .metadata, ~6 KB here) stays small against the data
    full = full_tensor("w", (256, 64), torch.float32)
    sd = tp_shards("w", full, 0, tp, rank(), world(), dp=dp)
    for sh in sd.values():
        if sh.replica_id != 0 and not combo.any_replica_writes:
            sh.data.fill_(-1.0)  # a replica that was written would corrupt the result
    dc.save(sd, shared_tmp_path, sharded_strategy=combo.save())
    written = _files_bytes(shared_tmp_path)
    expected = numel_bytes(full.shape, full.dtype)
    assert_on_all_ranks(
        expected <= written < expected * 1.25, f"{written} bytes on disk for {expected} bytes of main replicas"
    )
    request = tp_shards("w", full, 0, 1, rank(), world(), empty=True)
    loaded = dc.load(request, shared_tmp_path, sharded_strategy=combo.load())
    assert_on_all_ranks(all(bitwise_equal(loaded[k], full) for k in request), "replica data leaked into the checkpoint")


def _load_flat_at(rank_: int, world_size: int, ckpt: str, dp: int, combo_name: str) -> bool:
    """Runs in a fresh job of ``world_size`` ranks: loads flattened and whole layouts."""
    combo = combo_named(combo_name)
    full = full_tensor("opt.exp_avg", (24, 10), torch.float32)
    ok = True
    for request in (
        flat_shards("opt.exp_avg", full, 0, 1, dp, rank_, world_size, empty=True, reverse=True),
        tp_shards("opt.exp_avg", full, 0, 2, rank_, world_size, empty=True),
    ):
        loaded = dc.load(request, ckpt, sharded_strategy=combo.load())
        ok = ok and all(bitwise_equal(loaded[k], expected_data(sh, full)) for k, sh in request.items())
    return ok


def _load_single_process(ckpt: str, combo_name: str) -> bool:
    """Runs in a fresh process with no process group at all: whole tensors, and the metadata of
    the flattened one as saved (Megatron-Core's load_tensors_metadata), which loads it flat."""
    import torch.distributed

    assert not torch.distributed.is_initialized()
    strategy = combo_named(combo_name).load()
    full = full_tensor("opt.exp_avg", (24, 10), torch.float32)
    w = full_tensor("w", (8, 6))
    request = {"w": dc.ShardedTensor.from_rank_offsets("opt.exp_avg", torch.zeros(24, 10))}
    loaded = dc.load(request, ckpt, sharded_strategy=strategy)
    meta = dc.load_tensors_metadata(ckpt)
    flat = meta["opt.exp_avg"]
    described = (flat.local_shape, flat.global_shape, flat.flattened_range, meta["w"].flattened_range) == (
        (24, 10),
        (24, 10),
        slice(0, 240),
        None,
    )
    from_meta = dc.load(meta, ckpt, sharded_strategy=strategy)
    plain = dc.load_plain_tensors(ckpt)
    return (
        bitwise_equal(loaded["w"], full)
        and described
        and all(bitwise_equal(out["opt.exp_avg"], full.flatten()) for out in (from_meta, plain))
        and all(bitwise_equal(out["w"], w) for out in (from_meta, plain))
    )


@pytest.mark.parametrize("combo", COMBOS, ids=by_name)
def test_flattened_ranges_saved_at_4_loaded_at_2_and_1(combo: StrategyCombo, shared_tmp_path: Path) -> None:
    """Distributed-optimizer state (TP=2 x DP=2 flattened ranges) saved by 4 participants, beside
    a TP-sharded weight, loaded by a 2-rank job (DP=2, other cut points; and as whole TP
    shards), by one process (also through load_tensors_metadata, which describes the flattened
    tensor as saved) and by every rank from that metadata."""
    full = full_tensor("opt.exp_avg", (24, 10), torch.float32)
    saved = flat_shards("opt.exp_avg", full, 0, 2, 2, rank(), world())
    saved.update(tp_shards("w", full_tensor("w", (8, 6)), 1, 2, rank(), world()))
    dc.save(saved, shared_tmp_path, sharded_strategy=combo.save())
    meta = dc.load_tensors_metadata(shared_tmp_path)  # every rank, whole tensors, as in Megatron-Core's test
    for sh in meta.values():
        sh.replica_id = rank()
    from_meta = dc.load(meta, shared_tmp_path, sharded_strategy=combo.load())
    assert_on_all_ranks(
        bitwise_equal(from_meta["opt.exp_avg"], full.flatten())
        and bitwise_equal(from_meta["w"], full_tensor("w", (8, 6))),
        "load of load_tensors_metadata differs",
    )
    ok, detail = True, ""
    if rank() == 0:
        try:
            ok = all(spawn_ranks(_load_flat_at, 2, str(shared_tmp_path), 2, combo.name, timeout_s=scaled(60)))
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                ok = ok and pool.apply(_load_single_process, (str(shared_tmp_path), combo.name))
        except Exception as e:  # noqa: BLE001 -- reported on every rank below
            ok, detail = False, repr(e)
    assert_on_all_ranks(ok, f"flattened load in another world size differs {detail}")


#: stored dtype of each tensor of the cast tests, and two assignments of requested dtypes
CAST_STORED = {"cast.f32": torch.float32, "cast.i64": torch.int64, "cast.bf16": torch.bfloat16}
CAST_REQUESTS = [
    {"cast.f32": torch.bfloat16, "cast.i64": torch.float32, "cast.bf16": torch.float16},
    {"cast.f32": torch.float16, "cast.i64": torch.bfloat16, "cast.bf16": torch.float32},
]
CAST_SHAPE = (16, 12)


def _cast_full(key: str, dtype: torch.dtype, rows: int = CAST_SHAPE[0]) -> torch.Tensor:
    """The stored tensor ``key`` as a load into ``dtype`` must return it (zero rows past the
    stored ones: allow_shape_mismatch pads)."""
    out = torch.zeros((rows, CAST_SHAPE[1]), dtype=dtype)
    out[: CAST_SHAPE[0]] = full_tensor(key, CAST_SHAPE, CAST_STORED[key]).to(dtype)
    return out


def _cast_requests(dtypes: Dict[str, torch.dtype]) -> Tuple[Dict[str, dc.ShardedTensor], Dict[str, dc.ShardedTensor]]:
    """Two loads of every key in its requested dtype: TP=4 row shards, and distributed-optimizer
    flattened ranges (TP=2 x DP=2, other cut points than the save) of a tensor padded by two
    rows (allow_shape_mismatch)."""
    tp: Dict[str, dc.ShardedTensor] = {}
    flat: Dict[str, dc.ShardedTensor] = {}
    for key, dtype in dtypes.items():
        tp.update(tp_shards(key, torch.zeros(CAST_SHAPE, dtype=dtype), 0, 4, rank(), world(), empty=True))
        padded = torch.zeros((CAST_SHAPE[0] + 2, CAST_SHAPE[1]), dtype=dtype)
        for k, sh in flat_shards(key, padded, 0, 2, 2, rank(), world(), empty=True, reverse=True).items():
            flat[k] = dataclasses.replace(sh, allow_shape_mismatch=True)
    return tp, flat


@pytest.mark.parametrize("combo", COMBOS, ids=by_name)
def test_dtype_cast_on_load(combo: StrategyCombo, shared_tmp_path: Path) -> None:
    """fp32, int64 and bf16 tensors saved at TP=2 load into bf16 / fp32 / fp16 requests at TP=4
    and as padded flattened ranges, equal to ``stored.to(requested)``; allow_dtype_cast=False
    raises LoadMismatchError on every rank naming the key, the checkpoint and both dtypes."""
    saved: Dict[str, dc.ShardedTensor] = {}
    for key, dtype in CAST_STORED.items():
        saved.update(tp_shards(key, full_tensor(key, CAST_SHAPE, dtype), 0, 2, rank(), world()))
    dc.save(saved, shared_tmp_path, sharded_strategy=combo.save())
    bad = []
    for dtypes in CAST_REQUESTS:
        for request in _cast_requests(dtypes):
            loaded = dc.load(request, shared_tmp_path, sharded_strategy=combo.load())
            for k, sh in request.items():
                if not bitwise_equal(loaded[k], expected_data(sh, _cast_full(sh.key, sh.dtype, sh.global_shape[0]))):
                    bad.append(f"{k} as {sh.dtype}")
                if loaded[k] is not sh.data:
                    bad.append(f"{k} (not loaded in place)")
    assert_on_all_ranks(not bad, f"mismatched casts: {bad}")
    strict, _ = _cast_requests({"cast.f32": torch.bfloat16})
    error = raises_on_all_ranks(
        LoadMismatchError,
        lambda: dc.load(strict, shared_tmp_path, sharded_strategy=combo.load(), allow_dtype_cast=False),
        "'cast.f32'",
    )
    msg = str(error)
    assert_on_all_ranks(
        all(s in msg for s in ("[rank ", str(shared_tmp_path), "torch.float32", "torch.bfloat16", "allow_dtype_cast")),
        msg,
    )


@pytest.mark.parametrize("combo", COMBOS, ids=by_name)
def test_sharded_objects_and_common_state(combo: StrategyCombo, shared_tmp_path: Path) -> None:
    sd = {
        "rng": dc.ShardedObject("rng", {"rank": rank(), "state": torch.arange(rank() + 3)}, (world(),), (rank(),)),
        "shared_cfg": dc.ShardedObject("cfg", {"lr": 0.1}, (1,), (0,), replica_id=rank()),
        "step": 42,
        "nested": {"lists": [1, 2, {"x": torch.ones(2)}]},
        "local": dc.LocalNonPersistentObject(f"local-{rank()}"),
        "w": tp_shards("w", full_tensor("w", (8,)), 0, 2, rank(), world()),
    }
    dc.save(sd, shared_tmp_path, sharded_strategy=combo.save())
    request = {
        "rng": dc.ShardedObject("rng", None, (world(),), (rank(),)),
        "shared_cfg": dc.ShardedObject("cfg", None, (1,), (0,), replica_id=rank()),
        "local": dc.LocalNonPersistentObject(f"restored-{rank()}"),
        "w": tp_shards("w", full_tensor("w", (8,)), 0, 1, rank(), world(), empty=True),
    }
    loaded = dc.load(request, shared_tmp_path, sharded_strategy=combo.load())
    ok = (
        all(bitwise_equal(t, full_tensor("w", (8,))) for t in loaded["w"].values())
        and loaded["rng"]["rank"] == rank()
        and torch.equal(loaded["rng"]["state"], torch.arange(rank() + 3))
        and loaded["shared_cfg"] == {"lr": 0.1}
        and loaded["step"] == 42
        and torch.equal(loaded["nested"]["lists"][2]["x"], torch.ones(2))
        and loaded["local"] == f"restored-{rank()}"
    )
    assert_on_all_ranks(ok, f"loaded {loaded}")
