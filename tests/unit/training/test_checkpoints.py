"""Unit tests of dist_ckpt.training.checkpoints: latest, rotation, metrics, HF symlinks, format detection.

Every checkpoint here is real: dist_ckpt checkpoints come from ``dist_ckpt.save`` in this one
process, HF folders from ``safetensors.torch.save_file`` / ``torch.save``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import dist_ckpt as dc
from dist_ckpt.errors import (
    CheckpointingException,
    CheckpointManagementError,
    CorruptCheckpointError,
    NotACheckpointError,
    SymlinkConflictError,
)
from dist_ckpt.record.commit import METADATA_FILENAME, read_config
from dist_ckpt.training import checkpoints as C
from dist_ckpt.training import rotation
from dist_ckpt.training.checkpoints import (
    CheckpointFormat,
    CheckpointMeta,
    create_pretrained_symlinks,
    find_latest_checkpoint,
    get_checkpoint_metadata,
    list_checkpoints,
    load_checkpoint_metrics,
    maybe_delete_oldest_checkpoint,
    next_checkpoint_path,
    parse_checkpoint_step,
    save_checkpoint_metrics,
    validate_checkpoint,
)

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


# --------------------------------------------------------------------------- builders


def make_dist(path: Path, value: float = 1.0) -> Path:
    """A real committed dist_ckpt checkpoint."""
    dc.save({"w": dc.ShardedTensor.from_rank_offsets("w", torch.full((4,), value)), "step": 1}, path)
    return path


def make_partial_dist(path: Path) -> Path:
    """What a crashed dist_ckpt save leaves: every file but the commit record."""
    make_dist(path)
    (path / METADATA_FILENAME).unlink()
    return path


def make_hf(path: Path, value: float = 1.0) -> Path:
    path.mkdir(parents=True)
    save_file({"a": torch.full((3,), value)}, str(path / "model.safetensors"))
    return path


def make_hf_sharded(path: Path) -> Path:
    path.mkdir(parents=True)
    save_file({"a": torch.ones(2)}, str(path / SHARDS[0]))
    save_file({"b": torch.zeros(3)}, str(path / SHARDS[1]))
    index = {"metadata": {"total_size": 20}, "weight_map": {"a": SHARDS[0], "b": SHARDS[1]}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def make_hf_bin(path: Path, sharded: bool = False) -> Path:
    path.mkdir(parents=True)
    if not sharded:
        torch.save({"a": torch.ones(2)}, path / "pytorch_model.bin")
        return path
    names = ("pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin")
    torch.save({"a": torch.ones(2)}, path / names[0])
    torch.save({"b": torch.ones(2)}, path / names[1])
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"a": names[0], "b": names[1]}}))
    return path


def truncate(file: Path, drop: int = 4) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:-drop])


def age(path: Path, seconds_ago: float) -> None:
    """Set a directory's mtime (and atime) ``seconds_ago`` into the past."""
    t = 1_700_000_000 - seconds_ago
    os.utime(path, (t, t))


def names(model_dir: Path) -> set:
    return set(os.listdir(model_dir))


# --------------------------------------------------------------------------- names


class TestNames:
    @pytest.mark.parametrize(
        "name, step",
        [
            ("checkpoint-1000", 1000),
            ("checkpoint_7", 7),
            ("iter_0001000", 1000),
            ("iter_0000000", 0),
            ("step-12", 12),
            ("step_12", 12),
            ("global_step300", 300),
        ],
    )
    def test_parse(self, name, step):
        assert parse_checkpoint_step(name) == step

    @pytest.mark.parametrize(
        "name",
        [
            "checkpoint-",
            "checkpoint-1a",
            "final",
            "runs",
            "xcheckpoint-1",
            "checkpoint-1/",
            "checkpoint--1",
            "iter_\u0661\u0662",
            "checkpoint-1000.tmp",
            ".dist_ckpt-trash-checkpoint-1-0a1b2c3d",
            "1000",
        ],
    )
    def test_parse_rejects(self, name):
        assert parse_checkpoint_step(name) is None

    def test_next_path_for_a_step(self, tmp_path):
        assert next_checkpoint_path(str(tmp_path), 1000) == os.path.join(str(tmp_path), "checkpoint-1000")
        assert next_checkpoint_path(tmp_path, "1000") == os.path.join(str(tmp_path), "checkpoint-1000")
        assert next_checkpoint_path(tmp_path, 0) == os.path.join(str(tmp_path), "checkpoint-0")

    def test_next_path_for_a_name(self, tmp_path):
        assert next_checkpoint_path(tmp_path, "iter_0001000") == os.path.join(str(tmp_path), "iter_0001000")

    def test_next_path_creates_nothing(self, tmp_path):
        next_checkpoint_path(tmp_path, 5)
        assert names(tmp_path) == set()

    @pytest.mark.parametrize("bad", [-1, "final", "../checkpoint-1", "checkpoint-1/x", True, 1.5, None])
    def test_next_path_rejects(self, tmp_path, bad):
        with pytest.raises(CheckpointManagementError) as info:
            next_checkpoint_path(tmp_path, bad)
        assert isinstance(info.value, ValueError) and isinstance(info.value, CheckpointingException)

    def test_name_error_lists_the_patterns(self, tmp_path):
        with pytest.raises(CheckpointManagementError, match=r"carries no step.*iter_"):
            next_checkpoint_path(tmp_path, "final")

    def test_saved_at_next_path_is_found(self, tmp_path):
        path = next_checkpoint_path(tmp_path, 42)
        make_dist(Path(path))
        assert find_latest_checkpoint(tmp_path) == path


