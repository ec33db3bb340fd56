"""What the fault-injection tests save, load and check: a small state with every kind of entry.

A run directory holds ``iter_1``, committed before any fault; each attempt saves ``iter_2``
with a fault injected, then checks, in order: the error (typed, or the injected fault itself);
that ``iter_1`` is untouched byte for byte (else :class:`~.tally.DataLost`); that ``iter_2`` is
either committed and loads exactly (else :class:`~.tally.SilentWrong`) or is refused as not a
checkpoint; and that a new save into ``iter_2`` succeeds and loads exactly (a failed or killed
save never blocks its location).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch

import dist_ckpt as dc
from dist_ckpt.backends.safetensors.format import read_header_at
from dist_ckpt.backends.safetensors.strategy import SafetensorsSaveOptions, SafetensorsSaveShardedStrategy
from dist_ckpt.backends.torch_dist.save import TorchDistSaveShardedStrategy
from dist_ckpt.errors import NotACheckpointError
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor
from tests.deadlines import scaled

from .inject import InjectedFault, Injector
from .tally import DataLost, Hang, SilentWrong, is_typed


def state(value: float) -> Dict[str, Any]:
    """A chunked float tensor, an int64 tensor, a flattened (distributed-optimizer) tensor, an
    object and a common value, all derived from ``value``."""
    flat = (torch.arange(12.0) * value).reshape(3, 4).flatten()
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((16, 16), value)),
        "e": ShardedTensor.from_rank_offsets("e", torch.arange(8, dtype=torch.int64) * int(value)),
        "f0": ShardedTensor.from_rank_offsets_flat("f", flat[:5].clone(), (3, 4), flattened_range=slice(0, 5)),
        "f1": ShardedTensor.from_rank_offsets_flat("f", flat[5:].clone(), (3, 4), flattened_range=slice(5, 12)),
        "o": ShardedObject("o", {"v": value}, (1,), (0,)),
        "step": int(value),
    }


def request() -> Dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(16, 16)),
        "e": ShardedTensor.from_rank_offsets("e", torch.zeros(8, dtype=torch.int64)),
        "f": ShardedTensor.from_rank_offsets("f", torch.zeros(3, 4)),
        "o": ShardedObject("o", None, (1,), (0,)),
    }


def expected(value: float) -> Dict[str, Any]:
    return {
        "w": torch.full((16, 16), value),
        "e": torch.arange(8, dtype=torch.int64) * int(value),
        "f": (torch.arange(12.0) * value).reshape(3, 4),
        "o": {"v": value},
        "step": int(value),
    }


def check_loads(path: Any, value: float, load_strategy: Any = None) -> None:
    """Load everything; :class:`SilentWrong` if any value differs from what ``state(value)`` saved."""
    out = dc.load(request(), path, sharded_strategy=load_strategy)
    for key, want in expected(value).items():
        got = out.get(key)
        same = torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
        if not same:
            raise SilentWrong(f"{key!r} loaded from {path} differs from what was saved")


def strategy(backend: str) -> Any:
    """The save strategy of ``backend``, single-threaded so that every run makes its write calls
    in the same order."""
    if backend == "safetensors":
        return SafetensorsSaveShardedStrategy(SafetensorsSaveOptions(thread_count=1))
    if backend == "torch_dist":
        return TorchDistSaveShardedStrategy(thread_count=1)
    return ("zarr", 1)


def fingerprint(path: Path) -> Dict[str, str]:
    """Every file under ``path`` and a hash of its bytes."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


