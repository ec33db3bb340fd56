"""Every sharded backend through dist_ckpt.save / load on an s3:// location (moto server, one process).

(The last test also loads the safetensors backend from S3 into other dtypes.)

safetensors goes through dist_ckpt's own storage layer; the zarr backend's two engines through
their own S3 clients (zarr-python: ObjectStore over obstore; TensorStore: its s3 driver). Both
engines write one layout, so each reads what the other wrote.
"""

from __future__ import annotations

import os
from typing import Any, Dict

import pytest
import torch

import dist_ckpt
from dist_ckpt.backends.safetensors.strategy import SafetensorsLoadShardedStrategy, SafetensorsSaveShardedStrategy
from dist_ckpt.errors import (
    CheckpointingException,
    CorruptCheckpointError,
    IncompatibleStrategyError,
    LoadMismatchError,
)
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.storage import open_storage
from dist_ckpt.tools.verify import verify_checkpoint

pytest.importorskip("zarr")
ts = pytest.importorskip("tensorstore")
from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreLoadShardedStrategy, TensorStoreSaveShardedStrategy  # noqa: E402
from dist_ckpt.backends.zarr.zarr_python import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_tensorstore_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    # TensorStore's AWS library logs an error for each missing ~/.aws file: give it empty ones
    for name, file in (("AWS_CONFIG_FILE", "config"), ("AWS_SHARED_CREDENTIALS_FILE", "credentials")):
        (tmp_path / file).write_text("")
        monkeypatch.setenv(name, str(tmp_path / file))


def _state() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(6, 10, generator=g),
        "b": torch.randint(-100, 100, (10,), generator=g, dtype=torch.int64),
        "h": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "zero": torch.zeros(3, 2),  # an all-zero chunk must be a real object, not "missing"
    }


def _sharded(tensors: Dict[str, torch.Tensor], like: bool = False) -> Dict[str, Any]:
    sd: Dict[str, Any] = {
        k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t) if like else t.clone()) for k, t in tensors.items()
    }
    sd["flat"] = ShardedTensor.from_rank_offsets_flat(
        "flat", torch.zeros(8) if like else torch.arange(8, dtype=torch.float32), (2, 4), flattened_range=slice(0, 8)
    )
    sd["step"] = 3
    return sd


SAVERS = {"zarr": ZarrSaveShardedStrategy, "tensorstore": TensorStoreSaveShardedStrategy}
LOADERS = {"zarr": ZarrLoadShardedStrategy, "tensorstore": TensorStoreLoadShardedStrategy}


@pytest.mark.parametrize("saver,loader", [(s, ld) for s in SAVERS for ld in LOADERS])
def test_zarr_engines_round_trip_on_s3(s3_url: str, s3_env: Any, saver: str, loader: str) -> None:
    state = _state()
    dist_ckpt.save(_sharded(state), s3_url, sharded_strategy=SAVERS[saver]())
    keys = {o.key for o in open_storage(s3_url).list()}
    assert {
        "metadata.json",
        "zarr/zarr.json",
        "zarr/checksums.json",
        "zarr/w/zarr.json",
        "zarr/w/c.0.0",
        "zarr/zero/c.0.0",
    } <= keys
    out = dist_ckpt.load(_sharded(state, like=True), s3_url, sharded_strategy=LOADERS[loader]())
    for k, t in state.items():
        assert torch.equal(out[k], t), k
    assert torch.equal(out["flat"].reshape(2, 4), torch.arange(8, dtype=torch.float32).reshape(2, 4))
    assert out["step"] == 3
    meta = LOADERS[loader]().load_tensors_metadata(open_storage(s3_url))
    assert set(meta) == set(state) | {"flat"} and meta["w"].global_shape == (6, 10)
    assert verify_checkpoint(s3_url).ok
    secret = os.environ["AWS_SECRET_ACCESS_KEY"].encode()
    storage = open_storage(s3_url)
    assert not [key for key in keys if secret in storage.read(key)]  # credentials never land in a checkpoint


@pytest.mark.parametrize("loader", list(LOADERS))
def test_a_missing_chunk_object_is_reported_not_read_as_zeros(s3_url: str, s3_env: Any, loader: str) -> None:
    state = _state()
    dist_ckpt.save(_sharded(state), s3_url, sharded_strategy=ZarrSaveShardedStrategy())
    open_storage(s3_url).delete("zarr/zero/c.0.0")
    with pytest.raises(CorruptCheckpointError, match="zero"):
        dist_ckpt.load(_sharded(state, like=True), s3_url, sharded_strategy=LOADERS[loader]())
    assert not verify_checkpoint(s3_url).ok


def test_a_changed_chunk_object_fails_its_checksum(s3_url: str, s3_env: Any) -> None:
    state = _state()
    dist_ckpt.save(_sharded(state), s3_url, sharded_strategy=ZarrSaveShardedStrategy())
    storage = open_storage(s3_url)
    data = bytearray(storage.read("zarr/w/c.0.0"))
    data[5] ^= 0xFF
    storage.write("zarr/w/c.0.0", bytes(data))
    for loader in LOADERS.values():
        with pytest.raises(CheckpointingException, match="zarr/w/c.0.0") as info:
            dist_ckpt.load(_sharded(state, like=True), s3_url, sharded_strategy=loader())
        assert "tensor 'w'" in str(info.value)