# --------------------------------------------------------------------------- format and completeness


class TestCheckpointMetadata:
    def test_dist_ckpt(self, tmp_path):
        path = make_dist(tmp_path / "iter_0000100")
        meta = get_checkpoint_metadata(path)
        assert meta is not None
        assert meta.format is CheckpointFormat.DIST_CKPT and meta.format == "dist_ckpt"
        assert (meta.complete, meta.step, meta.file_name) == (True, 100, METADATA_FILENAME)
        assert (meta.backend, meta.backend_version) == (read_config(path).sharded_backend, 1)
        assert meta.config == read_config(path)
        assert validate_checkpoint(path) and validate_checkpoint(str(path))

    def test_hf_single_safetensors(self, tmp_path):
        meta = get_checkpoint_metadata(make_hf(tmp_path / "checkpoint-5"))
        assert meta == CheckpointMeta("model.safetensors", False, True, CheckpointFormat.HF, True, 5)
        assert meta.format == "hf"

    def test_hf_safetensors_index(self, tmp_path):
        path = make_hf_sharded(tmp_path / "checkpoint-5")
        meta = get_checkpoint_metadata(path)
        assert meta == CheckpointMeta("model.safetensors.index.json", True, True, CheckpointFormat.HF, True, 5)
        assert validate_checkpoint(path)

    def test_hf_bin(self, tmp_path):
        meta = get_checkpoint_metadata(make_hf_bin(tmp_path / "a"))
        assert meta == CheckpointMeta("pytorch_model.bin", False, False, CheckpointFormat.HF, True, None)

    def test_hf_bin_index(self, tmp_path):
        path = make_hf_bin(tmp_path / "a", sharded=True)
        meta = get_checkpoint_metadata(path)
        assert meta is not None and (meta.file_name, meta.is_index, meta.safetensors, meta.complete) == (
            "pytorch_model.bin.index.json",
            True,
            False,
            True,
        )
        truncate(path / "pytorch_model-00002-of-00002.bin", drop=30)
        assert not validate_checkpoint(path)

    def test_index_with_missing_shard_is_incomplete(self, tmp_path):
        path = make_hf_sharded(tmp_path / "checkpoint-5")
        (path / SHARDS[1]).unlink()
        meta = get_checkpoint_metadata(path)
        assert meta is not None and meta.is_index and meta.complete is False
        assert not validate_checkpoint(path)

    def test_index_with_truncated_shard_is_incomplete(self, tmp_path):
        path = make_hf_sharded(tmp_path / "checkpoint-5")
        truncate(path / SHARDS[0])
        assert not validate_checkpoint(path)

    @pytest.mark.parametrize(
        "index",
        [
            "{not json",
            "[]",
            json.dumps({"weight_map": {}}),
            json.dumps({"weight_map": {"a": "../outside.safetensors"}}),
            json.dumps({"weight_map": {"a": 3}}),
        ],
    )
    def test_bad_index_is_incomplete(self, tmp_path, index):
        path = make_hf_sharded(tmp_path / "checkpoint-5")
        (path / "model.safetensors.index.json").write_text(index)
        assert not validate_checkpoint(path)

    def test_truncated_single_file_is_incomplete(self, tmp_path):
        path = make_hf(tmp_path / "checkpoint-5")
        truncate(path / "model.safetensors")
        meta = get_checkpoint_metadata(path)
        assert meta is not None and meta.format is CheckpointFormat.HF and not meta.complete

    @pytest.mark.parametrize("content", [b"", b"\x05", b"\xff" * 8 + b"{}", b"\x02\x00\x00\x00\x00\x00\x00\x00[]"])
    def test_garbage_safetensors_is_incomplete(self, tmp_path, content):
        (tmp_path / "model.safetensors").write_bytes(content)
        assert not validate_checkpoint(tmp_path)

    def test_partial_dist_ckpt_is_no_checkpoint(self, tmp_path):
        path = make_partial_dist(tmp_path / "checkpoint-5")
        assert get_checkpoint_metadata(path) is None
        assert not validate_checkpoint(path)

    def test_partial_dist_ckpt_with_hf_files_is_not_hf_complete(self, tmp_path):
        path = make_partial_dist(tmp_path / "checkpoint-5")
        save_file({"a": torch.ones(2)}, str(path / "model.safetensors"))
        assert not validate_checkpoint(path)

    def test_corrupt_metadata_is_incomplete_dist_ckpt(self, tmp_path):
        path = make_dist(tmp_path / "checkpoint-5")
        (path / METADATA_FILENAME).write_text("{truncated")
        meta = get_checkpoint_metadata(path)
        assert meta is not None and meta.format is CheckpointFormat.DIST_CKPT
        assert (meta.complete, meta.config, meta.backend) == (False, None, None)
        save_file({"a": torch.ones(2)}, str(path / "model.safetensors"))  # HF files do not rescue it
        assert not validate_checkpoint(path)

    def test_dist_ckpt_wins_over_hf_files(self, tmp_path):
        path = make_dist(tmp_path / "checkpoint-5")
        save_file({"a": torch.ones(2)}, str(path / "model.safetensors"))
        assert get_checkpoint_metadata(path).format is CheckpointFormat.DIST_CKPT  # type: ignore[union-attr]

    def test_non_checkpoints(self, tmp_path):
        (tmp_path / "empty").mkdir()
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "config.json").write_text("{}")
        (tmp_path / "file").write_text("x")
        for p in ("empty", "other", "file", "missing"):
            assert get_checkpoint_metadata(tmp_path / p) is None
            assert validate_checkpoint(tmp_path / p) is False

    def test_frozen(self, tmp_path):
        meta = get_checkpoint_metadata(make_hf(tmp_path / "checkpoint-1"))
        with pytest.raises(dataclasses.FrozenInstanceError):
            meta.complete = False  # type: ignore[misc,union-attr]