class Run:
    """A run directory with a committed ``iter_1`` to protect."""

    def __init__(self, root: Path, backend: str) -> None:
        self.root = root
        self.backend = backend
        self.previous = root / "iter_1"
        dc.save(state(1.0), self.previous, sharded_strategy=strategy(backend))
        self.before = fingerprint(self.previous)
        self.attempts = 0

    def target(self) -> Path:
        self.attempts += 1
        return self.root / f"iter_2_{self.attempts}"

    def check_after(self, target: Path, error: Optional[BaseException]) -> None:
        """The checks that follow a faulty save (see the module docstring)."""
        if error is not None and not is_typed(error, InjectedFault):
            raise error
        if fingerprint(self.previous) != self.before:
            raise DataLost(f"{self.previous} changed while saving {target}")
        committed = (target / "metadata.json").exists()
        if not committed:
            _no_partial_data_under_final_names(target, self.previous)
            if error is not None:  # raised, not killed: the save removes what it wrote
                _nothing_left(target)
        if committed:  # the fault came after the commit
            check_loads(target, 2.0)
            if not dc.verify_checkpoint(target).ok:
                raise SilentWrong(f"{target} is committed but verify finds problems")
        else:
            try:
                dc.load(request(), target)
            except NotACheckpointError:
                pass
            else:
                raise SilentWrong(f"{target} loaded although it was never committed")
            dc.save(state(3.0), target, sharded_strategy=strategy(self.backend))
            check_loads(target, 3.0)
        shutil.rmtree(target)


def _nothing_left(target: Path) -> None:
    """A save that raised removed every file it wrote (temporary ones included)."""
    left = sorted(str(p.relative_to(target)) for p in target.rglob("*") if not p.is_dir()) if target.exists() else []
    if left:
        raise SilentWrong(f"the failed save into {target} left {left}")


def _no_partial_data_under_final_names(target: Path, previous: Path) -> None:
    """Data under a final name must be whole: a safetensors file whose header describes its
    size exactly, a ``zarr/`` tree with its manifest (written last, before the tree's rename),
    a DCP ``.distcp`` file as long as the file of that name in ``previous`` (the same layout)."""
    for f in target.glob("safetensors/*.safetensors"):
        if f.name.startswith("."):
            continue
        try:
            read_header_at(f)
        except dc.CheckpointingException as e:
            raise SilentWrong(f"a partial data file is under its final name: {e}") from e
    if (target / "zarr").exists() and not (target / "zarr" / "checksums.json").exists():
        raise SilentWrong(f"a partial zarr tree is under its final name in {target}")
    for f in target.glob("__*.distcp"):
        whole = previous / f.name
        if not whole.is_file() or f.stat().st_size != whole.stat().st_size:
            raise SilentWrong(f"a partial DCP file is under its final name: {f}")


def raise_at(run: Run, at: Optional[int], save: Callable[[Path], None]) -> Callable[[], None]:
    """An attempt: ``save(target)`` with write call ``at`` raising :class:`InjectedFault`."""

    def attempt() -> None:
        target = run.target()
        error: Optional[BaseException] = None
        try:
            with Injector(at):
                save(target)
        except Hang:
            raise
        except Exception as e:  # noqa: BLE001 -- classified by check_after
            error = e
        run.check_after(target, error)

    return attempt


def kill_at(run: Run, at: int, save: Callable[[Path], None], seconds: float = 60.0) -> Callable[[], None]:
    """An attempt: a forked copy of this process runs ``save(target)`` and is killed (``os._exit``,
    no cleanup) at write call ``at``; then the checks, from this process."""

    def attempt() -> None:
        target = run.target()
        report = run.root / f"{target.name}.error"
        pid = os.fork()
        if pid == 0:  # pragma: no cover -- the child
            code = 0
            try:
                with Injector(at, kill=True):
                    save(target)
            except BaseException:  # noqa: BLE001 -- reported through the exit code
                report.write_text(traceback.format_exc())
                code = 1
            os._exit(code)
        give_up = time.monotonic() + scaled(seconds)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > give_up:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise Hang(f"the save killed at write call {at} did not end within {seconds}s")
            time.sleep(0.01)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 1:
            raise AssertionError(f"the save raised before reaching write call {at}: {report.read_text()}")
        run.check_after(target, None)

    return attempt
