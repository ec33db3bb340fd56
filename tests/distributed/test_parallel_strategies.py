"""Multi-rank tests of the two-stage and fully-parallel strategies: who reads and writes how
much, and errors that must reach every rank (never a hang)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

import dist_ckpt as dc
from dist_ckpt.backends.base import LoadShardedStrategy, SaveShardedStrategy
from dist_ckpt.backends.registry import StrategyAction as A
from dist_ckpt.backends.registry import get_default_strategy
from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreLoadShardedStrategy
from dist_ckpt.model.dict_utils import nested_values
from dist_ckpt.parallel import exchange
from dist_ckpt.parallel.exchange import shard_id, shard_nbytes
from dist_ckpt.parallel.fully_parallel import FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper
from dist_ckpt.parallel.two_stage import TwoStageDataParallelLoadShardedStrategy
from dist_ckpt.testing.layouts import bitwise_equal, full_tensor

from .helpers import assert_on_all_ranks, raises_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)

SIZES = [(16 * (i % 5 + 1), 8 + 4 * (i % 3)) for i in range(12)]  # uneven tensor sizes


class CountingLoader(LoadShardedStrategy):
    """Loads with ``inner`` and records every shard it is asked to read from storage."""

    supported_backends = ("zarr",)
    supported_versions = (1,)

    def __init__(self, inner: LoadShardedStrategy, fail_on_rank: Optional[int] = None) -> None:
        self.inner = inner
        self.reads: List[str] = []
        self.fail_on_rank = fail_on_rank

    def load(self, sharded_state_dict: Any, checkpoint_dir: Path) -> Any:
        if rank() == self.fail_on_rank:
            raise OSError(5, "Input/output error (injected)")
        self.reads += [shard_id(v) for v in nested_values(sharded_state_dict) if isinstance(v, dc.ShardedTensor)]
        return self.inner.load(sharded_state_dict, checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir: Path) -> Any:
        return self.inner.load_tensors_metadata(checkpoint_dir)


class CountingSaver(SaveShardedStrategy):
    """Saves with ``inner`` and records the bytes of the main replicas this rank passes on."""

    owned_paths = ("zarr",)

    def __init__(self, inner: SaveShardedStrategy) -> None:
        super().__init__(inner.backend, inner.version)
        self.inner = inner
        self.main_bytes = 0

    def save(self, sharded_state_dict: Any, checkpoint_dir: Path) -> None:
        self.main_bytes += sum(
            shard_nbytes(s)
            for s in nested_values(sharded_state_dict)
            if isinstance(s, dc.ShardedTensor) and dc.is_main_replica(s.replica_id)
        )
        self.inner.save(sharded_state_dict, checkpoint_dir)


def replicated_state(empty: bool = False, tp: int = 1) -> Dict[str, dc.ShardedTensor]:
    """Tensors of SIZES split into ``tp`` row blocks; rank r holds block r % tp, replicated over
    the world // tp ranks with the same block (replica id r // tp)."""
    sd = {}
    t, replica = rank() % tp, rank() // tp
    for i, shape in enumerate(SIZES):
        full = full_tensor(f"t{i}", shape)
        local = full.chunk(tp)[t].clone()
        sd[f"t{i}"] = dc.ShardedTensor.from_rank_offsets(
            f"t{i}", torch.zeros_like(local) if empty else local, (0, t, tp), replica_id=replica
        )
    return sd


def check_loaded(loaded: Dict[str, torch.Tensor], tp: int = 1) -> None:
    bad = [
        k
        for i, k in enumerate(f"t{i}" for i in range(len(SIZES)))
        if not bitwise_equal(loaded[k], full_tensor(k, SIZES[i]).chunk(tp)[rank() % tp])
    ]
    assert_on_all_ranks(not bad, f"wrong data for {bad}")


def gather(obj: Any) -> List[Any]:
    out: List[Any] = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def dp_groups(tp: int) -> List[Any]:
    """One group per TP index (ranks with the same r % tp), created on every rank."""
    return [dist.new_group([r for r in range(world()) if r % tp == t]) for t in range(tp)]