# --------------------------------------------------------------------------- latest


class TestFindLatest:
    def test_empty_and_missing(self, tmp_path):
        assert find_latest_checkpoint(tmp_path) is None
        assert find_latest_checkpoint(tmp_path / "missing") is None

    def test_by_step_not_by_name_order_or_mtime(self, tmp_path):
        make_dist(tmp_path / "checkpoint-1000")
        make_dist(tmp_path / "checkpoint-900")  # sorts after "checkpoint-1000" as a string
        age(tmp_path / "checkpoint-1000", 3600)  # and is older on disk
        age(tmp_path / "checkpoint-900", 0)
        assert find_latest_checkpoint(tmp_path) == os.path.join(str(tmp_path), "checkpoint-1000")

    def test_ignores_partial_and_corrupt(self, tmp_path):
        make_dist(tmp_path / "checkpoint-100")
        make_partial_dist(tmp_path / "checkpoint-300")
        make_dist(tmp_path / "checkpoint-200")
        (tmp_path / "checkpoint-200" / METADATA_FILENAME).write_text('{"sharded_backend": 7}')
        make_hf_sharded(tmp_path / "checkpoint-400")
        (tmp_path / "checkpoint-400" / SHARDS[0]).unlink()
        for n in ("checkpoint-200", "checkpoint-300", "checkpoint-400"):
            age(tmp_path / n, 0)
        age(tmp_path / "checkpoint-100", 3600)
        assert find_latest_checkpoint(tmp_path) == os.path.join(str(tmp_path), "checkpoint-100")

    def test_only_partial(self, tmp_path):
        make_partial_dist(tmp_path / "checkpoint-100")
        assert find_latest_checkpoint(tmp_path) is None

    def test_mixed_names_and_formats(self, tmp_path):
        make_dist(tmp_path / "iter_0000500")
        make_hf(tmp_path / "checkpoint-700")
        make_dist(tmp_path / "global_step600")
        assert find_latest_checkpoint(tmp_path) == os.path.join(str(tmp_path), "checkpoint-700")

    def test_tie_goes_to_the_greater_name(self, tmp_path):
        make_dist(tmp_path / "iter_0001000")
        make_dist(tmp_path / "checkpoint-1000")
        assert find_latest_checkpoint(tmp_path) == os.path.join(str(tmp_path), "iter_0001000")

    def test_ignores_unmanaged_names_and_files(self, tmp_path):
        make_dist(tmp_path / "checkpoint-1")
        make_dist(tmp_path / "final")
        make_hf(tmp_path / ".hidden-checkpoint-9")
        (tmp_path / "checkpoint-99").write_text("a file, not a directory")
        assert find_latest_checkpoint(tmp_path) == os.path.join(str(tmp_path), "checkpoint-1")


