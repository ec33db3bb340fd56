"""Golden checkpoints: every committed format version still loads, bit for bit.

``tests/golden/<name>/`` were written by the dist_ckpt version that introduced each format
(see ``tests/golden/make_golden.py``); they are never regenerated.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.model.sharded import ShardedTensor
from tests.golden.state import COMMON, WORLD, full_request, full_tensors, objects
from tests.paths import GOLDEN_DIR

GOLDEN = GOLDEN_DIR
ALL = sorted(p.name for p in GOLDEN.iterdir() if (p / "metadata.json").is_file())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(params=ALL)
def golden(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    # a copy: a load must never need to write, but a bug that did must not touch the golden
    copy = tmp_path / request.param
    shutil.copytree(GOLDEN / request.param, copy)
    return copy


def test_goldens_exist() -> None:
    assert {
        "safetensors_index_v1",
        "safetensors_index_v2",
        "safetensors_index_v3",
        "zarr_v1",
        "zarr_v1_checksums",
        "safetensors_records",
        "zarr_records",
        "zarr_dot_keys_records",
    } <= set(ALL)


def test_goldens_verify_clean(golden: Path) -> None:
    report = dc.verify_checkpoint(golden)
    assert report.ok, report.problems
    with_records = golden.name.endswith("_records")  # metadata.json lists its integrity records
    checksummed = ("safetensors_index_v2", "safetensors_index_v3", "zarr_v1_checksums")
    with_checksums = with_records or golden.name in checksummed
    unrecorded = [n for n in report.notes if "no integrity records" in n]
    assert bool(unrecorded) != with_records, report.notes
    assert (len(report.notes) == len(unrecorded)) == with_checksums, report.notes


@pytest.mark.parametrize("name", ["zarr_v1", "zarr_v1_checksums", "zarr_records", "zarr_dot_keys_records"])
def test_zarr_goldens_load_with_tensorstore(name: str, tmp_path: Path) -> None:
    pytest.importorskip("tensorstore")
    from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreLoadShardedStrategy

    shutil.copytree(GOLDEN / name, tmp_path / name)
    loaded = dc.load(full_request(), tmp_path / name, sharded_strategy=TensorStoreLoadShardedStrategy())
    for key, expected in full_tensors().items():
        assert torch.equal(bits(loaded[key]), bits(expected)), key


def test_loads_whole_tensors_objects_and_common(golden: Path) -> None:
    loaded = dc.load(full_request(), golden)
    for key, expected in full_tensors().items():
        assert loaded[key].dtype == expected.dtype and loaded[key].shape == expected.shape, key
        assert torch.equal(bits(loaded[key]), bits(expected)), key
    for r in range(WORLD):
        assert loaded[f"rng{r}"] == objects()[f"rng/shard_{r}_{WORLD}"]
    for key, value in COMMON.items():
        assert loaded[key] == value


def test_metadata_describes_tensors_as_saved(golden: Path) -> None:
    """Every format answers load_tensors_metadata alike: the flattened tensor as one flat range."""
    meta = dc.load_tensors_metadata(golden)
    full = full_tensors()
    assert set(meta) == set(full)
    for key, sh in meta.items():
        assert sh.global_shape == tuple(full[key].shape) and sh.dtype == full[key].dtype, key
        flat = slice(0, full[key].numel()) if key == "opt.exp_avg" else None
        assert sh.flattened_range == flat, key


def test_loads_resharded(golden: Path) -> None:
    full = full_tensors()["layer.w"]
    request = {f"c{c}": ShardedTensor.from_rank_offsets("layer.w", torch.zeros(4, 2), (1, c, 3)) for c in range(3)}
    loaded = dc.load(request, golden)
    for c in range(3):
        assert torch.equal(loaded[f"c{c}"], full[:, 2 * c : 2 * c + 2])
