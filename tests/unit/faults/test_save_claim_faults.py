"""A hostile or half-finished save record never makes a save delete what no save wrote (issue 41).

``save_in_progress.json`` lets a save clear the files of an interrupted save whose process is
provably gone. Its ``owned`` list comes from a file anyone can edit, so a taking-over save
deletes only exact names its own strategies write (no globs, separators, ``..`` or links) and
refuses anything else, before deleting anything. A save that died while taking over leaves a
``save_takeover.<id>.json``; when that process is provably gone too, the next save recovers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.torch_dist.save import TorchDistSaveShardedStrategy
from dist_ckpt.collectives.process_identity import ProcessIdentity
from dist_ckpt.engine import save_claim
from dist_ckpt.engine.save_claim import IN_PROGRESS_FILENAME, SaveClaim, claim_location
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.storage import LocalStorage
from dist_ckpt.storage.location import resolve_location

DEAD_SAVE = "d" * 32


def _state(value: float) -> Dict[str, Any]:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 4), value)), "step": int(value)}


def _loaded(path: Any) -> float:
    out = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4))}, path)
    return float(out["w"][0, 0])


def _dead_process() -> ProcessIdentity:
    """The identity of a process of this machine that has exited (provably gone)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return dataclasses.replace(ProcessIdentity.current(), pid=proc.pid, pid_start=None)


def _record(save_id: str, owned: Sequence[str], process: ProcessIdentity) -> bytes:
    doc = json.loads(SaveClaim(save_id, ("safetensors",), process).to_bytes())
    doc["owned"] = list(owned)  # as written into the file, unchecked
    return json.dumps(doc).encode("utf-8")


def _entries(target: Path) -> List[str]:
    return sorted(p.name for p in target.iterdir())


def _interrupted(target: Path, owned: Sequence[str]) -> bytes:
    """A directory with a half-written save of a dead process, a user's file and ``owned`` as the
    record lists it; returns the record."""
    (target / "safetensors").mkdir(parents=True)
    (target / "safetensors" / "rank00000_0.safetensors").write_bytes(b"half a file")
    (target / "notes.txt").write_text("a user's file")
    record = _record(DEAD_SAVE, owned, _dead_process())
    (target / IN_PROGRESS_FILENAME).write_bytes(record)
    return record


@pytest.mark.parametrize(
    "name",
    ["*", "*.txt", "n?tes.txt", "[n]otes.txt", "../ckpt/notes.txt", "safetensors/../notes.txt", "./notes.txt", ".."],
)
def test_an_owned_name_that_is_not_an_exact_entry_of_the_save_deletes_nothing(tmp_path, name):
    target = tmp_path / "ckpt"
    record = _interrupted(target, ["safetensors", name])
    before = _entries(target)
    with pytest.raises(dc.SaveConflictError, match="left alone") as info:
        dc.save(_state(1.0), target)
    assert repr(name) in str(info.value) and str(target) in str(info.value)
    assert _entries(target) == before and (target / "notes.txt").read_text() == "a user's file"
    assert (target / "safetensors" / "rank00000_0.safetensors").read_bytes() == b"half a file"
    assert (target / IN_PROGRESS_FILENAME).read_bytes() == record  # still the interrupted save's
    assert not list(target.glob("save_takeover*"))


def test_an_owned_name_the_save_does_not_write_is_refused_when_present(tmp_path):
    target = tmp_path / "ckpt"
    _interrupted(target, ["safetensors", "notes.txt"])
    with pytest.raises(dc.SaveConflictError, match=r"\['notes.txt'\].*left alone"):
        dc.save(_state(1.0), target)
    assert (target / "notes.txt").read_text() == "a user's file"


def test_an_owned_entry_that_is_a_link_is_left_alone(tmp_path):
    target = tmp_path / "ckpt"
    (tmp_path / "user_data").mkdir()
    (tmp_path / "user_data" / "keep.txt").write_text("mine")
    _interrupted(target, ["safetensors", "common.pt"])
    os.symlink(tmp_path / "user_data", target / "common.pt")
    with pytest.raises(dc.SaveConflictError, match=r"\['common.pt'\].*left alone"):
        dc.save(_state(1.0), target)
    assert (target / "common.pt").is_symlink() and (tmp_path / "user_data" / "keep.txt").read_text() == "mine"
    assert (target / "safetensors" / "rank00000_0.safetensors").exists()


def test_a_pattern_the_save_declares_clears_only_its_regular_files(tmp_path):
    """torch_dist declares ``__*.distcp``: a record that lists exactly that pattern clears DCP's files
    of the interrupted save, and refuses if what the pattern matches is not a plain file."""
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "__0_0.distcp").write_bytes(b"half")
    (target / "__weird.distcp").mkdir()
    (target / IN_PROGRESS_FILENAME).write_bytes(_record(DEAD_SAVE, ["__*.distcp"], _dead_process()))
    owned = TorchDistSaveShardedStrategy.owned_paths
    with pytest.raises(dc.SaveConflictError, match=r"\['__weird.distcp'\].*left alone"):
        claim_location(LocalStorage(target), owned, "a" * 32)
    assert (target / "__0_0.distcp").read_bytes() == b"half"
    (target / "__weird.distcp").rmdir()
    claim = claim_location(LocalStorage(target), owned, "a" * 32)
    assert _entries(target) == [IN_PROGRESS_FILENAME]
    assert SaveClaim.parse((target / IN_PROGRESS_FILENAME).read_bytes(), "record").save_id == claim.save_id


