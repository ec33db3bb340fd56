"""Unit tests of dist_ckpt.tools.convert: any backend to any other and to/from HF, tensor by tensor."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any, Dict, List, Sequence

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.base import TensorLayout, TensorStreamWriter
from dist_ckpt.backends.safetensors.strategy import SafetensorsSaveShardedStrategy
from dist_ckpt.engine.report import ProgressEvent
from dist_ckpt.errors import CheckpointExistsError, IncompatibleStrategyError, NotACheckpointError
from dist_ckpt.model.sharded import ShardedObject
from dist_ckpt.testing.layouts import bitwise_equal
from dist_ckpt.tools.convert import convert
from tests.sample_checkpoints import COMMON, save_sample, stored_tensors

BACKENDS = [("safetensors", 1), ("zarr", 1)]


def _same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)


def _objects(path: Path) -> Dict[str, Any]:
    request = {f"o{i}": ShardedObject("rng_state", None, (2,), (i,)) for i in range(2)}
    return dc.load_sharded_objects(request, str(path))


@pytest.mark.parametrize("src_backend", BACKENDS, ids=lambda b: b[0])
@pytest.mark.parametrize("to", ["safetensors", "zarr"])
def test_convert_between_backends_is_bit_exact(tmp_path, src_backend, to):
    fulls = save_sample(tmp_path / "src", src_backend)
    result = convert(tmp_path / "src", tmp_path / "dst", to=to)
    assert result.tensors == len(fulls) and result.target_backend == f"{to}:1"
    assert result.sharded_objects == 2 and result.common_keys == len(COMMON)
    assert dc.check_is_distributed_checkpoint(str(tmp_path / "dst"))
    assert _same(stored_tensors(tmp_path / "dst"), fulls)
    assert dc.load_common_state_dict(str(tmp_path / "dst")) == COMMON
    assert _objects(tmp_path / "dst") == _objects(tmp_path / "src")
    assert dc.verify_checkpoint(tmp_path / "dst").ok


def test_convert_round_trip_through_hf(tmp_path):
    fulls = save_sample(tmp_path / "src", ("zarr", 1))
    to_hf = convert(tmp_path / "src", tmp_path / "hf", to="hf", max_shard_size=2000)
    assert to_hf.target_backend == "hf" and len(to_hf.dropped) == 2  # common state, ShardedObjects
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    back = convert(tmp_path / "hf", tmp_path / "back", to="safetensors")
    assert back.source_backend == "hf:1" and back.common_keys == 0
    assert _same(stored_tensors(tmp_path / "back"), fulls)
    again = convert(tmp_path / "back", tmp_path / "zarr", to="zarr")
    assert _same(stored_tensors(tmp_path / "zarr"), fulls) and again.tensors == len(fulls)


def test_a_sharded_source_becomes_one_shard_per_tensor(tmp_path):
    save_sample(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "dst", to="safetensors")
    info = dc.inspect_checkpoint(tmp_path / "dst")
    assert info.world_size == 1
    assert all(t.num_shards == (1 if t.nbytes else 0) for t in info.tensors)


def test_the_report_counts_every_byte_and_progress_reaches_the_total(tmp_path):
    fulls = save_sample(tmp_path / "src")
    events: List[ProgressEvent] = []
    result = convert(tmp_path / "src", tmp_path / "dst", to="zarr", progress=events.append)
    total = sum(t.numel() * t.element_size() for t in fulls.values())
    assert result.report.total_nbytes == total and result.report.complete
    copying = [e for e in events if e.bytes_total]
    assert copying and copying[-1].bytes_done == copying[-1].bytes_total == total
    assert {e.item for e in copying} == set(fulls)
    assert [e.phase for e in events if not e.bytes_total and e.done][-1] == "committing metadata.json"


class _LiveTensors(TensorStreamWriter):
    """A stream writer that records, at each add, which earlier tensors are still alive."""

    def __init__(self, inner: TensorStreamWriter) -> None:
        self.inner = inner
        self.refs: List["weakref.ref[torch.Tensor]"] = []
        self.alive_at_add: List[int] = []

    def add(self, key: str, tensor: torch.Tensor) -> None:
        self.alive_at_add.append(sum(r() is not None for r in self.refs))
        self.inner.add(key, tensor)
        self.refs.append(weakref.ref(tensor))

    def finish(self) -> None:
        self.inner.finish()


class _Recording(SafetensorsSaveShardedStrategy):
    writer: _LiveTensors

    def begin_stream(self, checkpoint_dir: Any, layout: Sequence[TensorLayout]) -> TensorStreamWriter:
        self.writer = _LiveTensors(super().begin_stream(checkpoint_dir, layout))
        return self.writer


@pytest.mark.parametrize("src_backend", BACKENDS, ids=lambda b: b[0])
def test_one_tensor_in_memory_at_a_time(tmp_path, src_backend):
    # bounded memory: when a tensor is handed to the writer, no earlier one is referenced anywhere
    save_sample(tmp_path / "src", src_backend)
    strategy = _Recording()
    convert(tmp_path / "src", tmp_path / "dst", to=strategy)
    assert len(strategy.writer.alive_at_add) == 6 and set(strategy.writer.alive_at_add) == {0}


def test_refuses_a_destination_that_is_not_empty(tmp_path):
    save_sample(tmp_path / "src")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError, match="not an empty directory"):
        convert(tmp_path / "src", tmp_path / "dst", to="zarr")
    assert [p.name for p in (tmp_path / "dst").iterdir()] == ["keep.txt"]
    with pytest.raises(CheckpointExistsError, match="inside"):
        convert(tmp_path / "src", tmp_path / "src" / "sub", to="zarr")


def test_a_missing_source_is_not_a_checkpoint(tmp_path):
    with pytest.raises(NotACheckpointError):
        convert(tmp_path / "absent", tmp_path / "dst", to="zarr")
    assert not (tmp_path / "dst").exists()


def test_unknown_or_non_streaming_targets_are_refused(tmp_path):
    save_sample(tmp_path / "src")
    with pytest.raises(dc.UnknownStrategyError):
        convert(tmp_path / "src", tmp_path / "dst", to="nosuch")
    from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreSaveShardedStrategy

    with pytest.raises(IncompatibleStrategyError, match="tensor by tensor"):
        convert(tmp_path / "src", tmp_path / "dst", to=TensorStoreSaveShardedStrategy())
    assert not (tmp_path / "dst").exists()


def test_a_failed_conversion_removes_what_it_wrote(tmp_path):
    save_sample(tmp_path / "src")

    class Failing(SafetensorsSaveShardedStrategy):
        def begin_stream(self, checkpoint_dir: Any, layout: Sequence[TensorLayout]) -> TensorStreamWriter:
            inner = super().begin_stream(checkpoint_dir, layout)

            class Writer(TensorStreamWriter):
                def add(self, key: str, tensor: torch.Tensor) -> None:
                    if key == "layers":
                        raise OSError("disk full")
                    inner.add(key, tensor)

                def finish(self) -> None:
                    inner.finish()

            return Writer()

    with pytest.raises(OSError, match="disk full"):
        convert(tmp_path / "src", tmp_path / "dst", to=Failing())
    assert not (tmp_path / "dst").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="disk full"):
        convert(tmp_path / "src", tmp_path / "empty", to=Failing())
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())


def test_a_damaged_source_fails_with_the_file_named(tmp_path):
    save_sample(tmp_path / "src")
    data = next((tmp_path / "src" / "safetensors").glob("rank*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-3] ^= 0xFF  # a flipped bit in the last tensor's bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(dc.CorruptCheckpointError, match=data.name):
        convert(tmp_path / "src", tmp_path / "dst", to="zarr")
    assert not (tmp_path / "dst").exists()


def test_a_zarr_source_missing_a_tensor_is_refused_not_converted_without_it(tmp_path):
    import shutil

    save_sample(tmp_path / "src", ("zarr", 1))
    shutil.rmtree(tmp_path / "src" / "zarr" / "layers")
    for to in ("safetensors", "hf"):
        with pytest.raises(dc.CorruptCheckpointError, match="'layers'.*checksums.json"):
            convert(tmp_path / "src", tmp_path / to, to=to)
        assert not (tmp_path / to).exists()
    with pytest.raises(dc.CorruptCheckpointError, match="'layers'"):
        dc.unshard(str(tmp_path / "src"))


@pytest.mark.parametrize("src_backend", BACKENDS, ids=lambda b: b[0])
def test_a_source_missing_a_sharded_object_file_is_refused(tmp_path, src_backend):
    save_sample(tmp_path / "src", src_backend)
    missing = next((tmp_path / "src" / "objects" / "rng_state").glob("shard_1_*"))
    missing.unlink()
    with pytest.raises(dc.CorruptCheckpointError, match=r"'rng_state'.*\(1,\)"):
        convert(tmp_path / "src", tmp_path / "dst", to="safetensors")
    assert not (tmp_path / "dst").exists()


def test_convert_to_and_from_an_object_store(tmp_path, s3_url):
    fulls = save_sample(tmp_path / "src", ("zarr", 1))
    up = convert(tmp_path / "src", s3_url, to="safetensors")
    assert up.destination == s3_url and dc.verify_checkpoint(s3_url).ok
    assert dc.load_common_state_dict(s3_url) == COMMON
    down = convert(s3_url, tmp_path / "back", to="zarr")
    assert down.sharded_objects == 2
    assert _same(stored_tensors(tmp_path / "back"), fulls)
    with pytest.raises(CheckpointExistsError, match="already holds objects"):
        convert(tmp_path / "src", s3_url, to="safetensors")
    with pytest.raises(IncompatibleStrategyError, match="object"):
        convert(tmp_path / "src", s3_url + "-zarr", to="zarr")


def test_convert_to_an_object_store_groups_tensors_into_objects_of_the_target_size(tmp_path, s3_url, monkeypatch):
    import dist_ckpt.backends.safetensors.stream as stream
    from dist_ckpt.storage import open_storage

    fulls = save_sample(tmp_path / "src")
    sizes = [t.numel() * t.element_size() for _, t in sorted(fulls.items()) if t.numel()]
    monkeypatch.setattr(stream, "STREAM_OBJECT_BYTES", max(sizes) + 1)  # a few tensors per object
    convert(tmp_path / "src", s3_url, to="safetensors")
    objects = [o for o in open_storage(s3_url).list("safetensors") if o.key.endswith(".safetensors")]
    assert 1 < len(objects) < len(sizes)  # neither one object per tensor nor one for all
    assert all(o.size <= max(sizes) + 1 + 4096 for o in objects)  # data within the target, plus a header
    assert _same(stored_tensors(s3_url), fulls) and dc.verify_checkpoint(s3_url).ok


def test_a_conversion_failing_mid_object_aborts_its_upload(tmp_path, s3_url, monkeypatch):
    import dist_ckpt.backends.safetensors.stream as stream
    from dist_ckpt.storage import open_storage

    save_sample(tmp_path / "src")
    monkeypatch.setattr(stream, "STREAM_OBJECT_BYTES", 1 << 30)  # every tensor in one object
    aborted = []
    real_abort = stream.SafetensorsStreamWriter.abort

    def abort(self):
        aborted.append(self._upload is not None)
        real_abort(self)

    def failing_add(self, key, tensor, real=stream.SafetensorsStreamWriter.add):
        if key == "layers":
            raise OSError("source read failed")
        real(self, key, tensor)

    monkeypatch.setattr(stream.SafetensorsStreamWriter, "abort", abort)
    monkeypatch.setattr(stream.SafetensorsStreamWriter, "add", failing_add)
    with pytest.raises(OSError, match="source read failed"):
        convert(tmp_path / "src", s3_url, to="safetensors")
    assert aborted == [True]  # an upload was open, and was aborted
    assert open_storage(s3_url).list() == []
