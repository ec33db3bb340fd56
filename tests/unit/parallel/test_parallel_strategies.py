"""Unit tests of the two-stage and fully-parallel strategies: their pure functions (who reads or
writes what, deduplication, bucket packing, group checks) without processes, and the wrappers
in a world of one process (no process group)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.base import LoadShardedStrategy
from dist_ckpt.backends.registry import StrategyAction as A
from dist_ckpt.backends.registry import get_default_strategy
from dist_ckpt.errors import CheckpointingException, IncompatibleStrategyError
from dist_ckpt.model.dtypes import SUPPORTED_DTYPE_NAMES
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.parallel import exchange
from dist_ckpt.parallel.exchange import (
    Bucket,
    check_group_consistency,
    distribute_shards_to_ranks,
    plan_buckets,
    shard_from_id,
    shard_id,
    shard_nbytes,
)
from dist_ckpt.parallel.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
    distribute_main_replicas,
)
from dist_ckpt.parallel.two_stage import (
    TwoStageDataParallelLoadShardedStrategy,
    _ShardedTensorMetadata,
    sharded_tensor_chunk_id,
    timed,
)
from tests.unit.backends.zarr.test_zarr_strategy import assert_bits_equal, random_tensor, split_state

# --------------------------------------------------------------------------- assignment


class TestDistributeShardsToRanks:
    def test_balances_equal_candidates(self):
        sizes = {f"s{i}": 10 * (i + 1) for i in range(12)}  # 10..120, total 780
        out = distribute_shards_to_ranks({s: [0, 1, 2, 3] for s in sizes}, sizes, 4)
        load = [sum(sizes[s] for s, r in out.items() if r == rank) for rank in range(4)]
        assert sum(load) == 780
        assert max(load) - min(load) <= max(sizes.values())  # greedy list-scheduling bound
        assert max(load) - min(load) <= 30  # and close to perfect here (195 each)

    def test_respects_candidates_and_constrained_first(self):
        # 'c' can only go to rank 1; the free shards must then favour rank 0
        out = distribute_shards_to_ranks({"a": [0, 1], "b": [0, 1], "c": [1]}, {"a": 4, "b": 4, "c": 4}, 2)
        assert out == {"c": 1, "a": 0, "b": 0}
        out = distribute_shards_to_ranks({"big": [0, 1], "x": [0], "y": [0]}, {"big": 10, "x": 6, "y": 6}, 2)
        assert out["big"] == 1 and out["x"] == out["y"] == 0

    def test_deterministic_whatever_the_input_order(self):
        rng = random.Random(0)
        shards = {f"k{i}": sorted(rng.sample(range(8), rng.randint(1, 8))) for i in range(200)}
        sizes = {k: rng.randint(1, 1000) for k in shards}
        reference = distribute_shards_to_ranks(shards, sizes, 8)
        items = list(shards.items())
        rng.shuffle(items)
        shuffled = {k: list(reversed(v)) for k, v in items}
        assert distribute_shards_to_ranks(shuffled, sizes, 8) == reference
        assert all(reference[k] in shards[k] for k in shards)

    def test_ties_go_to_lowest_rank(self):
        assert distribute_shards_to_ranks({"a": [3, 1, 2]}, {"a": 5}, 4) == {"a": 1}

    @pytest.mark.parametrize("candidates", [[], [4], [-1]])
    def test_bad_candidates(self, candidates):
        with pytest.raises(CheckpointingException, match="range\\(4\\)"):
            distribute_shards_to_ranks({"a": candidates}, {"a": 1}, 4)


class TestDistributeMainReplicas:
    def test_replicated_shards_are_spread(self):
        gathered = [[("a", 8, True), ("b", 8, True)], [("a", 8, False), ("b", 8, False)]]
        assert distribute_main_replicas(gathered) == {"a": 0, "b": 1}

    def test_only_shards_whose_main_replica_is_in_the_group(self):
        # 'x' is held here only as replicas: its main replica lives in another group
        gathered = [[("x", 100, False), ("a", 1, True)], [("x", 100, False)]]
        assert distribute_main_replicas(gathered) == {"a": 0}

    def test_unique_shards_count_towards_balance(self):
        gathered = [[("own0", 50, True), ("rep", 40, True)], [("own1", 10, True), ("rep", 40, False)]]
        assert distribute_main_replicas(gathered) == {"own0": 0, "own1": 1, "rep": 1}

    def test_balanced_within_ten_percent_for_a_data_parallel_state(self):
        rng = random.Random(1)
        sizes = {f"t{i}": rng.randint(1_000, 100_000) for i in range(40)}
        gathered = [[(k, s, r == 0) for k, s in sizes.items()] for r in range(4)]
        out = distribute_main_replicas(gathered)
        load = [sum(sizes[k] for k, r in out.items() if r == rank) for rank in range(4)]
        assert (max(load) - min(load)) / (sum(load) / 4) < 0.10


# --------------------------------------------------------------------------- identity, dedup


def _sh(key="w", shape=(4, 6), offset=(0, 0), dtype=torch.float32, **kw: Any) -> ShardedTensor:
    return ShardedTensor(
        key,
        None,
        dtype,
        shape,
        kw.pop("global_shape", (8, 6)),
        offset,
        None,
        kw.pop("replica_id", 0),
        kw.pop("prepend_axis_num", 0),
        kw.pop("allow_shape_mismatch", False),
        kw.pop("flattened_range", None),
    )


class TestShardIdentity:
    def test_same_data_same_id_regardless_of_replica(self):
        assert shard_id(_sh(replica_id=0)) == shard_id(_sh(replica_id=3))
        assert sharded_tensor_chunk_id(_sh()) == shard_id(_sh())

    @pytest.mark.parametrize(
        "other",
        [
            _sh(offset=(4, 0)),
            _sh(key="v"),
            _sh(dtype=torch.bfloat16),
            _sh(flattened_range=slice(0, 5)),
            _sh(allow_shape_mismatch=True),
            _sh(global_shape=(8, 7)),
        ],
    )
    def test_anything_that_changes_the_bytes_changes_the_id(self, other):
        assert shard_id(other) != shard_id(_sh())

    def test_round_trip_and_sizes(self):
        sh = _sh(flattened_range=slice(3, 11), dtype=torch.bfloat16, allow_shape_mismatch=True)
        back = shard_from_id(shard_id(sh))
        assert shard_id(back) == shard_id(sh) and back.data is None
        assert shard_nbytes(sh) == 8 * 2 and shard_nbytes(_sh()) == 24 * 4
        json.loads(shard_id(sh))  # plain JSON: travels in metadata exchanges


class TestDeduplicateChunks:
    def test_one_reader_per_chunk_among_requesters_balanced(self):
        strategy = TwoStageDataParallelLoadShardedStrategy()
        chunks = [_sh(key=f"k{i}", shape=(i + 1, 6), global_shape=(i + 1, 6)) for i in range(8)]
        metas = [_ShardedTensorMetadata(10 + r, sh, r, shard_nbytes(sh)) for r in range(4) for sh in chunks]
        metas.append(_ShardedTensorMetadata(11, _sh(key="only1"), 1, 96))  # requested by rank 1 only
        chosen = strategy.deduplicate_chunks(metas)
        assert set(chosen) == {shard_id(sh) for sh in chunks} | {shard_id(_sh(key="only1"))}
        assert chosen[shard_id(_sh(key="only1"))].dist_group_rank == 1
        for cid, meta in chosen.items():
            assert shard_id(meta.sharded_tensor_no_data) == cid and meta.global_rank == 10 + meta.dist_group_rank
        load = [sum(m.nbytes for m in chosen.values() if m.dist_group_rank == r) for r in range(4)]
        assert max(load) - min(load) <= max(m.nbytes for m in metas)
        assert strategy.timings["deduplicate_chunks"]  # timed

    def test_timed_records_per_instance(self):
        class Thing:
            def __init__(self) -> None:
                self.timings: Dict[str, List[float]] = {"f": []}

            @timed(verbose=False)
            def f(self, x: int) -> int:
                return x + 1

        a, b = Thing(), Thing()
        assert a.f(1) == 2 and len(a.timings["f"]) == 1 and b.timings["f"] == []


# --------------------------------------------------------------------------- buckets


class TestPlanBuckets:
    def test_only_shared_shards_move_and_buckets_are_bounded(self):
        owner = {"a": 0, "b": 0, "c": 0, "d": 1, "solo": 1}
        needers = {"a": [0, 1], "b": [0, 1], "c": [0, 1], "d": [0, 1], "solo": [1]}
        sizes = {"a": 100, "b": 100, "c": 300, "d": 8, "solo": 10_000}
        buckets = plan_buckets(owner, needers, sizes, bucket_bytes=256)
        assert [(b.src, b.shards) for b in buckets] == [(0, ("a", "b")), (0, ("c",)), (1, ("d",))]
        a_b = buckets[0]
        assert a_b.offsets == (0, 128) and a_b.nbytes == 256  # 64-byte aligned, within the bound
        assert buckets[1].nbytes >= 300  # a bigger shard travels alone
        assert all(off % 64 == 0 for b in buckets for off in b.offsets)

    def test_deterministic(self):
        owner = {f"s{i}": i % 3 for i in range(30)}
        needers = {s: [0, 1, 2] for s in owner}
        sizes = {s: 10 + i for i, s in enumerate(owner)}
        reversed_owner = dict(reversed(list(owner.items())))
        assert plan_buckets(owner, needers, sizes, 100) == plan_buckets(reversed_owner, needers, sizes, 100)

    @pytest.mark.parametrize("name", SUPPORTED_DTYPE_NAMES)
    def test_pack_unpack_round_trip_every_dtype(self, name):
        dtype = getattr(torch, name)
        tensors = {
            "x": random_tensor(dtype, (3, 5), seed=1),
            "s": random_tensor(dtype, (), seed=2),
            "t": random_tensor(dtype, (4, 6), seed=3)[:, ::2],
        }  # non-contiguous source
        sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
        (bucket,) = plan_buckets({k: 0 for k in tensors}, {k: [0, 1] for k in tensors}, sizes, 1 << 20)
        buf = exchange._pack(bucket, tensors, torch.device("cpu"))
        strided = torch.zeros(4, 6, dtype=dtype)[:, 1::2]
        dests = {"x": torch.empty(3, 5, dtype=dtype), "s": torch.empty((), dtype=dtype), "t": strided}
        exchange._unpack(bucket, buf.clone(), dests)
        for k in tensors:
            assert_bits_equal(dests[k].contiguous(), tensors[k].contiguous())

    def test_single_contiguous_shard_travels_without_copy(self):
        t = torch.arange(10.0)
        bucket = Bucket(0, ("x",), (0,), 40)
        assert exchange._pack(bucket, {"x": t}, torch.device("cpu")).data_ptr() == t.data_ptr()
        dest = torch.empty(10)
        buf, in_place = exchange._receive_buffer(bucket, {"x": dest}, torch.device("cpu"))
        assert in_place and buf.data_ptr() == dest.data_ptr()


# --------------------------------------------------------------------------- groups


class TestGroupConsistency:
    def test_consistent_partitions(self):
        assert check_group_consistency([[0, 1, 2, 3]] * 4) == []
        assert check_group_consistency([[0, 2], [1, 3], [0, 2], [1, 3]]) == []
        assert check_group_consistency([[0], [1]]) == []

    def test_member_disagrees(self):
        problems = check_group_consistency([[0, 1], [1]])
        assert problems == ["rank 0 passed group [0, 1] but its member rank 1 passed [1]"]

    def test_not_a_member_and_out_of_range_and_unusable(self):
        assert "does not contain it" in check_group_consistency([[1], [1]])[0]
        assert any("outside the world of 2" in p for p in check_group_consistency([[0, 5], [1]]))
        assert "unusable group: TypeError" in check_group_consistency(["TypeError: bad", [1]])[0]


# --------------------------------------------------------------------------- wrappers, one process


class _CountingLoader(LoadShardedStrategy):
    supported_backends = ("zarr",)
    supported_versions = (1,)

    def __init__(self) -> None:
        self.inner = get_default_strategy(A.LOAD_SHARDED, "zarr", 1)
        self.requested: List[str] = []

    def load(self, sharded_state_dict: Any, checkpoint_dir: Path) -> Any:
        self.requested += [shard_id(v) for v in sharded_state_dict.values() if isinstance(v, ShardedTensor)]
        return self.inner.load(sharded_state_dict, checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir: Path) -> Any:
        return self.inner.load_tensors_metadata(checkpoint_dir)


class TestWrappersInOneProcess:
    @pytest.fixture
    def ckpt(self, tmp_path):
        full = random_tensor(torch.bfloat16, (4, 6), seed=5)
        dc.save(split_state("w", full, 0, 2), tmp_path / "c", sharded_strategy=("zarr", 1))
        return tmp_path / "c", full

    @pytest.mark.parametrize(
        "make",
        [
            lambda base: TwoStageDataParallelLoadShardedStrategy(None, base_strategy=base),
            lambda base: FullyParallelLoadStrategyWrapper(base),
        ],
        ids=["two_stage", "fully_parallel"],
    )
    def test_load_reads_each_shard_once_and_fills_duplicates(self, ckpt, make):
        path, full = ckpt
        counting = _CountingLoader()
        t = torch.empty(4, 6, dtype=torch.bfloat16)
        request = {
            "a": ShardedTensor.from_rank_offsets("w", t),
            "again": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6, dtype=torch.bfloat16)),
            "half": ShardedTensor.from_rank_offsets("w", torch.empty(2, 6, dtype=torch.bfloat16), (0, 1, 2)),
        }
        out = dc.load(request, path, sharded_strategy=make(counting), validate_access_integrity=False)
        assert out["a"] is t and out["again"] is not t
        assert_bits_equal(out["a"], full)
        assert_bits_equal(out["again"], full)
        assert_bits_equal(out["half"], full[2:])
        assert sorted(counting.requested) == sorted({shard_id(request["a"]), shard_id(request["half"])})

    def test_two_stage_resolves_the_registered_loader_and_reports_times(self, ckpt, caplog):
        path, full = ckpt
        strategy = TwoStageDataParallelLoadShardedStrategy()
        out = dc.load(
            {"a": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6, dtype=torch.bfloat16))},
            path,
            sharded_strategy=strategy,
        )
        assert_bits_equal(out["a"], full)
        assert set(strategy.load_tensors_metadata(path)) == {"w"}
        assert strategy.dp_group_ranks == [0]
        with caplog.at_level("INFO", logger="dist_ckpt"):
            summary = strategy.summarize_load_times()
        assert set(summary) == {
            "maybe_init_gloo_group",
            "exchange_loaded_metadata",
            "deduplicate_chunks",
            "load_tensors_from_storage",
            "broadcast_chunks",
        }
        assert "load_tensors_from_storage" in caplog.text
        one = strategy.load_tensor_from_storage(
            path, _ShardedTensorMetadata(0, _sh(dtype=torch.bfloat16, shape=(2, 6), global_shape=(4, 6)), 0, 24)
        )
        assert_bits_equal(one, full[:2])

    def test_two_stage_refuses_to_wrap_itself(self, ckpt):
        path, _ = ckpt
        try:
            dc.register_default_strategy(
                A.LOAD_SHARDED, "zarr", 1, TwoStageDataParallelLoadShardedStrategy, override=True
            )
            with pytest.raises(IncompatibleStrategyError, match="base_strategy"):
                dc.load({"a": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6, dtype=torch.bfloat16))}, path)
        finally:
            from dist_ckpt.backends.registry import unregister_strategy

            unregister_strategy(A.LOAD_SHARDED, "zarr", 1)

    def test_compatibility_is_the_base_strategy_s(self, ckpt):
        with pytest.raises(IncompatibleStrategyError):
            FullyParallelLoadStrategyWrapper(_CountingLoader()).check_backend_compatibility("safetensors")
        with pytest.raises(IncompatibleStrategyError):
            TwoStageDataParallelLoadShardedStrategy(base_strategy=_CountingLoader()).check_version_compatibility(2)
        with pytest.raises(IncompatibleStrategyError, match="no loader is registered"):
            TwoStageDataParallelLoadShardedStrategy().check_backend_compatibility("nope")

    def test_fully_parallel_save_writes_each_shard_once_same_checkpoint(self, tmp_path):
        full = random_tensor(torch.float32, (8, 6), seed=9)
        sd = split_state("w", full, 0, 2)
        for r in range(2):  # replicas of both shards, as in data parallelism
            sd[f"rep{r}"] = ShardedTensor.from_rank_offsets("w", full.chunk(2)[r].clone(), (0, r, 2), replica_id=1)
        wrapper = FullyParallelSaveStrategyWrapper(
            get_default_strategy(A.SAVE_SHARDED, "zarr", 1), do_cache_distribution=True
        )
        rewritten = wrapper.apply_saving_parallelization(sd)
        mains = [k for k, v in rewritten.items() if v.replica_id == 0]
        assert len(mains) == 2 and {rewritten[k].global_offset for k in mains} == {(0, 0), (4, 0)}
        assert all(sd[k].replica_id == (0 if k.startswith("w") else 1) for k in sd)  # caller's objects untouched
        assert wrapper.owned_paths == ("zarr", ".partial-zarr")
        assert wrapper.apply_saving_parallelization(sd).keys() == sd.keys()
        dc.save(sd, tmp_path / "fp", sharded_strategy=wrapper)
        dc.save(sd, tmp_path / "plain", sharded_strategy=("zarr", 1))

        def files(root: Path) -> dict:
            return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "zarr").rglob("*")) if p.is_file()}

        assert files(tmp_path / "fp") == files(tmp_path / "plain")
