"""Unit tests of dist_ckpt.backends.torch_common.strategy (the ``torch`` common-state backend)."""

from __future__ import annotations

import argparse
import collections
import datetime
import decimal
import enum
import fractions
import io
import json
import logging
import os
import pathlib
import pickle
import random
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_ckpt.backends.torch_common.strategy import (
    COMMON_STATE_FNAME,
    OBJECTS_DIR,
    UNSAFE_KEYS_FNAME,
    TorchCommonLoadStrategy,
    TorchCommonSaveStrategy,
    find_unsafe_values,
)
from dist_ckpt.errors import CorruptCheckpointError, KeyMismatchError, UnsafeObjectError
from dist_ckpt.model.sharded import ShardedObject


class Custom:
    """A user class: needs full pickle to load."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Custom) and other.value == self.value


SAFE_STATE = {
    "step": 10,
    "lr": 0.5,
    "name": "run",
    "flags": [True, None, b"raw"],
    "t": torch.arange(3),
    "nested": {
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "size": torch.Size([2, 3]),
        "tuple": (1, 2.0, "x"),
        "c": 1 + 2j,
    },
    "od": collections.OrderedDict(a=1),
}


class TestFindUnsafe:
    def test_safe(self):
        assert find_unsafe_values(SAFE_STATE) == {}

    def test_unsafe_paths(self):
        state = {"a": np.arange(3), "b": [1, {"c": Custom(1)}], "d": torch.zeros(1), "e": {1, 2}}
        found = find_unsafe_values(state)
        assert set(found) >= {"a", "b/1/c"}
        assert "d" not in found
        assert found["b/1/c"].endswith("Custom")
        assert "ndarray" in found["a"]

    def test_root(self):
        assert set(find_unsafe_values(Custom(1))) == {"<root>"}


class TestCommonState:
    def test_round_trip(self, tmp_path):
        TorchCommonSaveStrategy().save_common(SAFE_STATE, tmp_path)
        assert sorted(os.listdir(tmp_path)) == ["common.checksums.json", COMMON_STATE_FNAME]
        loaded = TorchCommonLoadStrategy().load_common(tmp_path)
        assert loaded.keys() == SAFE_STATE.keys()
        assert torch.equal(loaded["t"], SAFE_STATE["t"])
        for k in ("step", "lr", "name", "flags", "nested", "od"):
            assert loaded[k] == SAFE_STATE[k]

    def test_unsafe_needs_opt_in(self, tmp_path, caplog):
        state = {"ok": 1, "arr": np.arange(4), "deep": {"obj": Custom(3)}}
        with caplog.at_level(logging.WARNING, logger="dist_ckpt"):
            TorchCommonSaveStrategy().save_common(state, tmp_path)
        assert "'arr'" in caplog.text and "allow_pickle" in caplog.text
        assert set(json.loads((tmp_path / UNSAFE_KEYS_FNAME).read_text())) == {"arr", "deep/obj"}
        with pytest.raises(UnsafeObjectError) as info:
            TorchCommonLoadStrategy().load_common(tmp_path)
        msg = str(info.value)
        assert "'arr'" in msg and "'deep/obj'" in msg and "allow_pickle=True" in msg
        assert str(tmp_path / COMMON_STATE_FNAME) in msg
        loaded = TorchCommonLoadStrategy(allow_pickle=True).load_common(tmp_path)
        np.testing.assert_array_equal(loaded["arr"], np.arange(4))
        assert loaded["deep"]["obj"] == Custom(3) and loaded["ok"] == 1

    def test_missing_file(self, tmp_path):
        with pytest.raises(CorruptCheckpointError, match="missing") as info:
            TorchCommonLoadStrategy().load_common(tmp_path)
        assert COMMON_STATE_FNAME in str(info.value)

    @pytest.mark.parametrize("damage", ["truncate", "garbage-2", "garbage-20", "garbage-77", "empty"])
    def test_corrupt_file(self, tmp_path, damage):
        """Seeded garbage: seeds 2 and 20 make torch.load raise IndexError and KeyError."""
        TorchCommonSaveStrategy().save_common(SAFE_STATE, tmp_path)
        path = tmp_path / COMMON_STATE_FNAME
        data = path.read_bytes()
        if damage.startswith("garbage"):
            data = random.Random(int(damage.split("-")[1])).randbytes(256)
        else:
            data = {"truncate": data[: len(data) // 2], "empty": b""}[damage]
        path.write_bytes(data)
        with pytest.raises(CorruptCheckpointError) as info:
            TorchCommonLoadStrategy().load_common(tmp_path)
        assert str(path) in str(info.value)

    def test_not_a_dict(self, tmp_path):
        torch.save([1, 2], tmp_path / COMMON_STATE_FNAME)
        with pytest.raises(CorruptCheckpointError, match="list"):
            TorchCommonLoadStrategy().load_common(tmp_path)

    def test_version_info(self):
        s = TorchCommonSaveStrategy()
        assert (s.backend, s.version) == ("torch", 1)
        assert s.can_handle_sharded_objects and TorchCommonLoadStrategy().can_handle_sharded_objects
        assert TorchCommonLoadStrategy.supported_backends == ("torch",)
        assert TorchCommonLoadStrategy.supported_versions == (1,)
        assert set(s.owned_paths) == {COMMON_STATE_FNAME, UNSAFE_KEYS_FNAME, "common.checksums.json", OBJECTS_DIR}


class TestShardedObjects:
    def test_round_trip_main_replicas_only(self, tmp_path):
        objs = {
            "a": [ShardedObject("opt/state", {"i": i}, (2, 2), (i // 2, i % 2)) for i in range(4)],
            "replica": ShardedObject("opt/state", {"i": "replica"}, (2, 2), (0, 0), replica_id=1),
            "weird key": ShardedObject("we ird/..key?", [1], (1,), (0,)),
        }
        TorchCommonSaveStrategy().save_sharded_objects(objs, tmp_path)
        files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.pt"))
        assert len(files) == 5
        assert all(f.startswith(OBJECTS_DIR + os.sep) for f in files)
        for p in tmp_path.rglob("*"):  # nothing escapes the objects directory
            assert tmp_path in p.resolve().parents

        request = {
            "x": [ShardedObject("opt/state", None, (2, 2), (i // 2, i % 2), replica_id=3) for i in range(4)],
            "y": {"z": ShardedObject("we ird/..key?", None, (1,), (0,))},
            "plain": 5,
        }
        loaded = TorchCommonLoadStrategy().load_sharded_objects(request, tmp_path)
        assert loaded["x"] == [{"i": i} for i in range(4)]  # the replica did not overwrite shard (0, 0)
        assert loaded["y"]["z"] == [1] and loaded["plain"] == 5

    def test_metadata(self, tmp_path):
        long_key = "k" * 300
        objs = [ShardedObject("a/b", 1, (2,), (i,)) for i in range(2)] + [ShardedObject(long_key, 2, (1,), (0,))]
        TorchCommonSaveStrategy().save_sharded_objects(objs, tmp_path)
        meta = TorchCommonLoadStrategy().load_sharded_metadata(tmp_path)
        assert set(meta) == {"a/b/shard_0_2", "a/b/shard_1_2", f"{long_key}/shard_0_1"}
        so = meta["a/b/shard_1_2"]
        assert isinstance(so, ShardedObject) and so.key == "a/b" and so.global_offset == (1,) and so.data is None
        assert meta[f"{long_key}/shard_0_1"].key == long_key
        loaded = TorchCommonLoadStrategy().load_sharded_objects([ShardedObject(long_key, None, (1,), (0,))], tmp_path)
        assert loaded == [2]

    def test_metadata_empty(self, tmp_path):
        assert TorchCommonLoadStrategy().load_sharded_metadata(tmp_path) == {}

    def test_absent_key(self, tmp_path):
        TorchCommonSaveStrategy().save_sharded_objects([ShardedObject("present", 1, (1,), (0,))], tmp_path)
        with pytest.raises(KeyMismatchError, match="'absent.obj'") as info:
            TorchCommonLoadStrategy().load_sharded_objects(
                {"a": ShardedObject("absent.obj", None, (1,), (0,))}, tmp_path
            )
        assert info.value.unexpected_keys == ["absent.obj"]

    def test_missing_shard(self, tmp_path):
        TorchCommonSaveStrategy().save_sharded_objects([ShardedObject("obj", 1, (2,), (0,))], tmp_path)
        with pytest.raises(CorruptCheckpointError, match=r"obj/shard_1_2") as info:
            TorchCommonLoadStrategy().load_sharded_objects([ShardedObject("obj", None, (2,), (1,))], tmp_path)
        assert "'obj'" in str(info.value) and "shard_0_2" in str(info.value)

    def test_unsafe_object(self, tmp_path):
        TorchCommonSaveStrategy().save_sharded_objects(
            {"o": ShardedObject("user.obj", Custom(7), (1,), (0,))}, tmp_path
        )
        with pytest.raises(UnsafeObjectError) as info:
            TorchCommonLoadStrategy().load_sharded_objects({"o": ShardedObject("user.obj", None, (1,), (0,))}, tmp_path)
        assert "'user.obj'" in str(info.value) and "allow_pickle=True" in str(info.value)
        out = TorchCommonLoadStrategy(allow_pickle=True).load_sharded_objects(
            {"o": ShardedObject("user.obj", None, (1,), (0,))}, tmp_path
        )
        assert out["o"] == Custom(7)

    def test_truncated_object(self, tmp_path):
        TorchCommonSaveStrategy().save_sharded_objects(
            [ShardedObject("obj", {"big": list(range(100))}, (1,), (0,))], tmp_path
        )
        (path,) = list(Path(tmp_path).rglob("*.pt"))
        path.write_bytes(path.read_bytes()[:50])
        with pytest.raises(CorruptCheckpointError) as info:
            TorchCommonLoadStrategy().load_sharded_objects([ShardedObject("obj", None, (1,), (0,))], tmp_path)
        assert str(path) in str(info.value)


# --------------------------------------------------------------------------- plain standard-library data


class Color(enum.Enum):
    RED = 1


class Payload:
    """Pickles as a call to ``exec`` that creates ``marker``: what a malicious checkpoint holds."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _plain_state() -> dict:
    buf = io.BytesIO(b"data-loader state")
    buf.seek(5)
    return {
        "buf": buf,
        "args": argparse.Namespace(lr=0.5, params_dtype=torch.bfloat16, save=pathlib.Path("/ckpt"), layers=[1, 2]),
        "when": datetime.datetime(2025, 1, 2, 3, 4, 5, 6, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
        "day": datetime.date(2025, 1, 2),
        "at": datetime.time(1, 2, 3),
        "took": datetime.timedelta(seconds=90),
        "money": decimal.Decimal("1.25"),
        "ratio": fractions.Fraction(1, 3),
        "run_id": uuid.UUID(int=7),
        "paths": [pathlib.PurePosixPath("a/b"), pathlib.PureWindowsPath("c:/d"), pathlib.Path("/tmp/x")],
        "frozen": frozenset({1, 2}),
        "cut": slice(1, 9, 2),
        "steps": range(0, 10, 5),
        "od": collections.OrderedDict(a=1),
    }


def _same_plain(loaded: dict, expected: dict) -> bool:
    buf = loaded["buf"]
    others = {k: v for k, v in expected.items() if k != "buf"}
    return (
        isinstance(buf, io.BytesIO)
        and buf.getvalue() == expected["buf"].getvalue()
        and buf.tell() == expected["buf"].tell()
        and {k: loaded[k] for k in others} == others
    )


class TestPlainData:
    def test_common_state_loads_by_default(self, tmp_path, caplog):
        state = _plain_state()
        with caplog.at_level(logging.WARNING, logger="dist_ckpt"):
            TorchCommonSaveStrategy().save_common(state, tmp_path)
        assert not caplog.records and not (tmp_path / UNSAFE_KEYS_FNAME).exists()
        assert find_unsafe_values(state) == {}
        assert _same_plain(TorchCommonLoadStrategy().load_common(tmp_path), state)

    def test_sharded_object_of_bytesio_loads_by_default(self, tmp_path):
        buf = io.BytesIO(b"rng")
        TorchCommonSaveStrategy().save_sharded_objects([ShardedObject("rng", {"state": buf}, (1,), (0,))], tmp_path)
        (out,) = TorchCommonLoadStrategy().load_sharded_objects([ShardedObject("rng", None, (1,), (0,))], tmp_path)
        assert out["state"].getvalue() == b"rng"

    def test_allow_list_is_scoped_to_our_loads(self, tmp_path):
        before = torch.serialization.get_safe_globals()
        TorchCommonSaveStrategy().save_common({"buf": io.BytesIO(b"x")}, tmp_path)
        TorchCommonLoadStrategy().load_common(tmp_path)
        assert torch.serialization.get_safe_globals() == before
        with pytest.raises(pickle.UnpicklingError):  # torch.load outside our loads is unchanged
            torch.load(tmp_path / COMMON_STATE_FNAME, weights_only=True)

    def test_users_own_allow_list_is_kept(self, tmp_path):
        TorchCommonSaveStrategy().save_common({"buf": io.BytesIO(b"x")}, tmp_path)
        torch.serialization.add_safe_globals([io.BytesIO, Color])
        try:
            TorchCommonLoadStrategy(safe_globals=[Color]).load_common(tmp_path)
            assert {io.BytesIO, Color} <= set(torch.serialization.get_safe_globals())
        finally:
            torch.serialization.clear_safe_globals()

    def test_enum_needs_its_own_opt_in(self, tmp_path):
        TorchCommonSaveStrategy().save_common({"backend": Color.RED}, tmp_path)
        with pytest.raises(UnsafeObjectError) as info:
            TorchCommonLoadStrategy().load_common(tmp_path)
        msg = str(info.value)
        assert "Color" in msg and "safe_globals=[...]" in msg and "allow_pickle=True" in msg and "'backend'" in msg
        assert TorchCommonLoadStrategy(safe_globals=[Color]).load_common(tmp_path) == {"backend": Color.RED}

    def test_defaultdict_is_not_plain_data(self, tmp_path):
        TorchCommonSaveStrategy().save_common({"d": collections.defaultdict(list, a=[1])}, tmp_path)
        with pytest.raises(UnsafeObjectError, match="defaultdict"):
            TorchCommonLoadStrategy().load_common(tmp_path)

    @pytest.mark.parametrize("where", ["top", "in_namespace", "in_bytesio_state", "in_object"])
    def test_malicious_reduce_never_runs(self, tmp_path, where):
        marker = tmp_path / "pwned"
        payload = Payload(marker)
        if where == "in_bytesio_state":  # a plain class whose state smuggles the payload
            buf = io.BytesIO(b"x")
            buf.extra = payload
            payload = buf
        elif where == "in_namespace":
            payload = argparse.Namespace(evil=payload)
        if where == "in_object":
            TorchCommonSaveStrategy().save_sharded_objects([ShardedObject("obj", payload, (1,), (0,))], tmp_path)
            (path,) = list(tmp_path.rglob("*.pt"))
            with pytest.raises(UnsafeObjectError) as info:
                TorchCommonLoadStrategy().load_sharded_objects([ShardedObject("obj", None, (1,), (0,))], tmp_path)
        else:
            TorchCommonSaveStrategy().save_common({"state": payload}, tmp_path)
            path = tmp_path / COMMON_STATE_FNAME
            with pytest.raises(UnsafeObjectError) as info:
                TorchCommonLoadStrategy().load_common(tmp_path)
        assert not marker.exists()
        msg = str(info.value)
        assert "builtins.exec" in msg and str(path) in msg and "allow_pickle=True" in msg
        if where != "in_object":  # control: full pickle does run it, so the check above can fail
            TorchCommonLoadStrategy(allow_pickle=True).load_common(tmp_path)
            assert marker.exists()
