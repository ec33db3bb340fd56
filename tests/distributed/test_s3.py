"""Multi-rank saves and loads on S3: a real S3 API server (moto) on 127.0.0.1, started by rank 0.

Resharding round trips for every backend that works on object stores, the bytes each rank
downloads (counted at the server, per rank), transient 5xx errors survived by retries, a save
killed before its commit, wrong credentials and a missing bucket -- all through
``dist_ckpt.save`` / ``dist_ckpt.load`` on every rank.
"""

from __future__ import annotations

import os
import signal
import uuid
from typing import Any, Dict, Iterator, List, Optional

import pytest
import torch
import torch.distributed as dist

import dist_ckpt as dc
from dist_ckpt.errors import CheckpointingException, NotACheckpointError
from dist_ckpt.storage import BucketNotFoundError, StorageAuthError, open_storage
from dist_ckpt.storage.s3 import S3StorageOptions
from dist_ckpt.testing import spawn_ranks
from dist_ckpt.testing.layouts import bitwise_equal, expected_data, full_tensor, tp_shards
from dist_ckpt.training.checkpoints import find_latest_checkpoint, next_checkpoint_path
from tests.deadlines import scaled

from .helpers import assert_on_all_ranks, raises_on_all_ranks, rank, world

pytestmark = pytest.mark.mpi(min_size=2)

KiB = 1 << 10
#: fast retries: the injected errors are answered at once, no need to wait 0.1 s and up
FAST = dict(max_retries=4, initial_backoff_s=0.01, max_backoff_s=0.05)


def _broadcast(value: Any) -> Any:
    holder = [value if rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


@pytest.fixture(scope="module")
def s3(process_group: None) -> Iterator[Optional[Any]]:
    """The server (on rank 0; None elsewhere), its AWS variables set on every rank for the module.

    Skipped on every rank alike when moto or obstore is missing (except under CI)."""
    missing = None
    if rank() == 0:
        for module in ("moto", "obstore", "boto3"):
            try:
                __import__(module)
            except ImportError:
                missing = module
    missing = _broadcast(missing)
    if missing is not None:
        if os.environ.get("CI"):
            raise ImportError(f"{missing} is not installed; the CI installs dist_ckpt[test]")
        pytest.skip(f"{missing} is not installed (pip install 'dist_ckpt[test]')")
    server = None
    env: Optional[Dict[str, str]] = None
    error = None
    if rank() == 0:
        from tests.s3_server import S3TestServer

        try:
            server = S3TestServer().start()
            env = dict(server.env(), AWS_EC2_METADATA_DISABLED="true")
        except Exception as e:  # noqa: BLE001 -- reported on every rank
            error = repr(e)
    env, error = _broadcast((env, error))
    assert_on_all_ranks(error is None, f"the S3 test server did not start: {error}")
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield server
    finally:
        dist.barrier()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if server is not None:
            server.stop()


@pytest.fixture
def url(s3: Optional[Any], request: pytest.FixtureRequest) -> str:
    """A fresh s3:// prefix for this test, the same on every rank."""
    if s3 is not None:
        s3.clear_faults()
        s3.clear_requests()
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:50]
    bucket = _broadcast(s3.bucket if s3 is not None else None)
    return str(_broadcast(f"s3://{bucket}/distributed/{name}-{uuid.uuid4().hex[:8]}"))


def _state(tp: int, empty: bool = False) -> Dict[str, dc.ShardedTensor]:
    """A row-parallel and a column-parallel weight, a bias and a replicated layernorm, split
    ``tp`` ways over the ranks (a rank may hold several shards when tp > world)."""
    sd: Dict[str, dc.ShardedTensor] = {}
    for name, shape, axis, dtype in (
        ("row", (64, 96), 0, torch.float32),
        ("col", (48, 64), 1, torch.bfloat16),
        ("bias", (64,), 0, torch.int64),
    ):
        sd.update(tp_shards(name, full_tensor(name, shape, dtype), axis, tp, rank(), world(), empty=empty))
    sd.update(tp_shards("ln", full_tensor("ln", (64,), torch.float32), 0, 1, rank(), world(), empty=empty))
    return sd


def _mismatches(loaded: Dict[str, Any], request: Dict[str, dc.ShardedTensor]) -> List[str]:
    return [
        k
        for k, sh in request.items()
        if not bitwise_equal(loaded[k], expected_data(sh, full_tensor(sh.key, sh.global_shape, sh.dtype)))
    ]


def _backends() -> List[str]:
    names = ["safetensors"]
    for module, name in (("zarr", "zarr"), ("tensorstore", "tensorstore")):
        try:
            __import__(module)
            names.append(name)
        except ImportError:
            pass
    return names


