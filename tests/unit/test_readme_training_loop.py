"""The README's training loop (``train.py``), run as the README says, killed, and resumed.

Only what the README shows is used: its ``train.py`` block, launched with torchrun. A 2-rank run
is killed (SIGKILL of rank 1 as it enters the save of step 30: the other rank is torn down by
torchrun mid-save), then copies of its run directory are resumed at 2, 1 and 3 ranks:

* every resumed run starts from checkpoint-20 -- the newest *complete* one, not the partial
  checkpoint-30 -- and saves steps 30 and 40 only;
* at 2 ranks the final checkpoint equals, bit for bit, the one of an uninterrupted 2-rank run:
  model, optimizer moments, step counts and hyperparameters (the data of a step depends only on
  the step, and the restored state is exactly the saved one);
* at 1 and 3 ranks the data-parallel gradient average is summed in another order (DDP averages
  over another number of ranks), so bit-equality with the 2-rank run is not defined; the final
  checkpoint has the same keys, shapes and step counts and agrees to float32 rounding;
* at every world size the printed loss is the global batch's (all ranks' shards), so it agrees
  with the uninterrupted run's, and rotation after the restart keeps the run's best checkpoint
  (read back from its stored metrics, not forgotten by the new job): the resumed run ends with
  the same checkpoints as the uninterrupted one.

With ``--async-save`` (the loop's asynchronous saves): an uninterrupted 2-rank run writes the
same checkpoints as the synchronous one, bit for bit; a run killed the same way (rank 1 entering
its 3rd save, once the saves in flight were finalized) leaves checkpoint-30 uncommitted and
checkpoint-20 the latest; resumed at 2 ranks from there, it ends with the uninterrupted run's
checkpoint-40, bit for bit.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.checkpoints import find_latest_checkpoint
from dist_ckpt.testing.layouts import bitwise_equal
from tests.unit.torchrun import ROOT, run

pytestmark = pytest.mark.slow

#: started instead of train.py for the run that is killed: SIGKILL rank 1 at its 3rd save
#: (synchronous or asynchronous); the arguments after the script are passed on to it. With
#: asynchronous saves, every rank first finalizes the saves in flight (blocking), as slower
#: training steps would have, and waits at a barrier until every rank ran their finalize callbacks:
#: the kill then always comes after 10 and 20 were committed and reported.
KILLER = """
import os, runpy, signal, sys
import torch.distributed
import dist_ckpt
calls, queues = [0], []
class RecordingQueue(dist_ckpt.AsyncCallsQueue):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        queues.append(self)
dist_ckpt.AsyncCallsQueue = RecordingQueue
def killing(real):
    def save(path, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            for queue in queues:
                queue.maybe_finalize_async_calls(blocking=True)
            # every rank ran its finalize callbacks (rank 0 printed "step 20") before rank 1 dies:
            # torchrun stops rank 0 as soon as rank 1 is gone
            torch.distributed.barrier()
            if os.environ["RANK"] == "1":
                os.kill(os.getpid(), signal.SIGKILL)
        return real(path, *args, **kwargs)
    return save
dist_ckpt.save_model_and_optim_state = killing(dist_ckpt.save_model_and_optim_state)
dist_ckpt.async_save_model_and_optim_state = killing(dist_ckpt.async_save_model_and_optim_state)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def readme_train_py() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"```python\n(# train\.py -- run with: torchrun --nproc-per-node 2 train\.py.*?)```", text, re.S)
    assert match, "README.md has no train.py block"
    return match.group(1)


def saved_steps(proc: subprocess.CompletedProcess[str]) -> List[int]:
    return [int(m) for m in re.findall(r"^step (\d+): loss", proc.stdout, re.M)]


def printed_losses(stdout: str) -> Dict[int, float]:
    """The training loss the loop printed at each saved step."""
    return {int(step): float(loss) for step, loss in re.findall(r"^step (\d+): loss ([0-9.]+),", stdout, re.M)}


def kept(run_dir: Path) -> List[str]:
    """The checkpoint directories rotation left in the run directory."""
    return sorted(p.name for p in run_dir.iterdir() if p.name.startswith("checkpoint-"))


def checkpoint(path: Path) -> Dict[str, Any]:
    """Every stored tensor and the common state (optimizer steps and hyperparameters) of ``path``."""
    return {"tensors": dc.unshard(str(path)), "common": dc.load_common_state_dict(str(path))}