class TestListCheckpoints:
    def test_empty_and_missing(self, tmp_path):
        assert list_checkpoints(tmp_path) == []
        assert list_checkpoints(tmp_path / "missing") == []

    def test_complete_ones_oldest_first_with_step_format_and_metrics(self, tmp_path):
        make_dist(tmp_path / "checkpoint-1000")
        make_dist(tmp_path / "checkpoint-900")  # sorts after "checkpoint-1000" as a string
        make_hf(tmp_path / "iter_0000950")
        make_partial_dist(tmp_path / "checkpoint-1100")  # a crashed save: not listed
        make_dist(tmp_path / "final")  # no step in the name: not managed
        save_checkpoint_metrics(tmp_path / "checkpoint-900", {"eval_loss": 2.5})
        save_checkpoint_metrics(tmp_path / "checkpoint-1000", {"eval_loss": 2.25, "acc": 0.5})
        found = list_checkpoints(tmp_path)
        assert [(c.step, c.name, c.format, c.metrics) for c in found] == [
            (900, "checkpoint-900", CheckpointFormat.DIST_CKPT, {"eval_loss": 2.5}),
            (950, "iter_0000950", CheckpointFormat.HF, None),
            (1000, "checkpoint-1000", CheckpointFormat.DIST_CKPT, {"eval_loss": 2.25, "acc": 0.5}),
        ]
        # paths as find_latest_checkpoint returns them, so the newest listed one is the latest
        assert [c.path for c in found] == [os.path.join(str(tmp_path), c.name) for c in found]
        assert found[-1].path == find_latest_checkpoint(tmp_path)

    def test_a_restarted_run_finds_its_best_and_rotation_keeps_it(self, tmp_path):
        """The README loop's recipe across a restart: the best is read back, not forgotten."""

        def save(step, eval_loss, best):
            path = next_checkpoint_path(tmp_path, step)
            make_dist(Path(path))
            save_checkpoint_metrics(path, {"eval_loss": eval_loss})
            maybe_delete_oldest_checkpoint(tmp_path, max_checkpoints=2, best_checkpoint=best)

        save(10, 0.9, None)
        save(20, 0.4, next_checkpoint_path(tmp_path, 20))  # the best
        # a new job: what it knows of the run is on disk
        best = min(list_checkpoints(tmp_path), key=lambda c: (c.metrics or {}).get("eval_loss", float("inf")))
        assert best.step == 20
        save(30, 0.6, best.path)
        save(40, 0.5, best.path)
        assert managed(tmp_path) == {"checkpoint-20", "checkpoint-40"}

    def test_a_corrupt_metrics_file_names_its_path(self, tmp_path):
        make_dist(tmp_path / "checkpoint-1")
        (tmp_path / "checkpoint-1" / C.METRICS_FILENAME).write_text("{trunc")
        with pytest.raises(CorruptCheckpointError, match="checkpoint-1"):
            list_checkpoints(tmp_path)

    def test_reexported_on_the_megatron_path(self):
        from dist_ckpt import checkpoints

        assert checkpoints.list_checkpoints is list_checkpoints
        assert checkpoints.RunCheckpoint is C.RunCheckpoint


# --------------------------------------------------------------------------- rotation


def managed(model_dir: Path) -> set:
    return {n for n in names(model_dir) if parse_checkpoint_step(n) is not None}


