"""Chunk keys ``c.<i>.<j>`` (layout.CHUNK_SEPARATOR, issue 17): every array of a new checkpoint is
one directory holding its ``zarr.json`` and its chunk files, which zarr-python and TensorStore open
by the encoding each ``zarr.json`` records; checkpoints with ``c/<i>/<j>`` keys (saved before)
still load, whole chunks straight from their files too; a save creates one directory and two
files per tensor (saved as one chunk), found by counting the calls that make them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
import zarr

import dist_ckpt as dc
from dist_ckpt.backends.zarr import layout as zarr_layout
from dist_ckpt.backends.zarr.layout import ZARR_DIR
from dist_ckpt.backends.zarr.tensorstore_engine import open_ts_array
from dist_ckpt.model.sharded import ShardedTensor
from tests.golden.state import full_tensors
from tests.paths import GOLDEN_DIR

from .test_zarr_direct_io import ENGINES, no_array_library_reads  # noqa: F401 -- a fixture
from .test_zarr_strategy import flat_pieces, split_state

DOT_KEYS = {"name": "default", "configuration": {"separator": "."}}


def _state(full: torch.Tensor, flat: torch.Tensor) -> Dict[str, Any]:
    return {
        **split_state("w", full, 0, 4),
        **{f"f{i}": sh for i, sh in enumerate(flat_pieces("f", flat, [0, 5, 12]))},
        "s": ShardedTensor.from_rank_offsets("s", torch.tensor(2.5)),
    }


def _arrays(root: Path) -> List[Path]:
    return sorted(p.parent for p in root.rglob("zarr.json") if json.loads(p.read_text())["node_type"] == "array")


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_new_arrays_have_dot_keys_and_zarr_python_and_tensorstore_read_them(engine, tmp_path, monkeypatch):
    monkeypatch.setattr(zarr_layout, "FRAGMENT_CHUNK_ELEMENTS", 4)  # fragments of several chunks, one padded
    full, flat = torch.arange(48.0).reshape(8, 6), torch.arange(12.0).reshape(3, 4) - 5
    dc.save(_state(full, flat), tmp_path, sharded_strategy=ENGINES[engine][0]())
    root = tmp_path / ZARR_DIR
    arrays = _arrays(root)
    assert [a.relative_to(root).as_posix() for a in arrays] == ["f/0.0_0", "f/0.0_5", "s", "w"]
    for array in arrays:
        assert json.loads((array / "zarr.json").read_text())["chunk_key_encoding"] == DOT_KEYS
        assert all(p.is_file() for p in array.iterdir()), array  # chunk files beside zarr.json, no directories
    assert sorted(p.name for p in (root / "w").iterdir()) == ["c.0.0", "c.1.0", "c.2.0", "c.3.0", "zarr.json"]
    assert sorted(p.name for p in (root / "f" / "0.0_5").iterdir()) == ["c.0", "c.1", "zarr.json"]
    expected = {"w": full, "s": torch.tensor(2.5), "f/0.0_0": flat.flatten()[:5], "f/0.0_5": flat.flatten()[5:]}
    for name, values in expected.items():
        by_zarr = zarr.open_array(str(root / name), mode="r")[...]
        by_tensorstore = open_ts_array(root / name).read().result()
        assert np.array_equal(by_zarr, values.numpy()) and np.array_equal(by_tensorstore, values.numpy()), name


@pytest.mark.parametrize("golden", ["zarr_records", "zarr_dot_keys_records"])
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_whole_chunks_load_straight_from_their_files_with_either_separator(
    golden,
    engine,
    tmp_path,
    no_array_library_reads,  # noqa: F811 -- the fixture
):
    shutil.copytree(GOLDEN_DIR / golden, tmp_path / golden)  # a copy: the golden is never written
    separator = "/" if golden == "zarr_records" else "."
    assert json.loads((tmp_path / golden / ZARR_DIR / "layer.w" / "zarr.json").read_text())["chunk_key_encoding"] == {
        "name": "default",
        "configuration": {"separator": separator},
    }
    full = full_tensors()
    request = {
        **{f"w{r}": ShardedTensor.from_rank_offsets("layer.w", torch.zeros(2, 6), (0, r, 2)) for r in range(2)},
        **{
            f"e{c}": ShardedTensor.from_rank_offsets("emb", torch.zeros(3, 2, dtype=torch.int64), (1, c, 2))
            for c in range(2)
        },
        "s": ShardedTensor.from_rank_offsets("scalar", torch.zeros((), dtype=torch.float64)),
    }
    out = dc.load(request, tmp_path / golden, sharded_strategy=ENGINES[engine][1]())
    for r in range(2):
        assert torch.equal(out[f"w{r}"], full["layer.w"][2 * r : 2 * r + 2])
        assert torch.equal(out[f"e{r}"], full["emb"][:, 2 * r : 2 * r + 2])
    assert torch.equal(out["s"], full["scalar"])


def _many(n: int) -> Dict[str, Any]:
    return {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}.w", torch.full((4, 3), float(i))) for i in range(n)}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_save_creates_one_directory_and_two_files_per_tensor(engine, tmp_path, monkeypatch):
    """Counted where they are made (``os.mkdir``, ``os.open`` with ``O_CREAT`` under the tree) and
    in the tree a save leaves: a chunk key with ``/`` or a check before each creation would show."""
    counts = []
    for n in (4, 20):
        made: List[str] = []
        real_mkdir, real_open = os.mkdir, os.open
        target = tmp_path / f"n{n}"
        target.mkdir()  # as the engine makes it before the strategy saves

        def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
            made.append(f"dir {path}")
            real_mkdir(path, *args, **kwargs)

        def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if flags & os.O_CREAT and str(target) in str(path):
                made.append(f"file {path}")
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", mkdir)
        monkeypatch.setattr(os, "open", open_)
        ENGINES[engine][0]().save(_many(n), target)  # the strategy alone: no common.pt, no metadata.json
        monkeypatch.undo()
        tree = [p for p in (target / ZARR_DIR).rglob("*")]
        counts.append(
            (
                sum(m.startswith("dir") for m in made),
                sum(m.startswith("file") for m in made),
                sum(p.is_dir() for p in tree),
                sum(p.is_file() for p in tree),
            )
        )
    # per tensor: one directory (its array) and two files (zarr.json, its chunk), each made once
    assert [(b - a) / 16 for a, b in zip(*counts)] == [1, 2, 1, 2], counts
    # besides: .partial-zarr (and the writers of the root group and of the manifest finding it
    # there), the root group's zarr.json and checksums.json (both written last, through a
    # temporary file, not counted here)
    assert counts[0] == (4 + 3, 2 * 4, 4, 2 * 4 + 2), counts
