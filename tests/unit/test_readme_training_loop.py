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
  checkpoint has the same keys, shapes and step counts and agrees to float32 rounding.
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
KILLER = """
import os, runpy, signal, sys
import dist_ckpt
real_save = dist_ckpt.save_model_and_optim_state
calls = [0]
def save(path, *args, **kwargs):
    calls[0] += 1
    if calls[0] == 3 and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(path, *args, **kwargs)
dist_ckpt.save_model_and_optim_state = save
runpy.run_path(sys.argv[1], run_name="__main__")
"""


def readme_train_py() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(
        r"```python\n(# train\.py -- run with: torchrun --nproc-per-node 2 train\.py\n.*?)```", text, re.S
    )
    assert match, "README.md has no train.py block"
    return match.group(1)


def saved_steps(proc: subprocess.CompletedProcess[str]) -> List[int]:
    return [int(m) for m in re.findall(r"^step (\d+): loss", proc.stdout, re.M)]


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