class TestRotation:
    def test_keeps_the_newest_by_step(self, tmp_path):
        for i, step in enumerate((100, 200, 300, 400, 500)):
            make_dist(tmp_path / f"checkpoint-{step}")
            age(tmp_path / f"checkpoint-{step}", i * 100)  # newer steps look older on disk
        maybe_delete_oldest_checkpoint(tmp_path, 2)
        assert managed(tmp_path) == {"checkpoint-400", "checkpoint-500"}

    def test_under_the_limit_deletes_nothing(self, tmp_path):
        make_dist(tmp_path / "checkpoint-1")
        make_hf(tmp_path / "checkpoint-2")
        maybe_delete_oldest_checkpoint(tmp_path, 2)
        assert managed(tmp_path) == {"checkpoint-1", "checkpoint-2"}

    def test_keeps_best_and_preserved(self, tmp_path):
        for step in (100, 200, 300, 400, 500):
            make_dist(tmp_path / f"checkpoint-{step}")
        maybe_delete_oldest_checkpoint(
            tmp_path, 2, best_checkpoint=str(tmp_path / "checkpoint-100"), preserved_checkpoints=["checkpoint-200"]
        )
        # kept ones count towards the limit: only non-kept old ones go
        assert managed(tmp_path) == {"checkpoint-100", "checkpoint-200", "checkpoint-500"}

    def test_preserved_as_a_single_string(self, tmp_path):
        for step in (1, 2, 3):
            make_dist(tmp_path / f"checkpoint-{step}")
        maybe_delete_oldest_checkpoint(tmp_path, 1, preserved_checkpoints=str(tmp_path / "checkpoint-1"))
        assert managed(tmp_path) == {"checkpoint-1", "checkpoint-3"}

    def test_never_deletes_the_newest_complete(self, tmp_path):
        make_dist(tmp_path / "checkpoint-100")
        make_dist(tmp_path / "checkpoint-200")
        maybe_delete_oldest_checkpoint(tmp_path, 1, best_checkpoint="checkpoint-100")
        assert managed(tmp_path) == {"checkpoint-100", "checkpoint-200"}

    def test_only_complete_one_survives_newer_partials(self, tmp_path):
        make_dist(tmp_path / "checkpoint-100")
        make_partial_dist(tmp_path / "checkpoint-200")
        make_partial_dist(tmp_path / "checkpoint-300")
        maybe_delete_oldest_checkpoint(tmp_path, 1)
        assert managed(tmp_path) == {"checkpoint-100", "checkpoint-200", "checkpoint-300"}
        assert find_latest_checkpoint(tmp_path) == os.path.join(str(tmp_path), "checkpoint-100")

    def test_removes_older_partials_keeps_newer(self, tmp_path):
        make_partial_dist(tmp_path / "checkpoint-50")
        make_dist(tmp_path / "checkpoint-100")
        make_partial_dist(tmp_path / "checkpoint-150")
        make_dist(tmp_path / "checkpoint-200")
        make_partial_dist(tmp_path / "checkpoint-300")  # may be a save in progress
        maybe_delete_oldest_checkpoint(tmp_path, 5)
        assert managed(tmp_path) == {"checkpoint-100", "checkpoint-200", "checkpoint-300"}

    def test_delete_partial_false_keeps_partials(self, tmp_path):
        make_partial_dist(tmp_path / "checkpoint-50")
        make_dist(tmp_path / "checkpoint-100")
        maybe_delete_oldest_checkpoint(tmp_path, 5, delete_partial=False)
        assert managed(tmp_path) == {"checkpoint-50", "checkpoint-100"}

    def test_no_complete_checkpoint_deletes_nothing(self, tmp_path):
        make_partial_dist(tmp_path / "checkpoint-1")
        make_partial_dist(tmp_path / "checkpoint-2")
        maybe_delete_oldest_checkpoint(tmp_path, 1)
        assert managed(tmp_path) == {"checkpoint-1", "checkpoint-2"}

    def test_leaves_unmanaged_entries_alone(self, tmp_path):
        make_dist(tmp_path / "final")
        (tmp_path / "runs").mkdir()
        (tmp_path / "config.json").write_text("{}")
        for step in (1, 2, 3):
            make_dist(tmp_path / f"checkpoint-{step}")
        maybe_delete_oldest_checkpoint(tmp_path, 1)
        assert names(tmp_path) == {"final", "runs", "config.json", "checkpoint-3"}

    def test_keeps_checkpoints_that_links_point_into(self, tmp_path):
        make_hf(tmp_path / "checkpoint-100")
        create_pretrained_symlinks(tmp_path)
        make_dist(tmp_path / "checkpoint-200")
        make_dist(tmp_path / "checkpoint-300")
        make_dist(tmp_path / "checkpoint-400")
        os.symlink("checkpoint-300", tmp_path / "latest")
        maybe_delete_oldest_checkpoint(tmp_path, 1)
        assert managed(tmp_path) == {"checkpoint-100", "checkpoint-300", "checkpoint-400"}
        assert load_file(str(tmp_path / "model.safetensors"))["a"].tolist() == [1.0, 1.0, 1.0]

    def test_symlinked_checkpoint_dirs_are_not_touched(self, tmp_path):
        elsewhere = make_dist(tmp_path / "elsewhere" / "ckpt")
        run = tmp_path / "run"
        run.mkdir()
        os.symlink(elsewhere, run / "checkpoint-1")
        make_dist(run / "checkpoint-2")
        make_dist(run / "checkpoint-3")
        maybe_delete_oldest_checkpoint(run, 1)
        assert managed(run) == {"checkpoint-1", "checkpoint-3"}
        assert validate_checkpoint(elsewhere)

    @pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2", None])
    def test_rejects_bad_max(self, tmp_path, bad):
        make_dist(tmp_path / "checkpoint-1")
        with pytest.raises(CheckpointManagementError, match="max_checkpoints"):
            maybe_delete_oldest_checkpoint(tmp_path, bad)
        assert managed(tmp_path) == {"checkpoint-1"}

    def test_missing_model_dir(self, tmp_path):
        maybe_delete_oldest_checkpoint(tmp_path / "missing", 1)
        assert not (tmp_path / "missing").exists()

    def test_hf_checkpoints_rotate_too(self, tmp_path):
        make_hf(tmp_path / "checkpoint-1")
        make_hf_sharded(tmp_path / "checkpoint-2")
        make_hf_bin(tmp_path / "checkpoint-3")
        maybe_delete_oldest_checkpoint(tmp_path, 2)
        assert managed(tmp_path) == {"checkpoint-2", "checkpoint-3"}