LOADERS: Dict[str, Callable[[], LoadShardedStrategy]] = {
    "zarr": lambda: get_default_strategy(A.LOAD_SHARDED, "zarr", 1),  # type: ignore[dict-item,return-value]
    "tensorstore": TensorStoreLoadShardedStrategy,
}
WRAPPERS: Dict[str, Callable[[LoadShardedStrategy, Any], LoadShardedStrategy]] = {
    "two_stage": lambda base, group: TwoStageDataParallelLoadShardedStrategy(group, base_strategy=base),
    "fully_parallel": lambda base, group: FullyParallelLoadStrategyWrapper(base, group),
}


# --------------------------------------------------------------------------- reads


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("engine", LOADERS)
@pytest.mark.parametrize("tp", [1, 2])
def test_each_chunk_read_once_per_data_parallel_group(engine, wrapper, tp, shared_tmp_path: Path) -> None:
    """DP = world / tp. Every rank of a DP group requests the same chunks; storage reads of the
    group must cover them exactly once, balanced in bytes across the group."""
    if world() % tp:
        pytest.skip("world not divisible by tp")
    dc.save(replicated_state(tp=tp), shared_tmp_path, sharded_strategy=("zarr", 1))
    groups = dp_groups(tp)
    group = groups[rank() % tp] if tp > 1 else None
    counting = CountingLoader(LOADERS[engine]())
    loaded = dc.load(
        replicated_state(empty=True, tp=tp), shared_tmp_path, sharded_strategy=WRAPPERS[wrapper](counting, group)
    )
    check_loaded(loaded, tp)

    requested = sorted(shard_id(sh) for sh in replicated_state(empty=True, tp=tp).values())
    sizes = {shard_id(sh): shard_nbytes(sh) for sh in replicated_state(empty=True, tp=tp).values()}
    everyone = gather((rank() % tp, requested, sorted(counting.reads), sum(sizes[r] for r in counting.reads)))
    problems = []
    for t in range(tp):
        members = [e for e in everyone if e[0] == t]
        reads = sorted(r for e in members for r in e[2])
        if reads != members[0][1]:  # each requested chunk exactly once in the group
            problems.append(f"group {t}: {len(reads)} reads for {len(members[0][1])} chunks (duplicates or gaps)")
        per_rank = [e[3] for e in members]
        if len(members) > 1 and max(per_rank) - min(per_rank) > max(sizes.values()):
            problems.append(f"group {t}: bytes read per rank unbalanced: {per_rank}")
        if len(members) > 1 and min(per_rank) == 0:
            problems.append(f"group {t}: a rank read nothing: {per_rank}")
    assert_on_all_ranks(not problems, "; ".join(problems))


