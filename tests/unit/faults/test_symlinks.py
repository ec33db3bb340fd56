"""One symlink policy for every file dist_ckpt reads (dist_ckpt.storage.confined), and no read of
a file that is not a regular one (a FIFO would block the read forever).

A file (or a directory on its way) that is a link leading outside the checkpoint directory is
refused with UnsafeLinkError -- even when what it leads to has the right bytes -- by load, by
the metadata readers and by verify. Links that stay inside the checkpoint are followed, the
checkpoint directory may itself be a link (load, inspect and verify through it work), and a
HuggingFace hub-cache snapshot may link into its repository's blobs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.model.sharded import ShardedTensor
from tests.deadlines import scaled

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


def test_a_torch_dist_data_file_linked_out_is_refused(saved, tmp_path):
    """DCP's own data files follow the one link policy too: load, load_plain_tensors and convert
    refuse a ``.distcp`` that leads out of the checkpoint, though its bytes are the right ones."""
    from dist_ckpt.tools.convert import convert

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["torch_dist"], ckpt)
    (tmp_path / "outside").mkdir()
    (data,) = sorted(p.relative_to(ckpt) for p in ckpt.glob("*.distcp"))
    _link_out(ckpt, data, tmp_path / "outside")
    with pytest.raises(dc.UnsafeLinkError, match="outside the checkpoint"):
        check_loads(ckpt, 2.0)
    with pytest.raises(dc.UnsafeLinkError, match=data.name):
        dc.load_plain_tensors(ckpt)
    with pytest.raises(dc.UnsafeLinkError, match=data.name):
        convert(ckpt, tmp_path / "converted", "safetensors")


def _without_blocking(run: Callable[[], None], fifo: Path) -> None:
    """Run ``run`` in a thread; if it is still blocked on ``fifo`` after a generous wait, open the
    FIFO's writing end (so the reader sees its end and the thread finishes) and raise Hang."""
    outcome: List[BaseException] = []

    def body() -> None:
        try:
            run()
        except BaseException as e:  # noqa: BLE001 -- handed to the test's thread
            outcome.append(e)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(scaled(20))  # never waited out unless the read blocks: the refusal is immediate
    if thread.is_alive():
        while thread.is_alive():
            with contextlib.suppress(OSError):  # ENXIO: nobody has it open for reading yet
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(0.1)
        raise tally.Hang(f"blocked reading the FIFO {fifo}")
    if outcome:
        raise outcome[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fifo_in_place_of_a_file_is_a_typed_error(saved, tmp_path, backend):
    """A FIFO where a file should be -- the file itself, or a link within the checkpoint to one --
    is refused as not a regular file (or not needed by the load), never read: reading one blocks
    until someone writes to it, forever."""
    pristine = saved[backend]
    files = sorted(p.relative_to(pristine) for p in pristine.rglob("*") if p.is_file())
    row = f"FIFOs, {backend}"
    for rel in files:
        for kind in ("fifo", "link to a fifo"):
            ckpt = tmp_path / "ckpt"

            def attempt(rel: Path = rel, kind: str = kind) -> None:
                shutil.rmtree(ckpt, ignore_errors=True)
                shutil.copytree(pristine, ckpt)
                (ckpt / rel).unlink()
                fifo = ckpt / rel if kind == "fifo" else ckpt / ".fifo"
                os.mkfifo(fifo)
                if kind != "fifo":
                    os.symlink(os.path.relpath(fifo, (ckpt / rel).parent), ckpt / rel)

                def load() -> None:
                    with contextlib.suppress(dc.CheckpointingException):
                        check_loads(ckpt, 2.0)

                _without_blocking(load, fifo)
                report: List[Any] = []
                _without_blocking(lambda: report.append(dc.verify_checkpoint(ckpt)), fifo)
                assert not report[0].ok, f"verify says a checkpoint with {rel} a FIFO is ok"

            tally.attempt(row, f"{rel}: {kind}", attempt)
    tally.assert_clean(row)


@pytest.mark.parametrize("name", ["zarr/f/0.0_0/zarr.json", "zarr/f/0.0_0/c.0", "zarr/w/c.0.0"])
def test_tensorstore_is_not_handed_a_fifo(saved, tmp_path, name):
    """TensorStore opens files by path itself: the loader checks each first, as zarr-python's store
    does -- also unverified, when no manifest read would have refused the FIFO first."""
    from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreLoadShardedStrategy

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved["zarr"], ckpt)
    (ckpt / name).unlink()
    os.mkfifo(ckpt / name)

    def load() -> None:
        with pytest.raises(dc.CheckpointingException, match=name):
            check_loads(ckpt, 2.0, TensorStoreLoadShardedStrategy(verify_checksums=False))

    _without_blocking(load, ckpt / name)