class TestCrashDuringDelete:
    def _setup(self, tmp_path):
        for step in (100, 200, 300):
            make_dist(tmp_path / f"checkpoint-{step}")

    def _complete_names(self, tmp_path):
        return {n for n in names(tmp_path) if validate_checkpoint(tmp_path / n)}

    def test_crash_while_removing_files(self, tmp_path, monkeypatch):
        self._setup(tmp_path)

        def crash(path, *args, **kwargs):
            raise OSError("simulated crash in rmtree")

        monkeypatch.setattr(rotation.shutil, "rmtree", crash)
        with pytest.raises(OSError, match="simulated crash"):
            maybe_delete_oldest_checkpoint(tmp_path, 1)
        # the victim is no longer under a checkpoint name, and nothing left is complete but real ones
        assert "checkpoint-100" not in names(tmp_path)
        assert self._complete_names(tmp_path) <= {"checkpoint-200", "checkpoint-300"}
        trash = [n for n in names(tmp_path) if n.startswith(".dist_ckpt-trash-")]
        assert len(trash) == 1 and not validate_checkpoint(tmp_path / trash[0])
        assert find_latest_checkpoint(tmp_path) == os.path.join(str(tmp_path), "checkpoint-300")

        monkeypatch.undo()
        maybe_delete_oldest_checkpoint(tmp_path, 1)  # the next rotation clears the trash
        assert names(tmp_path) == {"checkpoint-300"}

    def test_crash_right_after_the_rename(self, tmp_path, monkeypatch):
        self._setup(tmp_path)

        def crash(path):
            raise OSError("simulated crash before fsync")

        monkeypatch.setattr(rotation, "fsync_dir", crash)
        with pytest.raises(OSError, match="simulated crash"):
            maybe_delete_oldest_checkpoint(tmp_path, 1)
        assert managed(tmp_path) == {"checkpoint-200", "checkpoint-300"}
        assert find_latest_checkpoint(tmp_path) == os.path.join(str(tmp_path), "checkpoint-300")

    def test_failed_rename_leaves_the_checkpoint_whole(self, tmp_path, monkeypatch):
        self._setup(tmp_path)

        def fail(src, dst):
            raise OSError("simulated rename failure")

        monkeypatch.setattr(rotation.os, "rename", fail)
        with pytest.raises(OSError):
            maybe_delete_oldest_checkpoint(tmp_path, 1)
        monkeypatch.undo()
        assert self._complete_names(tmp_path) == {"checkpoint-100", "checkpoint-200", "checkpoint-300"}
        assert dc.load_plain_tensors(tmp_path / "checkpoint-100")["w"].tolist() == [1.0] * 4


# --------------------------------------------------------------------------- metrics