def _save_strategy(backend: str) -> Any:
    if backend == "safetensors":
        return None  # the default
    if backend == "zarr":
        return ("zarr", 1)
    from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreSaveShardedStrategy

    return TensorStoreSaveShardedStrategy()


def _load_strategy(backend: str) -> Any:
    if backend == "zarr":  # read zarr-python's checkpoint with TensorStore, and TensorStore's with zarr-python
        from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreLoadShardedStrategy

        return TensorStoreLoadShardedStrategy()
    return None  # the default loader of the saved backend


@pytest.fixture
def quiet_tensorstore(tmp_path: Any) -> Iterator[None]:
    """TensorStore's AWS library logs an error for each missing ~/.aws file: give it empty ones."""
    saved = {name: os.environ.get(name) for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")}
    for name, file in (("AWS_CONFIG_FILE", "config"), ("AWS_SHARED_CREDENTIALS_FILE", "credentials")):
        (tmp_path / file).write_text("")
        os.environ[name] = str(tmp_path / file)
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("src_tp,dst_tp", [(4, 2), (2, 1)])
def test_resharding_round_trip(url: str, backend: str, src_tp: int, dst_tp: int, quiet_tensorstore: None) -> None:
    dc.save(_state(src_tp), url, sharded_strategy=_save_strategy(backend))
    request = _state(dst_tp, empty=True)
    loaded = dc.load(request, url, sharded_strategy=_load_strategy(backend))
    bad = _mismatches(loaded, request)
    assert_on_all_ranks(not bad, f"{backend}: tensors differ after resharding TP {src_tp} -> {dst_tp}: {bad}")


def _slice_state(parts: int, empty: bool) -> Dict[str, dc.ShardedTensor]:
    """One 256 KiB-a-rank tensor (64 rows of 1024 float32 per rank), row-split in ``parts``."""
    return tp_shards(
        "big", full_tensor("big", (64 * world(), 1024), torch.float32), 0, parts, rank(), world(), dp=1, empty=empty
    )


@pytest.mark.parametrize("checksums", ["verified-64KiB-blocks", "not-verified"])
def test_each_rank_downloads_about_its_slice(s3: Optional[Any], url: str, checksums: str) -> None:
    """Saved as one shard per rank, loaded split twice as fine: rank r needs 2 of the 2*world
    row blocks, and downloads (counted at the server, by User-Agent) about that many bytes.

    A verified load also reads the rest of every checksum block it touches (1 MiB by default):
    here the blocks are 64 KiB, and the slices are whole blocks, so no extra byte is needed."""
    from dist_ckpt.backends.safetensors.strategy import (
        ReadOptions,
        SafetensorsLoadShardedStrategy,
        SafetensorsSaveOptions,
        SafetensorsSaveShardedStrategy,
    )

    dc.save(
        _slice_state(world(), empty=False),
        url,
        sharded_strategy=SafetensorsSaveShardedStrategy(SafetensorsSaveOptions(checksum_block_bytes=64 * KiB)),
    )
    request = _slice_state(2 * world(), empty=True)
    needed = sum(sh.local_shape[0] * sh.local_shape[1] * 4 for sh in request.values())
    if s3 is not None:
        s3.clear_requests()
    dist.barrier()
    storage = open_storage(url, S3StorageOptions(user_agent=f"dist-ckpt-test-rank{rank()}"))
    loader = SafetensorsLoadShardedStrategy(ReadOptions(verify_checksums=checksums != "not-verified"))
    loaded = dc.load(request, storage, sharded_strategy=loader)
    bad = _mismatches(loaded, request)
    dist.barrier()
    per_rank: Dict[str, int] = {}
    if s3 is not None:
        for r in s3.requests():
            if r.method == "GET" and r.path.endswith(".safetensors"):
                per_rank[r.user_agent] = per_rank.get(r.user_agent, 0) + r.bytes_sent
    per_rank = _broadcast(per_rank)
    downloaded = per_rank.get(f"dist-ckpt-test-rank{rank()}", 0)
    print(
        f"[{checksums}] rank {rank()}: downloaded {downloaded} bytes of safetensors objects for a {needed}-byte slice"
    )
    assert_on_all_ranks(not bad, f"tensors differ: {bad}")
    assert_on_all_ranks(
        needed <= downloaded <= 1.1 * needed,
        f"rank {rank()} downloaded {downloaded} bytes of safetensors objects for a slice of {needed} bytes "
        f"(all ranks: {per_rank})",
    )
    total = sum(v for k, v in per_rank.items() if k.startswith("dist-ckpt-test-rank"))
    whole = world() * 64 * 1024 * 4
    assert_on_all_ranks(total <= 1.1 * whole, f"the ranks together downloaded {total} bytes of a {whole}-byte tensor")


def test_transient_errors_are_survived(s3: Optional[Any], url: str) -> None:
    """503s on uploads and 500s on downloads, answered before moto sees them, are retried."""
    from tests.s3_server import FaultRule

    if s3 is not None:
        s3.inject_faults(
            [
                FaultRule(status=503, count=3, method="PUT"),
                FaultRule(status=500, count=3, method="GET", path_contains=".safetensors"),
            ]
        )
    dist.barrier()
    storage = open_storage(url, S3StorageOptions(**FAST))
    dc.save(_state(world()), storage)
    request = _state(1, empty=True)
    loaded = dc.load(request, storage)
    bad = _mismatches(loaded, request)
    dist.barrier()
    injected = _broadcast(None if s3 is None else sum(1 for r in s3.requests() if r.injected))
    assert_on_all_ranks(not bad, f"tensors differ after retried requests: {bad}")
    assert_on_all_ranks(injected == 6, f"{injected} injected errors were served, expected all 6")


def _save_and_die_before_commit(rank_: int, world_: int, url: str) -> None:
    """A rank of a save that rank 0 kills (SIGKILL, itself) where it would write the commit marker."""
    from dist_ckpt.engine import save as save_module

    def killed(*args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    save_module.save_config = killed  # type: ignore[assignment]
    dc.save(_killed_state(rank_, world_), url)


def _killed_state(rank_: int, world_: int) -> Dict[str, dc.ShardedTensor]:
    return tp_shards("w", full_tensor("w", (8 * world_, 16), torch.float32), 0, world_, rank_, world_, dp=1)


def test_a_save_killed_before_commit_is_not_a_checkpoint(s3: Optional[Any], url: str) -> None:
    committed = next_checkpoint_path(url, 100)
    dc.save(_state(world()), committed)
    crashed = next_checkpoint_path(url, 200)
    outcome = "ok"
    if rank() == 0:
        try:
            spawn_ranks(_save_and_die_before_commit, 2, crashed, timeout_s=scaled(120))
            outcome = "the save was not killed"
        except Exception as e:  # noqa: BLE001 -- expected: rank 0 died without reporting
            if "exited with code" not in str(e):
                outcome = f"unexpected failure: {e!r}"
    outcome = _broadcast(outcome)
    assert_on_all_ranks(outcome == "ok", outcome)
    written = [o.key for o in open_storage(crashed).list()]
    assert_on_all_ranks(
        any(k.startswith("safetensors/") for k in written) and "metadata.json" not in written,
        f"expected the data objects without a commit marker, found {written}",
    )
    error = raises_on_all_ranks(NotACheckpointError, lambda: dc.load(_state(world(), empty=True), crashed))
    assert_on_all_ranks(crashed in str(error), f"the error does not name {crashed}: {error}")
    latest = find_latest_checkpoint(url)
    assert_on_all_ranks(latest == committed, f"find_latest_checkpoint returned {latest}, expected {committed}")


def test_a_missing_bucket_is_named_on_every_rank(url: str) -> None:
    missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:6]}/ckpt"
    missing = str(_broadcast(missing))
    error = raises_on_all_ranks(BucketNotFoundError, lambda: dc.save(_state(world()), missing))
    assert_on_all_ranks("no-such-bucket" in str(error), f"the bucket is not named: {error}")
    raises_on_all_ranks(BucketNotFoundError, lambda: dc.load(_state(world(), empty=True), missing))


def test_wrong_credentials_are_a_clear_error_on_every_rank(s3: Optional[Any], url: str) -> None:
    dc.save(_state(world()), url)
    secret = "wrong-secret-" + uuid.uuid4().hex
    if s3 is not None:
        s3.set_authentication(True)
    dist.barrier()
    saved = os.environ["AWS_SECRET_ACCESS_KEY"]
    os.environ["AWS_SECRET_ACCESS_KEY"] = secret
    try:
        error = raises_on_all_ranks(StorageAuthError, lambda: dc.load(_state(world(), empty=True), url))
    finally:
        os.environ["AWS_SECRET_ACCESS_KEY"] = saved
        dist.barrier()
        if s3 is not None:
            s3.set_authentication(False)
        dist.barrier()
    chain: List[str] = []
    cause: Optional[BaseException] = error
    while cause is not None:
        chain.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    text = "\n".join(chain)
    assert_on_all_ranks(isinstance(error, CheckpointingException), f"not a CheckpointingException: {error!r}")
    assert_on_all_ranks(url.split("/")[2] in str(error), f"the error does not name the location: {error}")
    assert_on_all_ranks(secret not in text, "the secret key appears in the error chain")
