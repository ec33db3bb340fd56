"""One save per location: the in-progress record (save_in_progress.json) decides who writes.

Two saves into one location: exactly one commits, the other raises SaveConflictError and
neither deletes the other's files. Files are deleted only when a record proves dist_ckpt wrote
them (a failed save's own files; an interrupted save whose process is provably gone);
anything else is left alone and the save refuses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.safetensors.strategy import SafetensorsSaveShardedStrategy
from dist_ckpt.collectives.process_identity import ProcessIdentity
from dist_ckpt.engine.save_claim import IN_PROGRESS_FILENAME, SaveClaim
from dist_ckpt.errors import InvalidKeyError, SaveConflictError
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor
from tests.deadlines import scaled


def _state(value: float) -> Dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((4, 4), value)),
        "o": ShardedObject("o", {"v": value}, (1,), (0,)),
        "step": int(value),
    }


def _loaded(path: Any) -> float:
    out = dc.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4)), "o": ShardedObject("o", None, (1,), (0,))}, path
    )
    value = float(out["w"][0, 0])
    assert torch.equal(out["w"], torch.full((4, 4), value)) and out["o"] == {"v": value}
    return value


class _Paused(SafetensorsSaveShardedStrategy):
    """Pauses in the middle of its save (after claiming, before writing tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.release = threading.Event(), threading.Event()

    def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
        self.started.set()
        assert self.release.wait(scaled(60))
        super().save(sharded_state_dict, checkpoint_dir)


def _race(target: Any) -> None:
    """Save A (paused mid-save), then B into the same location: B is refused, A commits."""
    paused = _Paused()
    outcome: Dict[str, Any] = {}

    def first() -> None:
        try:
            dc.save(_state(1.0), target, sharded_strategy=paused)
            outcome["a"] = "committed"
        except Exception as e:  # noqa: BLE001 -- reported below
            outcome["a"] = e

    thread = threading.Thread(target=first)
    thread.start()
    assert paused.started.wait(scaled(60))
    try:
        with pytest.raises(SaveConflictError, match="is being written by save") as info:
            dc.save(_state(2.0), target)
        assert "nothing was written or deleted" in str(info.value)
    finally:
        paused.release.set()
        thread.join(scaled(60))
    assert outcome["a"] == "committed", outcome
    assert _loaded(target) == 1.0 and dc.verify_checkpoint(target).ok


def test_two_saves_into_one_directory_one_commits(tmp_path):
    _race(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / IN_PROGRESS_FILENAME).exists()
    with pytest.raises(dc.CheckpointExistsError):
        dc.save(_state(3.0), tmp_path / "ckpt")


def test_two_saves_into_one_s3_prefix_one_commits(s3_url):
    _race(s3_url)


def test_entries_not_written_by_a_save_are_left_alone(tmp_path):
    target = tmp_path / "ckpt"
    (target / "objects" / "mine").mkdir(parents=True)
    (target / "common.pt").write_text("a user's file")
    (target / "notes.txt").write_text("also mine")
    with pytest.raises(SaveConflictError, match=r"\['common.pt', 'objects'\].*left alone"):
        dc.save(_state(1.0), target)
    assert (target / "common.pt").read_text() == "a user's file" and (target / "objects" / "mine").is_dir()
    assert sorted(p.name for p in target.iterdir()) == ["common.pt", "notes.txt", "objects"]


def test_a_failed_save_removes_only_its_own_files(tmp_path):
    class Failing(SafetensorsSaveShardedStrategy):
        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            super().save(sharded_state_dict, checkpoint_dir)
            raise OSError(28, "No space left on device")

    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(OSError, match="No space left"):
        dc.save(_state(1.0), target, sharded_strategy=Failing())
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]
    dc.save(_state(2.0), target)  # a retry owns the directory again
    assert _loaded(target) == 2.0


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _leave_claim(target: Path, **changes: Any) -> None:
    process = dataclasses.replace(ProcessIdentity.current(), pid=_dead_pid(), pid_start=None)
    claim = SaveClaim("0" * 32, ("common.pt", "safetensors"), process)
    doc = json.loads(claim.to_bytes())
    doc.update(changes)
    (target / IN_PROGRESS_FILENAME).write_text(json.dumps(doc))


def test_an_interrupted_save_whose_process_is_gone_is_cleared(tmp_path):
    target = tmp_path / "ckpt"
    (target / "safetensors").mkdir(parents=True)
    (target / "safetensors" / "rank00000_0.safetensors").write_bytes(b"half a file")
    (target / "common.pt").write_bytes(b"half")
    (target / "notes.txt").write_text("not listed by the record: kept")
    _leave_claim(target)
    dc.save(_state(4.0), target)
    assert _loaded(target) == 4.0 and dc.verify_checkpoint(target).ok
    assert (target / "notes.txt").read_text() == "not listed by the record: kept"
    assert not list(target.glob("save_takeover*"))


@pytest.mark.parametrize(
    "changes, why",
    [
        ({"pid": os.getpid(), "pid_start": None}, "is being written by save"),  # alive (this process)
        ({"boot_id": "another-machine"}, "is being written by save"),  # cannot be checked from here
        ({"format": "something else"}, "damaged"),
    ],
)
def test_a_save_that_may_be_alive_is_never_cleared(tmp_path, changes, why):
    target = tmp_path / "ckpt"
    (target / "safetensors").mkdir(parents=True)
    (target / "safetensors" / "rank00000_0.safetensors").write_bytes(b"theirs")
    _leave_claim(target, **changes)
    record = (target / IN_PROGRESS_FILENAME).read_bytes()
    with pytest.raises(SaveConflictError, match=why):
        dc.save(_state(1.0), target)
    assert (target / "safetensors" / "rank00000_0.safetensors").read_bytes() == b"theirs"
    assert (target / IN_PROGRESS_FILENAME).read_bytes() == record


def test_a_save_whose_claim_was_taken_does_not_commit(tmp_path):
    class Usurped(SafetensorsSaveShardedStrategy):
        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            super().save(sharded_state_dict, checkpoint_dir)
            claim = SaveClaim("f" * 32, ("safetensors",))
            (Path(checkpoint_dir) / IN_PROGRESS_FILENAME).write_bytes(claim.to_bytes())

    target = tmp_path / "ckpt"
    with pytest.raises(SaveConflictError, match="no longer owned by this save"):
        dc.save(_state(1.0), target, sharded_strategy=Usurped())
    assert not (target / "metadata.json").exists()
    assert (target / "safetensors").is_dir()  # not ours any more: left for the owner


def test_keys_that_would_take_a_reserved_name_are_refused_before_writing(tmp_path):
    with pytest.raises(InvalidKeyError, match="'checksums.json' is reserved"):
        dc.save({"x": ShardedObject("checksums.json", 1, (1,), (0,))}, tmp_path / "ckpt")
    assert list((tmp_path / "ckpt").iterdir()) == []
    # the zarr backend stores such a tensor key under an escaped name, so it is not refused
    w = torch.arange(4.0)
    dc.save({"w": ShardedTensor.from_rank_offsets("checksums.json", w)}, tmp_path / "z", sharded_strategy=("zarr", 1))
    out = dc.load({"w": ShardedTensor.from_rank_offsets("checksums.json", torch.zeros(4))}, tmp_path / "z")
    assert torch.equal(out["w"], w)