class TestMetrics:
    def test_round_trip(self, tmp_path):
        path = make_dist(tmp_path / "checkpoint-1")
        save_checkpoint_metrics(path, {"eval_loss": 2.25, "accuracy": 0.5, "tokens": 1000, "np": np.float32(0.25)})
        assert load_checkpoint_metrics(path) == {"eval_loss": 2.25, "accuracy": 0.5, "tokens": 1000.0, "np": 0.25}
        assert json.loads((path / C.METRICS_FILENAME).read_text())["eval_loss"] == 2.25
        assert validate_checkpoint(path)  # the metrics file does not disturb the checkpoint

    def test_overwrite_leaves_no_temporary_files(self, tmp_path):
        save_checkpoint_metrics(tmp_path, {"a": 1.0})
        save_checkpoint_metrics(tmp_path, {"b": 2.0})
        assert load_checkpoint_metrics(tmp_path) == {"b": 2.0}
        assert names(tmp_path) == {C.METRICS_FILENAME}

    def test_none_when_absent(self, tmp_path):
        assert load_checkpoint_metrics(tmp_path) is None
        assert load_checkpoint_metrics(tmp_path / "missing") is None

    @pytest.mark.parametrize(
        "metrics, match",
        [
            ({"loss": float("nan")}, "'loss' must be finite"),
            ({"loss": float("inf")}, "'loss' must be finite"),
            ({"loss": -float("inf")}, "'loss' must be finite"),
            ({"loss": "1.0"}, "'loss' must be a number, found str"),
            ({"loss": None}, "'loss' must be a number"),
            ({"flag": True}, "'flag' must be a number, found bool"),
            ({"loss": torch.tensor(1.0)}, r"\.item\(\)"),
            ({"loss": [1.0]}, "must be a number"),
            ({1: 1.0}, "names must be strings"),
            ([("loss", 1.0)], "must be a dict"),
        ],
    )
    def test_rejects_bad_values(self, tmp_path, metrics, match):
        with pytest.raises(CheckpointManagementError, match=match) as info:
            save_checkpoint_metrics(tmp_path, metrics)
        assert isinstance(info.value, ValueError)
        assert not (tmp_path / C.METRICS_FILENAME).exists()

    def test_bad_values_keep_the_previous_file(self, tmp_path):
        save_checkpoint_metrics(tmp_path, {"loss": 1.0})
        with pytest.raises(CheckpointManagementError):
            save_checkpoint_metrics(tmp_path, {"loss": 1.0, "acc": float("nan")})
        assert load_checkpoint_metrics(tmp_path) == {"loss": 1.0}

    def test_missing_directory(self, tmp_path):
        with pytest.raises(NotACheckpointError) as info:
            save_checkpoint_metrics(tmp_path / "missing", {"a": 1.0})
        assert isinstance(info.value, FileNotFoundError)
        assert not (tmp_path / "missing").exists()

    @pytest.mark.parametrize(
        "content",
        ["{trunc", '{"loss": NaN}', '{"loss": Infinity}', "[1, 2]", '{"loss": "x"}', '{"loss": true}', "\udcff"],
    )
    def test_corrupt_file(self, tmp_path, content):
        file = tmp_path / C.METRICS_FILENAME
        file.write_bytes(content.encode("utf-8", "surrogateescape"))
        with pytest.raises(CorruptCheckpointError) as info:
            load_checkpoint_metrics(tmp_path)
        assert str(file) in str(info.value)


# --------------------------------------------------------------------------- HF symlinks


