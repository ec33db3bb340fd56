"""The zarr-format layout on S3 through the array libraries' own S3 support (groundwork for phase B).

The Zarr backend (zarr-python 3) and the TensorStore backend write the same zarr v3 layout.
On S3 each uses its own client: zarr-python through ``zarr.storage.ObjectStore`` over the obstore
store that :meth:`S3Storage.obstore_store` builds, TensorStore through its ``s3`` kvstore driver
with the spec from :meth:`S3Storage.tensorstore_kvstore`. These tests pin down, against the moto
server, that both work with our configuration, read each other's arrays, survive injected 5xx
and fetch only the chunks a partial read needs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dist_ckpt.storage import open_storage
from dist_ckpt.storage.s3 import S3Storage, S3StorageOptions
from tests.s3_server import FaultRule

zarr = pytest.importorskip("zarr")
ts = pytest.importorskip("tensorstore")

MiB = 2**20


@pytest.fixture
def storage(s3_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> S3Storage:
    # TensorStore's AWS library logs an error for every missing ~/.aws file: give it empty ones
    for name, file in (("AWS_CONFIG_FILE", "config"), ("AWS_SHARED_CREDENTIALS_FILE", "credentials")):
        (tmp_path / file).write_text("")
        monkeypatch.setenv(name, str(tmp_path / file))
    opened = open_storage(
        s3_url, S3StorageOptions(part_size=5 * MiB, max_retries=3, initial_backoff_s=0.01, max_backoff_s=0.05)
    )
    assert isinstance(opened, S3Storage)
    return opened


def _zarr_store(storage: S3Storage, read_only: bool = False) -> Any:
    return zarr.storage.ObjectStore(storage.obstore_store(), read_only=read_only)


def _ts_open(storage: S3Storage, key: str, **kwargs: Any) -> Any:
    return ts.open({"driver": "zarr3", "kvstore": storage.tensorstore_kvstore(key)}, **kwargs).result()


def test_zarr_python_and_tensorstore_read_each_others_arrays(storage: S3Storage) -> None:
    a = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    z = zarr.create_array(
        store=_zarr_store(storage),
        name="zarr/by_zarr",
        shape=a.shape,
        chunks=(32, 48),
        dtype="float32",
        attributes={"dist_ckpt": {"key": "by_zarr"}},
    )
    z[:32] = a[:32]  # one chunk per saved shard, written separately (two ranks)
    z[32:] = a[32:]
    t = _ts_open(
        storage,
        "zarr/by_ts",
        create=True,
        dtype="float32",
        shape=list(a.shape),
        chunk_layout=ts.ChunkLayout(chunk_shape=[32, 48]),
    )
    t[32:].write(a[32:]).result()
    t[:32].write(a[:32]).result()
    assert np.array_equal(_ts_open(storage, "zarr/by_zarr", open=True, read=True).read().result(), a)
    assert np.array_equal(zarr.open_array(store=_zarr_store(storage, True), path="zarr/by_ts", mode="r")[:], a)
    keys = {o.key for o in storage.list("zarr")}
    assert {
        "zarr/by_zarr/zarr.json",
        "zarr/by_zarr/c/0/0",
        "zarr/by_zarr/c/1/0",
        "zarr/by_ts/zarr.json",
        "zarr/by_ts/c/0/0",
        "zarr/by_ts/c/1/0",
    } <= keys


@pytest.mark.parametrize("engine", ["zarr", "tensorstore"])
def test_partial_read_fetches_only_the_needed_chunk(storage: S3Storage, s3_env: Any, engine: str) -> None:
    a = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
    z = zarr.create_array(
        store=_zarr_store(storage), name="w", shape=a.shape, chunks=(16, 48), dtype="float32", compressors=None
    )
    z[:] = a
    s3_env.clear_requests()
    if engine == "zarr":
        part = zarr.open_array(store=_zarr_store(storage, True), path="w", mode="r")[40:44, 5:9]
    else:
        part = _ts_open(storage, "w", open=True, read=True)[40:44, 5:9].read().result()
    assert np.array_equal(part, a[40:44, 5:9])
    chunk_gets = [r for r in s3_env.requests() if r.method == "GET" and "/w/c/" in r.path]
    assert [r.path.rsplit("/w/", 1)[1] for r in chunk_gets] == ["c/2/0"]
    assert chunk_gets[0].bytes_sent == 16 * 48 * 4  # one uncompressed chunk, nothing else


@pytest.mark.parametrize("engine", ["zarr", "tensorstore"])
def test_array_io_survives_injected_5xx(storage: S3Storage, s3_env: Any, engine: str) -> None:
    a = np.arange(32 * 8, dtype=np.int32).reshape(32, 8)
    s3_env.inject_faults(
        [
            FaultRule(status=503, count=2, method="PUT", path_contains="/c/"),
            FaultRule(status=500, count=2, method="GET", path_contains="/c/"),
        ]
    )
    if engine == "zarr":
        z = zarr.create_array(store=_zarr_store(storage), name="r", shape=a.shape, chunks=(16, 8), dtype="int32")
        z[:] = a
        back = zarr.open_array(store=_zarr_store(storage, True), path="r", mode="r")[:]
    else:
        t = _ts_open(
            storage,
            "r",
            create=True,
            dtype="int32",
            shape=list(a.shape),
            chunk_layout=ts.ChunkLayout(chunk_shape=[16, 8]),
        )
        t.write(a).result()
        back = _ts_open(storage, "r", open=True, read=True).read().result()
    assert np.array_equal(back, a)
    statuses = [(r.method, r.status) for r in s3_env.requests() if "/r/c/" in r.path]
    assert statuses.count(("PUT", 503)) == 2 and statuses.count(("GET", 500)) == 2


def test_tensorstore_retry_bound_matches_the_storage_options(storage: S3Storage, s3_env: Any) -> None:
    a = np.ones((8, 8), dtype=np.float32)
    t = _ts_open(storage, "b", create=True, dtype="float32", shape=[8, 8])
    t.write(a).result()
    s3_env.clear_requests()
    s3_env.inject_faults([FaultRule(status=500, count=1000, method="GET", path_contains="/b/c/")])
    reopened = _ts_open(storage, "b", open=True, read=True)
    with pytest.raises(ValueError, match="500"):
        reopened.read().result()
    attempts = [r for r in s3_env.requests() if r.method == "GET" and "/b/c/" in r.path]
    assert len(attempts) == storage.options.max_retries + 1
