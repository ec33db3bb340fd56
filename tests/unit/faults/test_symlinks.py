"""One symlink policy for every file dist_ckpt reads (dist_ckpt.storage.confined).

A file (or a directory on its way) that is a link leading outside the checkpoint directory is
refused with UnsafeLinkError -- even when what it leads to has the right bytes -- by load, by
the metadata readers and by verify. Links that stay inside the checkpoint are followed, the
checkpoint directory may itself be a link (load, inspect and verify through it work), and a
HuggingFace hub-cache snapshot may link into its repository's blobs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.model.sharded import ShardedTensor

from . import tally
from .scenario import check_loads, state, strategy

BACKENDS = ["safetensors", "zarr", "torch_dist"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("links")
    out = {}
    for backend in BACKENDS:
        dc.save(state(2.0), root / backend, sharded_strategy=strategy(backend))
        out[backend] = root / backend
    return out


def _link_out(ckpt: Path, rel: Path, outside: Path) -> None:
    """Move ``ckpt/rel`` (a file or a directory) outside the checkpoint and link to it."""
    target = outside / rel.as_posix().replace("/", "__")
    shutil.move(str(ckpt / rel), target)
    os.symlink(target, ckpt / rel)


def _link_in(ckpt: Path, rel: Path) -> None:
    """Move ``ckpt/rel`` elsewhere inside the checkpoint and link to it (relative link)."""
    hidden = ckpt / f".moved-{rel.as_posix().replace('/', '__')}"
    shutil.move(str(ckpt / rel), hidden)
    os.symlink(os.path.relpath(hidden, (ckpt / rel).parent), ckpt / rel)


@pytest.mark.parametrize("backend", BACKENDS)
def test_links_out_of_the_checkpoint_are_refused_everywhere(saved, tmp_path, backend):
    pristine = saved[backend]
    entries = sorted({p.relative_to(pristine) for p in pristine.rglob("*")})
    row = f"symlinks, {backend}"
    for rel in entries:
        for kind in ("out", "in"):
            ckpt = tmp_path / "ckpt"
            outside = tmp_path / "outside"

            def attempt(rel: Path = rel, kind: str = kind) -> None:
                for d in (ckpt, outside):
                    shutil.rmtree(d, ignore_errors=True)
                shutil.copytree(pristine, ckpt)
                outside.mkdir()
                if kind == "in":
                    _link_in(ckpt, rel)
                    check_loads(ckpt, 2.0)
                    assert dc.verify_checkpoint(ckpt).ok, dc.verify_checkpoint(ckpt).problems
                    return
                _link_out(ckpt, rel, outside)
                try:  # refused, or not needed by a load (the root group of zarr/): loads right
                    check_loads(ckpt, 2.0)
                except dc.UnsafeLinkError:
                    pass
                report = dc.verify_checkpoint(ckpt)  # reads every file: must name the link
                assert not report.ok and any("outside the checkpoint" in p.problem for p in report.problems), report

            tally.attempt(row, f"{rel} linked {kind}side", attempt)
    tally.assert_clean(row)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_checkpoint_directory_may_be_a_link(saved, tmp_path, backend):
    link = tmp_path / "latest"
    os.symlink(saved[backend], link)
    check_loads(link, 2.0)
    assert set(dc.load_plain_tensors(link)) == {"w", "e", "f"}
    assert dc.verify_checkpoint(link).ok
    for command in ("inspect", "verify"):
        done = subprocess.run(
            [sys.executable, "-m", "dist_ckpt", command, str(link)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
        )
        assert done.returncode == 0, done.stderr


def _hf_cache(tmp_path: Path) -> Tuple[Path, torch.Tensor]:
    """A HuggingFace hub-cache layout: snapshots/<rev>/model.safetensors -> ../../blobs/<hash>."""
    from safetensors.torch import save_file

    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    w = torch.arange(6.0).reshape(2, 3)
    save_file({"w": w}, str(repo / "blobs" / "0f1e2d"))
    os.symlink("../../blobs/0f1e2d", snapshot / "model.safetensors")
    return snapshot, w


def test_a_huggingface_cache_snapshot_may_link_to_its_blobs(tmp_path):
    snapshot, w = _hf_cache(tmp_path)
    out = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))}, snapshot)
    assert torch.equal(out["w"], w)
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move(str(tmp_path / "models--org--tiny" / "blobs" / "0f1e2d"), elsewhere)
    os.unlink(snapshot / "model.safetensors")
    os.symlink(elsewhere, snapshot / "model.safetensors")
    with pytest.raises(dc.UnsafeLinkError, match="outside the checkpoint directory"):
        dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))}, snapshot)