def test_two_stage_mirrors_non_gloo_groups_with_gloo(shared_tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_transfer: a DP group of another backend (pretend NCCL) gets a gloo twin for the broadcasts."""
    dc.save(replicated_state(), shared_tmp_path, sharded_strategy=("zarr", 1))
    monkeypatch.setattr(exchange, "group_backend", lambda group=None: "nccl")
    strategy = TwoStageDataParallelLoadShardedStrategy(None, cpu_transfer=True)
    loaded = dc.load(replicated_state(empty=True), shared_tmp_path, sharded_strategy=strategy)
    check_loaded(loaded)
    mirrored = strategy.data_parallel_group
    ok = (
        mirrored is not None
        and dist.get_process_group_ranks(mirrored) == list(range(world()))
        and dist.get_backend(mirrored) == "gloo"
    )
    assert_on_all_ranks(ok, f"data-parallel group not mirrored: {mirrored}")
    # without cpu_transfer the group is used as given
    strategy = TwoStageDataParallelLoadShardedStrategy(None, cpu_transfer=False)
    check_loaded(dc.load(replicated_state(empty=True), shared_tmp_path, sharded_strategy=strategy))
    assert_on_all_ranks(strategy.data_parallel_group is None, "group replaced without cpu_transfer")


# --------------------------------------------------------------------------- fully parallel save


def test_fully_parallel_save_balances_bytes_and_writes_the_same_checkpoint(shared_tmp_path: Path) -> None:
    """Most bytes replicated over DP = world, a few held by one rank each: the bytes written
    per rank are balanced within 10 %, where a plain save puts them all on rank 0."""

    def state() -> Dict[str, dc.ShardedTensor]:
        sd = {
            f"rep{i}": dc.ShardedTensor.from_rank_offsets(
                f"rep{i}", full_tensor(f"rep{i}", (32 + 8 * i, 64)), replica_id=rank()
            )
            for i in range(24)
        }
        own = full_tensor("own", (16 * world(), 32)).chunk(world())[rank()].clone()
        sd["own"] = dc.ShardedTensor.from_rank_offsets("own", own, (0, rank(), world()))
        return sd

    plain = CountingSaver(get_default_strategy(A.SAVE_SHARDED, "zarr", 1))  # type: ignore[arg-type]
    dc.save(state(), shared_tmp_path / "plain", sharded_strategy=plain)
    counting = CountingSaver(get_default_strategy(A.SAVE_SHARDED, "zarr", 1))  # type: ignore[arg-type]
    dc.save(state(), shared_tmp_path / "fp", sharded_strategy=FullyParallelSaveStrategyWrapper(counting))

    def spread(values: List[int]) -> float:
        return (max(values) - min(values)) / (sum(values) / len(values))

    plain_bytes, fp_bytes = gather(plain.main_bytes), gather(counting.main_bytes)
    assert_on_all_ranks(sum(plain_bytes) == sum(fp_bytes), f"plain wrote {plain_bytes}, fully parallel {fp_bytes}")
    assert_on_all_ranks(spread(plain_bytes) > 0.5, f"the plain save was already balanced: {plain_bytes}")
    assert_on_all_ranks(spread(fp_bytes) <= 0.10, f"bytes written per rank not balanced within 10%: {fp_bytes}")

    same, detail = True, ""
    if rank() == 0:

        def files(root: Path) -> Dict[str, bytes]:
            return {str(p.relative_to(root)): p.read_bytes() for p in sorted((root / "zarr").rglob("*")) if p.is_file()}

        a, b = files(shared_tmp_path / "plain"), files(shared_tmp_path / "fp")
        same = a == b
        detail = f"differ: {sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))[:5]}"
    assert_on_all_ranks(same, detail)
    loaded = dc.load(state(), shared_tmp_path / "fp")
    bad = [k for k, sh in state().items() if not bitwise_equal(loaded[k], sh.data)]
    assert_on_all_ranks(not bad, f"fully-parallel checkpoint loads wrong data for {bad}")


def test_fully_parallel_save_caches_its_distribution(shared_tmp_path: Path) -> None:
    wrapper = FullyParallelSaveStrategyWrapper(
        get_default_strategy(A.SAVE_SHARDED, "zarr", 1), do_cache_distribution=True
    )  # type: ignore[arg-type]
    first = wrapper.apply_saving_parallelization(replicated_state())
    cached = wrapper._cached
    second = wrapper.apply_saving_parallelization(replicated_state())
    same = {k: v.replica_id for k, v in first.items()} == {k: v.replica_id for k, v in second.items()}
    assert_on_all_ranks(same and wrapper._cached is cached, "cached distribution not reused")
    changed = replicated_state()
    if rank() == 1:
        changed.pop("t0")  # one rank's shards change: every rank must recompute
    wrapper.apply_saving_parallelization(changed)
    assert_on_all_ranks(wrapper._cached is not cached, "stale distribution reused")
    dc.save(replicated_state(), shared_tmp_path, sharded_strategy=wrapper)
    check_loaded(dc.load(replicated_state(empty=True), shared_tmp_path))


# --------------------------------------------------------------------------- errors everywhere


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_missing_chunk_raises_the_same_error_everywhere(wrapper, shared_tmp_path: Path) -> None:
    dc.save(replicated_state(), shared_tmp_path, sharded_strategy=("zarr", 1))
    chunk = shared_tmp_path / "zarr" / "t7" / "c.0.0"
    dist.barrier()
    if rank() == 0:
        os.unlink(chunk)
    dist.barrier()
    strategy = WRAPPERS[wrapper](LOADERS["tensorstore"](), None)
    err = raises_on_all_ranks(
        dc.CorruptCheckpointError,
        lambda: dc.load(replicated_state(empty=True), shared_tmp_path, sharded_strategy=strategy),
    )
    assert_on_all_ranks("'t7'" in str(err) and str(chunk) in str(err) and "missing" in str(err), str(err))


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_read_failure_on_one_rank_raises_everywhere(wrapper, shared_tmp_path: Path) -> None:
    dc.save(replicated_state(), shared_tmp_path, sharded_strategy=("zarr", 1))
    strategy = WRAPPERS[wrapper](CountingLoader(LOADERS["zarr"](), fail_on_rank=1), None)
    err = raises_on_all_ranks(
        dc.RankFailedError, lambda: dc.load(replicated_state(empty=True), shared_tmp_path, sharded_strategy=strategy)
    )
    assert_on_all_ranks("[rank 1]" in str(err) and "injected" in str(err), str(err))


def _mismatched_group() -> Any:
    """Rank 0 passes the whole world; every other rank a group of itself alone."""
    everyone = dist.new_group(list(range(world())))
    alone = [dist.new_group([r]) for r in range(world())]
    return everyone if rank() == 0 else alone[rank()]


@pytest.mark.parametrize("kind", ["two_stage", "fully_parallel_load", "fully_parallel_save"])
def test_mismatched_groups_raise_everywhere(kind, shared_tmp_path: Path) -> None:
    dc.save(replicated_state(), shared_tmp_path / "ok", sharded_strategy=("zarr", 1))
    group = _mismatched_group()
    base = LOADERS["zarr"]()
    if kind == "fully_parallel_save":
        strategy: Any = FullyParallelSaveStrategyWrapper(get_default_strategy(A.SAVE_SHARDED, "zarr", 1), group)  # type: ignore[arg-type]
        action = lambda: dc.save(replicated_state(), shared_tmp_path / "new", sharded_strategy=strategy)  # noqa: E731
    else:
        strategy = WRAPPERS["two_stage" if kind == "two_stage" else "fully_parallel"](base, group)
        action = lambda: dc.load(replicated_state(empty=True), shared_tmp_path / "ok", sharded_strategy=strategy)  # noqa: E731
    err = raises_on_all_ranks(dc.ProcessGroupMismatchError, action)
    assert_on_all_ranks("rank 0 passed group" in str(err) and "[1]" in str(err), str(err))
    assert_on_all_ranks(not (shared_tmp_path / "new" / "metadata.json").exists(), "a checkpoint was committed")


@pytest.mark.parametrize("side", ["_unpack", "_pack"])
def test_rank_failing_mid_broadcast_raises_everywhere_and_keeps_ranks_in_step(
    side, shared_tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 fails on its first packed bucket (receiving, or sending); it must keep taking part
    in the broadcasts that follow (or the others would hang), and all ranks raise its error."""
    dc.save(replicated_state(), shared_tmp_path, sharded_strategy=("zarr", 1))
    real_broadcast = exchange.broadcast_tensor
    events: List[str] = []

    def failing(*args: Any) -> Any:
        events.append("failed")
        raise RuntimeError(f"injected failure in {side}")

    def broadcast(*args: Any, **kwargs: Any) -> None:
        events.append("broadcast")
        real_broadcast(*args, **kwargs)

    if rank() == 1:
        monkeypatch.setattr(exchange, side, failing)
        monkeypatch.setattr(exchange, "broadcast_tensor", broadcast)
    strategy = TwoStageDataParallelLoadShardedStrategy(None, bucket_bytes=4096)  # several packed buckets per rank
    err = raises_on_all_ranks(
        dc.RankFailedError, lambda: dc.load(replicated_state(empty=True), shared_tmp_path, sharded_strategy=strategy)
    )
    assert_on_all_ranks("[rank 1]" in str(err) and f"injected failure in {side}" in str(err), str(err))
    took_part = "failed" in events and "broadcast" in events[events.index("failed") :]
    assert_on_all_ranks(took_part if rank() == 1 else True, f"rank 1 did not broadcast after failing: {events}")
    monkeypatch.undo()
    # every rank left the broadcasts at the same point: the next collective load works
    check_loaded(
        dc.load(
            replicated_state(empty=True),
            shared_tmp_path,
            sharded_strategy=TwoStageDataParallelLoadShardedStrategy(None, bucket_bytes=4096),
        )
    )