def test_removing_tensors_on_s3(s3_url: str, s3_env: Any) -> None:
    state = _state()
    dist_ckpt.save(_sharded(state), s3_url, sharded_strategy=ZarrSaveShardedStrategy())
    ZarrLoadShardedStrategy().remove_sharded_tensors(open_storage(s3_url), "h")
    assert not any(o.key.startswith("zarr/h/") for o in open_storage(s3_url).list())
    assert "h" not in ZarrLoadShardedStrategy().load_tensors_metadata(open_storage(s3_url))
    assert verify_checkpoint(s3_url).ok  # the manifest no longer lists the removed files


def test_a_non_s3_object_store_is_refused_by_name(tmp_path: Any) -> None:
    from dist_ckpt.backends.zarr.layout import checkpoint_node
    from dist_ckpt.storage import LocalStorage

    class OtherObjectStore(LocalStorage):  # a Storage with neither local paths nor S3 access
        local_paths = False

    with pytest.raises(IncompatibleStrategyError, match="own S3 client"):
        checkpoint_node(OtherObjectStore(tmp_path), "the zarr backend")  # a Storage, but not S3


def test_zarr_python_digests_what_it_uploads_without_downloading_it(s3_url: str, s3_env: Any) -> None:
    state = _state()
    s3_env.clear_requests()
    dist_ckpt.save(_sharded(state), s3_url, sharded_strategy=ZarrSaveShardedStrategy())
    chunk_gets = [r for r in s3_env.requests() if r.method == "GET" and "/zarr/" in r.path and "/c/" in r.path]
    assert chunk_gets == []
    assert verify_checkpoint(s3_url).ok  # and the digests are those of the stored bytes


@pytest.mark.parametrize("saver", list(SAVERS))
def test_unshard_reads_every_tensor_whole_from_s3(s3_url: str, s3_env: Any, saver: str) -> None:
    from dist_ckpt.tools.unshard import iter_unsharded

    state = _state()
    dist_ckpt.save(_sharded(state), s3_url, sharded_strategy=SAVERS[saver]())
    whole = dict(iter_unsharded(s3_url))
    assert set(whole) == set(state) | {"flat"}
    for k, t in state.items():
        assert torch.equal(whole[k], t), k
    assert torch.equal(whole["flat"], torch.arange(8, dtype=torch.float32).reshape(2, 4))


@pytest.mark.parametrize("saver", list(SAVERS))
def test_inspect_describes_zarr_checkpoints_on_s3(s3_url: str, s3_env: Any, saver: str) -> None:
    from dist_ckpt.tools.inspection import inspect_checkpoint

    state = _state()
    dist_ckpt.save(_sharded(state), s3_url, sharded_strategy=SAVERS[saver]())
    info = inspect_checkpoint(s3_url)
    tensors = {t.key: t for t in info.tensors}
    assert info.sharded_backend == "zarr:1" and set(tensors) == set(state) | {"flat"}
    assert tensors["w"].global_shape == (6, 10) and [s.file for s in tensors["w"].shards] == ["zarr/w/c.0.0"]
    assert [s.flat_range for s in tensors["flat"].shards] == [(0, 8)]


CAST_SAVERS = {"safetensors": SafetensorsSaveShardedStrategy, **SAVERS}
CAST_LOADERS = {
    "safetensors": SafetensorsLoadShardedStrategy,
    "zarr": ZarrLoadShardedStrategy,
    "tensorstore": TensorStoreLoadShardedStrategy,
}


@pytest.mark.parametrize("loader", list(CAST_LOADERS))
def test_loads_from_s3_cast_by_default_and_describe_flattened_tensors_as_saved(
    s3_url: str, s3_env: Any, loader: str
) -> None:
    """Casting and the stored description go through the one I/O path: on S3 as on a disk."""
    state = _state()
    saver = "safetensors" if loader == "safetensors" else "zarr"
    dist_ckpt.save(_sharded(state), s3_url, sharded_strategy=CAST_SAVERS[saver]())
    request = _sharded({k: t.to(torch.float16) for k, t in state.items()}, like=True)
    request["flat"] = ShardedTensor.from_rank_offsets_flat(
        "flat", torch.zeros(4, dtype=torch.bfloat16), (2, 4), flattened_range=slice(2, 6)
    )
    # one process holds only part of "flat": the sharding check would refuse the request
    out = dist_ckpt.load(request, s3_url, sharded_strategy=CAST_LOADERS[loader](), validate_access_integrity=False)
    for k, t in state.items():
        assert out[k].dtype == torch.float16 and torch.equal(out[k], t.to(torch.float16)), k
    assert torch.equal(out["flat"], torch.arange(2, 6, dtype=torch.bfloat16))
    with pytest.raises(LoadMismatchError, match="allow_dtype_cast=False") as info:
        dist_ckpt.load(
            _sharded({"w": state["w"].to(torch.bfloat16)}, like=True),
            s3_url,
            sharded_strategy=CAST_LOADERS[loader](),
            allow_dtype_cast=False,
        )
    assert "'w'" in str(info.value) and s3_url.rstrip("/").split("/")[-1] in str(info.value)
    meta = dist_ckpt.load_tensors_metadata(s3_url, CAST_LOADERS[loader]())
    assert meta["flat"].flattened_range == slice(0, 8) and meta["flat"].local_shape == (2, 4)
    assert meta["w"].flattened_range is None
    plain = dist_ckpt.load_plain_tensors(s3_url)
    assert torch.equal(plain["flat"], torch.arange(8, dtype=torch.float32)) and torch.equal(plain["w"], state["w"])
