"""Loads into another dtype than the stored one, for every loader engine (in one process).

The engines: the safetensors backend, zarr read with zarr-python and with TensorStore, and
HuggingFace folders. Each test saves tensors in some dtypes and loads them -- whole, resharded
over "virtual ranks", as flattened ranges, padded with ``allow_shape_mismatch`` -- into others;
the result must equal ``stored.to(requested)`` elementwise, as Megatron-Core and DCP give.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.base import LoadShardedStrategy
from dist_ckpt.backends.safetensors import io as safetensors_io
from dist_ckpt.backends.safetensors import read_threads
from dist_ckpt.backends.safetensors.strategy import (
    SafetensorsLoadOptions,
    SafetensorsLoadShardedStrategy,
    SafetensorsSaveShardedStrategy,
)
from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreLoadShardedStrategy
from dist_ckpt.backends.zarr.zarr_python import ZarrLoadShardedStrategy, ZarrSaveShardedStrategy
from dist_ckpt.errors import ChecksumMismatchError, IncompatibleStrategyError, LoadMismatchError
from dist_ckpt.hf import HFLoadShardedStrategy, save_checkpoint
from dist_ckpt.model.dtype_cast import cast_refusal
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.parallel.fully_parallel import FullyParallelLoadStrategyWrapper
from dist_ckpt.parallel.two_stage import TwoStageDataParallelLoadShardedStrategy
from dist_ckpt.testing.layouts import expected_data, flat_shards, full_tensor, tp_shards

SHAPE = (8, 6)
STORED = {"f32": torch.float32, "i64": torch.int64, "bf16": torch.bfloat16}
REQUESTED = [torch.bfloat16, torch.float32, torch.float16]


def _save_dist(saver: Callable[[], Any]) -> Callable[[Dict[str, torch.Tensor], Path], None]:
    def save(tensors: Dict[str, torch.Tensor], path: Path) -> None:
        sd: Dict[str, ShardedTensor] = {}
        for key, full in tensors.items():  # two "ranks", rows split
            sd.update(tp_shards(key, full, 0, 2, 0, 1, dp=1))
        saver().save(sd, path)

    return save


def _save_hf(tensors: Dict[str, torch.Tensor], path: Path) -> None:
    save_checkpoint(path, dict(tensors))


#: name -> (save whole tensors into a directory, a loader with allow_dtype_cast)
ENGINES: Dict[str, Tuple[Callable[[Dict[str, torch.Tensor], Path], None], Callable[[bool], LoadShardedStrategy]]] = {
    "safetensors": (
        _save_dist(SafetensorsSaveShardedStrategy),
        lambda allow: SafetensorsLoadShardedStrategy(SafetensorsLoadOptions(allow_dtype_cast=allow)),
    ),
    "zarr": (_save_dist(ZarrSaveShardedStrategy), lambda allow: ZarrLoadShardedStrategy(allow_dtype_cast=allow)),
    "tensorstore": (
        _save_dist(ZarrSaveShardedStrategy),
        lambda allow: TensorStoreLoadShardedStrategy(allow_dtype_cast=allow),
    ),
    "hf": (_save_hf, lambda allow: HFLoadShardedStrategy(SafetensorsLoadOptions(allow_dtype_cast=allow))),
}


@pytest.fixture(params=sorted(ENGINES))
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def stored_tensors() -> Dict[str, torch.Tensor]:
    return {key: full_tensor(key, SHAPE, dtype) for key, dtype in STORED.items()}


def requests(dtype: torch.dtype) -> Dict[str, ShardedTensor]:
    """Every stored key three ways, in ``dtype``: four row shards, flattened ranges of column
    shards (distributed-optimizer style) and a padded, flattened allow_shape_mismatch request."""
    sd: Dict[str, ShardedTensor] = {}
    for key in STORED:
        like = torch.zeros(SHAPE, dtype=dtype)
        sd.update({f"tp/{k}": v for k, v in tp_shards(key, like, 0, 4, 0, 1, dp=1, empty=True).items()})
        sd.update({f"flat/{k}": v for k, v in flat_shards(key, like, 1, 2, 3, 0, 1, empty=True).items()})
        sd[f"pad/{key}"] = ShardedTensor.from_rank_offsets_flat(
            key, torch.full((30,), 7, dtype=dtype), (10, 6), flattened_range=slice(30, 60), allow_shape_mismatch=True
        )
    return sd


def expected(sh: ShardedTensor, dtype: torch.dtype) -> torch.Tensor:
    full = full_tensor(sh.key, SHAPE, STORED[sh.key]).to(dtype)
    if sh.allow_shape_mismatch:
        padded = torch.zeros(sh.global_shape, dtype=dtype)
        padded[: SHAPE[0]] = full
        full = padded
    return expected_data(sh, full)


@pytest.mark.parametrize("dtype", REQUESTED, ids=str)
def test_casts_resharded_flattened_and_padded(tmp_path: Path, engine: str, dtype: torch.dtype) -> None:
    save, loader = ENGINES[engine]
    save(stored_tensors(), tmp_path)
    sd = requests(dtype)
    out = loader(True).load(dict(sd), tmp_path)
    wrong = [k for k, sh in sd.items() if not torch.equal(out[k], expected(sh, dtype)) or out[k].dtype != dtype]
    assert not wrong
    in_place = [k for k, sh in sd.items() if out[k] is not sh.data]
    assert not in_place, "the requested tensors are filled in place"


def test_strict_option_refuses_naming_key_rank_path_and_dtypes(tmp_path: Path, engine: str) -> None:
    save, loader = ENGINES[engine]
    save(stored_tensors(), tmp_path)
    sd = {"x": ShardedTensor.from_rank_offsets("f32", torch.empty(SHAPE, dtype=torch.bfloat16))}
    with pytest.raises(LoadMismatchError) as info:
        loader(False).load(sd, tmp_path)
    msg = str(info.value)
    assert "'f32'" in msg and "[rank 0]" in msg and str(tmp_path) in msg
    assert "torch.float32" in msg and "torch.bfloat16" in msg and "allow_dtype_cast=False" in msg
    same = {"x": ShardedTensor.from_rank_offsets("f32", torch.empty(SHAPE))}
    assert torch.equal(loader(False).load(same, tmp_path)["x"], full_tensor("f32", SHAPE))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_casts_into_gpu_destinations(tmp_path: Path, engine: str) -> None:
    """fp32 / int64 on disk into bf16 tensors on the GPU (Megatron-Core's everyday case)."""
    save, loader = ENGINES[engine]
    save(stored_tensors(), tmp_path)
    sd = {
        k: dataclasses.replace(sh, data=sh.data.cuda())
        for k, sh in requests(torch.bfloat16).items()
        if sh.flattened_range is None or not sh.allow_shape_mismatch
    }
    out = loader(True).load(dict(sd), tmp_path)
    wrong = [k for k, sh in sd.items() if not torch.equal(out[k].cpu(), expected(sh, torch.bfloat16))]
    assert not wrong


def test_complex_to_real_is_refused_real_to_complex_and_bool_cast(tmp_path: Path, engine: str) -> None:
    save, loader = ENGINES[engine]
    values = torch.tensor([[0.0, -1.5, 2.0], [0.25, 0.0, 3.0]])
    save({"c": values.to(torch.complex64), "r": values, "b": values != 0}, tmp_path)
    with pytest.raises(LoadMismatchError, match="'c'.*imaginary part"):
        loader(True).load({"x": ShardedTensor.from_rank_offsets("c", torch.empty(2, 3))}, tmp_path)
    out = loader(True).load(
        {
            "complex": ShardedTensor.from_rank_offsets("r", torch.empty(2, 3, dtype=torch.complex128)),
            "to_bool": ShardedTensor.from_rank_offsets("r", torch.empty(2, 3, dtype=torch.bool)),
            "from_bool": ShardedTensor.from_rank_offsets("b", torch.empty(2, 3, dtype=torch.bfloat16)),
        },
        tmp_path,
    )
    assert torch.equal(out["complex"], values.to(torch.complex128))
    assert torch.equal(out["to_bool"], values != 0)
    assert torch.equal(out["from_bool"], (values != 0).to(torch.bfloat16))


def test_casts_are_logged_once_per_load(tmp_path: Path, engine: str, caplog: pytest.LogCaptureFixture) -> None:
    save, loader = ENGINES[engine]
    save(stored_tensors(), tmp_path)
    with caplog.at_level(logging.INFO, logger="dist_ckpt"):
        loader(True).load(requests(torch.bfloat16), tmp_path)
    lines = [r.getMessage() for r in caplog.records if "requested dtype" in r.getMessage()]
    assert len(lines) == 1
    assert "'f32' (float32 -> bfloat16)" in lines[0] and "'i64' (int64 -> bfloat16)" in lines[0]
    assert "'bf16'" not in lines[0] and "casting 2 tensors" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dist_ckpt"):
        loader(True).load({"x": ShardedTensor.from_rank_offsets("f32", torch.empty(SHAPE))}, tmp_path)
    assert not [r for r in caplog.records if "requested dtype" in r.getMessage()]


# --------------------------------------------------------------------------- memory and checksums


def test_safetensors_cast_uses_bounded_scratch_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cast reads through the per-thread bounce buffer, one slab at a time: never a buffer
    the size of the tensor."""
    full = torch.randn(256, 1024)  # 1 MiB
    SafetensorsSaveShardedStrategy().save({"w": ShardedTensor.from_rank_offsets("w", full)}, tmp_path)
    sizes: List[int] = []
    real = read_threads._Worker.buffer

    def spy(self: Any, nbytes: int, pinned: bool) -> torch.Tensor:
        sizes.append(nbytes)
        return real(self, nbytes, pinned)

    monkeypatch.setattr(read_threads._Worker, "buffer", spy)
    options = SafetensorsLoadOptions(bounce_buffer_bytes=64 << 10, verify_checksums=False, thread_count=2)
    dest = torch.empty(256, 1024, dtype=torch.bfloat16)
    out = SafetensorsLoadShardedStrategy(options).load({"w": ShardedTensor.from_rank_offsets("w", dest)}, tmp_path)
    assert out["w"] is dest and torch.equal(dest, full.to(torch.bfloat16))
    assert len(sizes) >= 16 and max(sizes) <= 64 << 10


@pytest.mark.parametrize(
    "width,columns", [(4096, 1024), (4096, 8), (16, 8)], ids=["long-runs", "long-gaps", "short-runs-and-gaps"]
)
def test_safetensors_cast_reads_what_a_load_in_the_stored_dtype_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, width: int, columns: int
) -> None:
    """A column slice cast to bf16 reads the same bytes as the same slice in fp32: runs that are
    long or far apart one by one (not the gaps between them), short runs close together as one
    span."""
    full = torch.randn(64, width)
    SafetensorsSaveShardedStrategy().save({"w": ShardedTensor.from_rank_offsets("w", full)}, tmp_path)
    read = {"bytes": 0}
    real = safetensors_io.read_into

    def counting(fd: Any, buffers: Any, offset: int) -> int:
        n = real(fd, buffers, offset)
        read["bytes"] += n
        return n

    monkeypatch.setattr(safetensors_io, "read_into", counting)
    strategy = SafetensorsLoadShardedStrategy(SafetensorsLoadOptions(verify_checksums=False))
    parts = width // columns
    counts = {}
    for dtype in (torch.float32, torch.bfloat16):
        read["bytes"] = 0
        sh = ShardedTensor.from_rank_offsets("w", torch.empty(64, columns, dtype=dtype), (1, 1, parts))
        out = strategy.load({"x": sh}, tmp_path)["x"]
        assert torch.equal(out, full[:, columns : 2 * columns].to(dtype))
        counts[dtype] = read["bytes"]
    assert counts[torch.bfloat16] == counts[torch.float32]


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("engine_name", ["safetensors", "zarr", "tensorstore"])
def test_checksums_verify_the_stored_bytes_of_a_cast(tmp_path: Path, engine_name: str) -> None:
    save, loader = ENGINES[engine_name]
    save({"w": full_tensor("w", SHAPE)}, tmp_path)
    files = sorted(tmp_path.rglob("*.safetensors")) or sorted((tmp_path / "zarr" / "w").glob("c.*"))
    _flip_last_byte([f for f in files if f.is_file()][-1])
    sd = {"x": ShardedTensor.from_rank_offsets("w", torch.empty(SHAPE, dtype=torch.bfloat16))}
    with pytest.raises(ChecksumMismatchError, match="'w'"):
        loader(True).load(sd, tmp_path)


# --------------------------------------------------------------------------- dist_ckpt.load and strategies


def test_rule() -> None:
    assert cast_refusal(torch.float32, torch.float32, allow=False) is None
    assert cast_refusal(torch.int64, torch.bfloat16, allow=True) is None
    assert "allow_dtype_cast=False" in str(cast_refusal(torch.float32, torch.float16, allow=False))
    assert "imaginary" in str(cast_refusal(torch.complex128, torch.float64, allow=True))
    assert cast_refusal(torch.float64, torch.complex64, allow=True) is None


class _Opaque(LoadShardedStrategy):
    """A third-party loader that knows nothing of dtype casts."""

    supported_backends = ("safetensors",)
    supported_versions = (1,)

    def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
        return SafetensorsLoadShardedStrategy().load(sharded_state_dict, checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir: Any) -> Any:
        return SafetensorsLoadShardedStrategy().load_tensors_metadata(checkpoint_dir)


def test_dist_ckpt_load_casts_by_default_and_allow_dtype_cast_false_refuses(tmp_path: Path) -> None:
    full = full_tensor("w", SHAPE)
    dc.save({"w": ShardedTensor.from_rank_offsets("w", full)}, tmp_path / "c")

    def request() -> Dict[str, ShardedTensor]:
        return {"w": ShardedTensor.from_rank_offsets("w", torch.empty(SHAPE, dtype=torch.bfloat16))}

    assert torch.equal(dc.load(request(), tmp_path / "c")["w"], full.to(torch.bfloat16))
    with pytest.raises(LoadMismatchError, match=r"\[rank 0\].*'w' is stored as torch.float32, requested as torch.bf"):
        dc.load(request(), tmp_path / "c", allow_dtype_cast=False)
    strict = SafetensorsLoadShardedStrategy(SafetensorsLoadOptions(allow_dtype_cast=False))
    with pytest.raises(LoadMismatchError, match="allow_dtype_cast=False"):
        dc.load(request(), tmp_path / "c", sharded_strategy=strict)
    result = dc.load_with_report(request(), tmp_path / "c", sharded_strategy=strict, allow_dtype_cast=True)
    assert torch.equal(result.state_dict["w"], full.to(torch.bfloat16))
    assert strict.options.allow_dtype_cast is False  # the caller's strategy is left as it was
    # a strategy that cannot be configured works as it is, and says so when asked to configure
    assert torch.equal(dc.load(request(), tmp_path / "c", sharded_strategy=_Opaque())["w"], full.to(torch.bfloat16))
    with pytest.raises(IncompatibleStrategyError, match="with_dtype_cast"):
        dc.load(request(), tmp_path / "c", sharded_strategy=_Opaque(), allow_dtype_cast=False)


@pytest.mark.parametrize(
    "make",
    [
        lambda: SafetensorsLoadShardedStrategy(),
        lambda: ZarrLoadShardedStrategy(verify_checksums=False),
        lambda: TensorStoreLoadShardedStrategy(concurrency=3, verify_checksums=False),
        lambda: HFLoadShardedStrategy(aliases={"a": "b"}),
    ],
)
def test_with_dtype_cast_keeps_the_other_options(make: Callable[[], LoadShardedStrategy]) -> None:
    strategy = make()
    assert strategy.with_dtype_cast(True) is strategy  # casting is the default
    strict = strategy.with_dtype_cast(False)
    assert strict is not strategy and type(strict) is type(strategy)
    settings = {k: v for k, v in vars(strategy).items() if k not in ("allow_dtype_cast", "options")}
    assert {k: v for k, v in vars(strict).items() if k in settings} == settings
    options = getattr(strict, "options", None)
    assert (options.allow_dtype_cast if options is not None else getattr(strict, "allow_dtype_cast")) is False


def test_wrappers_pass_the_setting_to_the_loader_that_reads() -> None:
    base = SafetensorsLoadShardedStrategy()
    fully = FullyParallelLoadStrategyWrapper(base)
    assert fully.with_dtype_cast(True) is fully
    strict = fully.with_dtype_cast(False)
    assert isinstance(strict, FullyParallelLoadStrategyWrapper)
    assert strict.base_strategy.options.allow_dtype_cast is False  # type: ignore[attr-defined]
    assert fully.base_strategy is base and base.options.allow_dtype_cast is True
    two = TwoStageDataParallelLoadShardedStrategy(None, base_strategy=base)
    strict_two = two.with_dtype_cast(False)
    assert strict_two._base(Path("unused")).options.allow_dtype_cast is False  # type: ignore[attr-defined]
    assert two._base(Path("unused")) is base and strict_two.timings is two.timings
