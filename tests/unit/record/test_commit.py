"""Unit tests of dist_ckpt.record.commit: CheckpointingConfig and the metadata.json commit record."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

import dist_ckpt
from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError, NotACheckpointError
from dist_ckpt.record.commit import (
    DCP_CONFIG,
    METADATA_FILENAME,
    RECORD_FILENAME,
    CheckpointingConfig,
    check_is_distributed_checkpoint,
    detect_config,
    is_plain_dcp_directory,
    maybe_load_config,
    read_config,
    read_save_record,
    save_config,
)


class TestConfig:
    def test_defaults(self):
        c = CheckpointingConfig("zarr")
        assert (c.sharded_backend, c.sharded_backend_version, c.common_backend, c.common_backend_version) == (
            "zarr",
            1,
            "torch",
            1,
        )

    def test_frozen(self):
        with pytest.raises(dataclasses.FrozenInstanceError):
            CheckpointingConfig("zarr").sharded_backend = "x"  # type: ignore[misc]

    def test_exported(self):
        assert dist_ckpt.CheckpointingConfig is CheckpointingConfig
        assert dist_ckpt.record.commit.CheckpointingException is CheckpointingException


class TestSaveAndRead:
    def test_round_trip(self, tmp_path):
        config = CheckpointingConfig("mybackend", 3, "torch", 2)
        save_config(config, tmp_path, world_size=8)
        assert maybe_load_config(tmp_path) == config
        assert read_config(str(tmp_path)) == config
        record = json.loads((tmp_path / METADATA_FILENAME).read_text())
        assert record["sharded_backend"] == "mybackend"
        assert record["sharded_backend_version"] == 3
        assert record["common_backend"] == "torch"
        assert record["common_backend_version"] == 2
        assert record["dist_ckpt"]["world_size"] == 8
        assert record["dist_ckpt"]["format_version"] == dist_ckpt.record.commit.FORMAT_VERSION
        assert record["integrity_records"] == {}  # the save wrote none: a record file found later is refused
        assert os.listdir(tmp_path) == [METADATA_FILENAME]  # no temporary left behind

    def test_without_world_size(self, tmp_path):
        save_config(CheckpointingConfig("zarr"), tmp_path)
        assert "world_size" not in json.loads((tmp_path / METADATA_FILENAME).read_text())["dist_ckpt"]

    def test_optional_fields_default(self, tmp_path):
        (tmp_path / METADATA_FILENAME).write_text(json.dumps({"sharded_backend": "zarr"}))
        assert maybe_load_config(tmp_path) == CheckpointingConfig("zarr")

    def test_unknown_fields_ignored(self, tmp_path):
        (tmp_path / METADATA_FILENAME).write_text(json.dumps({"sharded_backend": "zarr", "future": [1]}))
        assert maybe_load_config(tmp_path) == CheckpointingConfig("zarr")

    def test_missing_file(self, tmp_path):
        assert maybe_load_config(tmp_path) is None
        assert check_is_distributed_checkpoint(tmp_path) is False
        with pytest.raises(NotACheckpointError, match="metadata.json is missing"):
            read_config(tmp_path)

    def test_missing_directory(self, tmp_path):
        missing = tmp_path / "nope"
        assert maybe_load_config(missing) is None
        assert check_is_distributed_checkpoint(missing) is False
        with pytest.raises(NotACheckpointError, match="does not exist") as info:
            read_config(missing)
        assert isinstance(info.value, FileNotFoundError)
        # Megatron-Core's words, path unquoted: callers match on f"directory {path} does not exist"
        assert f"directory {missing} does not exist" in str(info.value)

    def test_valid_is_checkpoint(self, tmp_path):
        save_config(CheckpointingConfig("zarr"), tmp_path)
        assert check_is_distributed_checkpoint(tmp_path) is True

    def test_megatron_backend_gets_megatron_metadata_json(self, tmp_path):
        """Megatron-Core reads metadata.json with CheckpointingConfig(**json): for torch_dist it holds
        exactly Megatron's keys, in Megatron's order, and dist_ckpt's record goes beside it."""
        save_config(CheckpointingConfig("torch_dist"), tmp_path, world_size=4, save_id="abc")
        raw = (tmp_path / METADATA_FILENAME).read_text()
        assert raw == json.dumps(dataclasses.asdict(CheckpointingConfig("torch_dist")))
        assert read_save_record(tmp_path) == {
            "format_version": dist_ckpt.record.commit.FORMAT_VERSION,
            "library_version": dist_ckpt.record.commit.LIBRARY_VERSION,
            "world_size": 4,
            "save_id": "abc",
        }
        assert sorted(os.listdir(tmp_path)) == [RECORD_FILENAME, METADATA_FILENAME]
        assert maybe_load_config(tmp_path) == CheckpointingConfig("torch_dist")

    def test_save_record_of_other_backends_is_in_metadata_json(self, tmp_path):
        save_config(CheckpointingConfig("zarr"), tmp_path, world_size=2)
        assert read_save_record(tmp_path)["world_size"] == 2 and not (tmp_path / RECORD_FILENAME).exists()
        assert read_save_record(tmp_path / "nowhere") == {}