class TestPretrainedSymlinks:
    def test_single_file(self, tmp_path):
        make_hf(tmp_path / "checkpoint-100", value=1.0)
        make_hf(tmp_path / "checkpoint-200", value=2.0)
        links = create_pretrained_symlinks(tmp_path)
        assert links == [str(tmp_path / "model.safetensors")]
        assert os.readlink(tmp_path / "model.safetensors") == os.path.join("checkpoint-200", "model.safetensors")
        assert load_file(str(tmp_path / "model.safetensors"))["a"].tolist() == [2.0] * 3

    def test_sharded(self, tmp_path):
        make_hf_sharded(tmp_path / "checkpoint-100")
        links = create_pretrained_symlinks(str(tmp_path))
        expected = ["model.safetensors.index.json", *SHARDS]
        assert links == [str(tmp_path / n) for n in expected]
        for n in expected:
            assert (tmp_path / n).is_symlink()
            assert (tmp_path / n).resolve() == (tmp_path / "checkpoint-100" / n).resolve()
        assert validate_checkpoint(tmp_path)  # model_dir now reads as an HF checkpoint

    def test_follows_the_latest_complete(self, tmp_path):
        make_hf(tmp_path / "checkpoint-100", value=1.0)
        create_pretrained_symlinks(tmp_path)
        make_hf(tmp_path / "checkpoint-200", value=2.0)
        make_hf(tmp_path / "checkpoint-300", value=3.0)
        truncate(tmp_path / "checkpoint-300" / "model.safetensors")  # not complete: not linked
        create_pretrained_symlinks(tmp_path)
        assert load_file(str(tmp_path / "model.safetensors"))["a"].tolist() == [2.0] * 3

    def test_stale_links_are_removed(self, tmp_path):
        make_hf_sharded(tmp_path / "checkpoint-100")
        create_pretrained_symlinks(tmp_path)
        os.symlink("/somewhere/else.bin", tmp_path / "pytorch_model.bin")  # not ours: kept
        make_hf(tmp_path / "checkpoint-200")
        create_pretrained_symlinks(tmp_path)
        assert names(tmp_path) == {"checkpoint-100", "checkpoint-200", "model.safetensors", "pytorch_model.bin"}

    def test_dry_run_changes_nothing(self, tmp_path):
        make_hf_sharded(tmp_path / "checkpoint-100")
        before = names(tmp_path)
        links = create_pretrained_symlinks(tmp_path, dry_run=True)
        assert links == [str(tmp_path / n) for n in ("model.safetensors.index.json", *SHARDS)]
        assert names(tmp_path) == before

    def test_dry_run_keeps_stale_links(self, tmp_path):
        make_hf_sharded(tmp_path / "checkpoint-100")
        create_pretrained_symlinks(tmp_path)
        make_hf(tmp_path / "checkpoint-200")
        before = {n: os.readlink(tmp_path / n) for n in names(tmp_path) if (tmp_path / n).is_symlink()}
        create_pretrained_symlinks(tmp_path, dry_run=True)
        assert {n: os.readlink(tmp_path / n) for n in names(tmp_path) if (tmp_path / n).is_symlink()} == before

    def test_regular_file_in_the_way(self, tmp_path):
        make_hf_sharded(tmp_path / "checkpoint-100")
        (tmp_path / SHARDS[1]).write_text("user data")
        for dry_run in (False, True):
            with pytest.raises(SymlinkConflictError, match="force_overwrite=True") as info:
                create_pretrained_symlinks(tmp_path, dry_run=dry_run)
            assert isinstance(info.value, FileExistsError) and SHARDS[1] in str(info.value)
        # checked before anything changed: no link was made
        assert not any((tmp_path / n).is_symlink() for n in names(tmp_path))
        assert (tmp_path / SHARDS[1]).read_text() == "user data"

        create_pretrained_symlinks(tmp_path, force_overwrite=True)
        assert (tmp_path / SHARDS[1]).is_symlink()
        assert load_file(str(tmp_path / SHARDS[1]))["b"].tolist() == [0.0] * 3

    def test_force_dry_run_keeps_the_file(self, tmp_path):
        make_hf(tmp_path / "checkpoint-100")
        (tmp_path / "model.safetensors").write_text("user data")
        create_pretrained_symlinks(tmp_path, force_overwrite=True, dry_run=True)
        assert (tmp_path / "model.safetensors").read_text() == "user data"

    def test_directory_in_the_way(self, tmp_path):
        make_hf(tmp_path / "checkpoint-100")
        (tmp_path / "model.safetensors").mkdir()
        with pytest.raises(SymlinkConflictError, match="a directory"):
            create_pretrained_symlinks(tmp_path, force_overwrite=True)
        assert (tmp_path / "model.safetensors").is_dir()

    def test_dist_ckpt_latest_is_an_error(self, tmp_path):
        make_hf(tmp_path / "checkpoint-100")
        make_dist(tmp_path / "checkpoint-200")
        with pytest.raises(CheckpointManagementError, match="dist_ckpt checkpoint"):
            create_pretrained_symlinks(tmp_path)
        assert not (tmp_path / "model.safetensors").exists()

    def test_no_complete_checkpoint(self, tmp_path):
        make_partial_dist(tmp_path / "checkpoint-100")
        with pytest.raises(NotACheckpointError) as info:
            create_pretrained_symlinks(tmp_path)
        assert isinstance(info.value, FileNotFoundError)


class TestModule:
    def test_public_functions_are_documented_with_a_fenced_example(self):
        for name in C.__all__:
            obj = getattr(C, name)
            if callable(obj) and not isinstance(obj, type):
                assert obj.__doc__ and "Example:\n" in obj.__doc__ and "```python" in obj.__doc__, name