def test_exact_names_of_the_save_are_still_cleared(tmp_path):
    target = tmp_path / "ckpt"
    _interrupted(target, ["safetensors", "common.pt", "zarr"])  # zarr: not written here, and absent
    (target / "common.pt").write_bytes(b"half")
    dc.save(_state(3.0), target)
    assert _loaded(target) == 3.0 and (target / "notes.txt").read_text() == "a user's file"


def test_the_files_of_a_dead_save_of_another_built_in_backend_are_cleared(tmp_path):
    """A zarr save killed mid-write, then a save of the default backend into the same directory (a
    restarted job): the names a built-in strategy writes are dist_ckpt's, so they are cleared; a
    user's file is still left alone."""
    target = tmp_path / "ckpt"
    _interrupted(target, ["safetensors", "zarr", ".partial-zarr"])
    (target / ".partial-zarr" / "w").mkdir(parents=True)
    (target / ".partial-zarr" / "w" / "c.0").write_bytes(b"half a chunk")
    dc.save(_state(4.0), target)
    assert _loaded(target) == 4.0 and not (target / ".partial-zarr").exists()
    assert (target / "notes.txt").read_text() == "a user's file"


def _died_taking_over(target: Path) -> None:
    """An interrupted save (dead), and a second save (dead too) that died while taking it over:
    its takeover record is there, the first save's record and files still are."""
    _interrupted(target, ["safetensors", "common.pt"])
    taker = SaveClaim("e" * 32, ("safetensors", "common.pt"), _dead_process())
    (target / f"save_takeover.{DEAD_SAVE}.json").write_bytes(taker.to_bytes())


def test_a_save_that_died_while_taking_over_leaves_the_directory_usable(tmp_path):
    target = tmp_path / "ckpt"
    _died_taking_over(target)
    dc.save(_state(5.0), target)
    assert _loaded(target) == 5.0 and dc.verify_checkpoint(target).ok
    assert (target / "notes.txt").read_text() == "a user's file"
    assert not list(target.glob("save_takeover*")) and not (target / IN_PROGRESS_FILENAME).exists()


def test_a_takeover_by_a_live_process_is_still_refused(tmp_path):
    target = tmp_path / "ckpt"
    _interrupted(target, ["safetensors"])
    taker = SaveClaim("e" * 32, ("safetensors",))  # this process: alive
    (target / f"save_takeover.{DEAD_SAVE}.json").write_bytes(taker.to_bytes())
    with pytest.raises(dc.SaveConflictError, match="another save is taking over"):
        dc.save(_state(1.0), target)
    assert (target / "safetensors" / "rank00000_0.safetensors").exists()
    assert (target / f"save_takeover.{DEAD_SAVE}.json").read_bytes() == taker.to_bytes()


@pytest.mark.parametrize("content", [b"{not json", None])
def test_a_damaged_or_looping_takeover_record_is_refused(tmp_path, content):
    target = tmp_path / "ckpt"
    _interrupted(target, ["safetensors"])
    loop = SaveClaim(DEAD_SAVE, ("safetensors",), _dead_process()).to_bytes()  # takes over itself
    (target / f"save_takeover.{DEAD_SAVE}.json").write_bytes(content if content is not None else loop)
    with pytest.raises(dc.SaveConflictError, match="save_takeover"):
        dc.save(_state(1.0), target)
    assert (target / "safetensors" / "rank00000_0.safetensors").exists()


def test_a_save_that_finds_the_takeover_done_meanwhile_deletes_nothing(tmp_path, monkeypatch):
    """Save B reads the dead save's record, then save A takes over and starts writing: when B gets
    the (by then free) takeover record, it sees the record is A's now and refuses."""
    target = tmp_path / "ckpt"
    _interrupted(target, ["safetensors"])
    winner = SaveClaim("a" * 32, ("safetensors",))  # a live save that took over meanwhile
    checked = save_claim._deletable_entries

    def then_another_save_takes_over(storage: Any, other: SaveClaim, allowed: Sequence[str]) -> List[str]:
        entries = checked(storage, other, allowed)
        (target / IN_PROGRESS_FILENAME).write_bytes(winner.to_bytes())
        (target / "safetensors" / "rank00000_0.safetensors").write_bytes(b"the winner's file")
        return entries

    monkeypatch.setattr(save_claim, "_deletable_entries", then_another_save_takes_over)
    with pytest.raises(dc.SaveConflictError, match="took over .* meanwhile"):
        dc.save(_state(1.0), target)
    assert (target / "safetensors" / "rank00000_0.safetensors").read_bytes() == b"the winner's file"
    assert (target / IN_PROGRESS_FILENAME).read_bytes() == winner.to_bytes()
    assert not list(target.glob("save_takeover*"))


def test_on_an_object_store_a_glob_in_the_record_deletes_nothing_either(s3_url):
    location = resolve_location(s3_url)
    location.write("safetensors/rank00000_0.safetensors", b"half a file")
    location.write("notes.txt", b"a user's object")
    location.write(IN_PROGRESS_FILENAME, _record(DEAD_SAVE, ["safetensors", "*"], _dead_process()))
    with pytest.raises(dc.SaveConflictError, match=r"\['\*'\].*left alone"):
        dc.save(_state(1.0), s3_url)
    keys = {o.key for o in location.list()}
    assert keys == {IN_PROGRESS_FILENAME, "notes.txt", "safetensors/rank00000_0.safetensors"}
    location.write(IN_PROGRESS_FILENAME, _record(DEAD_SAVE, ["safetensors", "common.pt"], _dead_process()))
    dc.save(_state(2.0), s3_url)  # exact names of this save: cleared, and the save commits
    assert _loaded(s3_url) == 2.0 and location.read("notes.txt") == b"a user's object"