def same_common(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_common(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_common(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and bitwise_equal(a, b)
    return bool(a == b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """The uninterrupted reference run, and the run killed while saving step 30."""
    base = tmp_path_factory.mktemp("readme_loop")
    train = readme_train_py()
    out = {"reference": base / "reference", "killed": base / "killed"}

    def prepare(name: str) -> None:
        shutil.rmtree(out[name], ignore_errors=True)
        out[name].mkdir()
        (out[name] / "train.py").write_text(train, encoding="utf-8")
        (out[name] / "killer.py").write_text(KILLER, encoding="utf-8")

    reference = run(out["reference"], 2, "train.py", prepare=lambda: prepare("reference"))
    assert reference.returncode == 0, reference.stderr[-5000:]
    assert saved_steps(reference) == [10, 20, 30, 40]
    (base / "reference.stdout").write_text(reference.stdout, encoding="utf-8")
    prepare("killed")
    killed = run(out["killed"], 2, "killer.py", "train.py", retry_teardown_abort=False)
    assert killed.returncode != 0 and saved_steps(killed) == [10, 20], (killed.stdout, killed.stderr[-3000:])
    return out


def test_the_kill_leaves_no_complete_checkpoint_30(runs):
    run_dir = runs["killed"] / "runs" / "demo"
    partial = run_dir / "checkpoint-30"
    assert not (partial / "metadata.json").exists()
    assert find_latest_checkpoint(run_dir) == str(run_dir / "checkpoint-20")


@pytest.mark.parametrize("ranks", [2, 1, 3])
def test_resume_from_the_latest_complete_checkpoint(runs, tmp_path, ranks):
    work = tmp_path / f"resume{ranks}"

    def prepare() -> None:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(runs["killed"], work)

    proc = run(work, ranks, "train.py", prepare=prepare)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert saved_steps(proc) == [30, 40], proc.stdout  # resumed after step 20, not from scratch
    assert f"({ranks} ranks)" in proc.stdout
    # the global batch's loss, whatever the world size: the uninterrupted run's, to rounding
    reference_losses = printed_losses((runs["reference"].parent / "reference.stdout").read_text(encoding="utf-8"))
    for step, loss in printed_losses(proc.stdout).items():
        assert loss == pytest.approx(reference_losses[step], rel=2e-3, abs=2e-4), (step, proc.stdout)
    # the best checkpoint (20) survives the restart's rotation, as in the uninterrupted run
    assert (
        kept(work / "runs" / "demo") == kept(runs["reference"] / "runs" / "demo") == ["checkpoint-20", "checkpoint-40"]
    )
    final = checkpoint(work / "runs" / "demo" / "checkpoint-40")
    expected = checkpoint(runs["reference"] / "runs" / "demo" / "checkpoint-40")
    assert final["tensors"].keys() == expected["tensors"].keys()
    if ranks == 2:  # same world size: bit for bit what the uninterrupted run saved
        for key, tensor in expected["tensors"].items():
            assert bitwise_equal(final["tensors"][key], tensor), key
        assert same_common(final["common"], expected["common"])
    else:  # another world size: the same training up to the order of the gradient sum
        for key, tensor in expected["tensors"].items():
            assert final["tensors"][key].shape == tensor.shape
            torch.testing.assert_close(final["tensors"][key], tensor, rtol=1e-3, atol=1e-5, msg=key)
        steps = {k: v for k, v in final["common"]["optim"]["state"].items()}
        assert same_common(steps, expected["common"]["optim"]["state"])  # Adam's step counts: 40 each


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    """With --async-save: the uninterrupted run, and the run killed as rank 1 enters its 3rd save."""
    base = tmp_path_factory.mktemp("readme_loop_async")
    train = readme_train_py()
    out = {"reference": base / "reference", "killed": base / "killed"}

    def prepare(name: str) -> None:
        shutil.rmtree(out[name], ignore_errors=True)
        out[name].mkdir()
        (out[name] / "train.py").write_text(train, encoding="utf-8")
        (out[name] / "killer.py").write_text(KILLER, encoding="utf-8")

    reference = run(out["reference"], 2, "train.py", "--async-save", prepare=lambda: prepare("reference"))
    assert reference.returncode == 0, reference.stderr[-5000:]
    assert saved_steps(reference) == [10, 20, 30, 40]
    prepare("killed")
    killed = run(out["killed"], 2, "killer.py", "train.py", "--async-save", retry_teardown_abort=False)
    assert killed.returncode != 0 and saved_steps(killed) == [10, 20], (killed.stdout, killed.stderr[-3000:])
    return out


def test_async_saves_write_the_checkpoints_of_the_sync_run(runs, async_runs):
    for name in ("checkpoint-20", "checkpoint-40"):  # what rotation kept: the best (20) and the last
        got = checkpoint(async_runs["reference"] / "runs" / "demo" / name)
        expected = checkpoint(runs["reference"] / "runs" / "demo" / name)
        assert got["tensors"].keys() == expected["tensors"].keys()
        for key, tensor in expected["tensors"].items():
            assert bitwise_equal(got["tensors"][key], tensor), (name, key)
        assert same_common(got["common"], expected["common"]), name
    assert sorted(p.name for p in (async_runs["reference"] / "runs" / "demo").iterdir()) == [
        "checkpoint-20",
        "checkpoint-40",
    ]


def test_async_kill_leaves_no_complete_checkpoint_30(async_runs):
    run_dir = async_runs["killed"] / "runs" / "demo"
    assert not (run_dir / "checkpoint-30" / "metadata.json").exists()
    assert find_latest_checkpoint(run_dir) == str(run_dir / "checkpoint-20")


def test_async_resume_is_bit_exact(runs, async_runs, tmp_path):
    work = tmp_path / "resume_async"

    def prepare() -> None:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(async_runs["killed"], work)

    proc = run(work, 2, "train.py", "--async-save", prepare=prepare)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert saved_steps(proc) == [30, 40], proc.stdout  # resumed after step 20
    assert kept(work / "runs" / "demo") == ["checkpoint-20", "checkpoint-40"]  # the best survived the restart
    final = checkpoint(work / "runs" / "demo" / "checkpoint-40")
    expected = checkpoint(runs["reference"] / "runs" / "demo" / "checkpoint-40")
    assert final["tensors"].keys() == expected["tensors"].keys()
    for key, tensor in expected["tensors"].items():
        assert bitwise_equal(final["tensors"][key], tensor), key
    assert same_common(final["common"], expected["common"])