class TestDetect:
    def test_plain_dcp_directory(self, tmp_path):
        (tmp_path / ".metadata").write_bytes(b"")
        (tmp_path / "__0_0.distcp").write_bytes(b"")
        assert is_plain_dcp_directory(tmp_path) and detect_config(tmp_path) == DCP_CONFIG
        assert check_is_distributed_checkpoint(tmp_path) is False

    def test_an_uncommitted_torch_dist_save_is_not_plain_dcp(self, tmp_path):
        (tmp_path / ".metadata").write_bytes(b"")
        (tmp_path / "common.pt").write_bytes(b"")
        assert not is_plain_dcp_directory(tmp_path)
        with pytest.raises(NotACheckpointError, match="metadata.json is missing"):
            detect_config(tmp_path)

    def test_metadata_json_wins(self, tmp_path):
        (tmp_path / ".metadata").write_bytes(b"")
        save_config(CheckpointingConfig("torch_dist"), tmp_path)
        assert detect_config(tmp_path) == CheckpointingConfig("torch_dist")


class TestCorrupt:
    @pytest.mark.parametrize("payload", [b"\x00\xff\x13garbage\x80", b"{not json", b"", '{"a": 1'.encode()])
    def test_not_json(self, tmp_path, payload):
        path = tmp_path / METADATA_FILENAME
        path.write_bytes(payload)
        with pytest.raises(CorruptCheckpointError) as info:
            maybe_load_config(tmp_path)
        assert str(path) in str(info.value)
        assert check_is_distributed_checkpoint(tmp_path) is False

    @pytest.mark.parametrize("payload", ["[1, 2]", '"zarr"', "5", "null"])
    def test_not_an_object(self, tmp_path, payload):
        (tmp_path / METADATA_FILENAME).write_text(payload)
        with pytest.raises(CorruptCheckpointError, match="JSON object") as info:
            read_config(tmp_path)
        assert METADATA_FILENAME in str(info.value)

    def test_missing_backend(self, tmp_path):
        (tmp_path / METADATA_FILENAME).write_text(json.dumps({"sharded_backend_version": 1}))
        with pytest.raises(CorruptCheckpointError, match="'sharded_backend'") as info:
            read_config(tmp_path)
        assert METADATA_FILENAME in str(info.value)

    @pytest.mark.parametrize(
        "field, value",
        [
            ("sharded_backend", 5),
            ("sharded_backend", None),
            ("sharded_backend_version", "1"),
            ("sharded_backend_version", True),
            ("sharded_backend_version", 1.0),
            ("common_backend", ["torch"]),
            ("common_backend_version", {"v": 1}),
        ],
    )
    def test_wrong_types(self, tmp_path, field, value):
        record = {
            "sharded_backend": "zarr",
            "sharded_backend_version": 1,
            "common_backend": "torch",
            "common_backend_version": 1,
        }
        record[field] = value
        path = tmp_path / METADATA_FILENAME
        path.write_text(json.dumps(record))
        with pytest.raises(CorruptCheckpointError, match=repr(field)) as info:
            maybe_load_config(tmp_path)
        assert str(path) in str(info.value)
        assert check_is_distributed_checkpoint(tmp_path) is False
