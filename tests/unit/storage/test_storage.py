"""Unit tests of dist_ckpt.storage: key validation/encoding and atomic local writes."""

from __future__ import annotations

import os

import pytest

from dist_ckpt.errors import CheckpointingException, InvalidKeyError
from dist_ckpt.storage import (
    atomic_write,
    decode_key,
    encode_key,
    fsync_dir,
    fsync_file,
    is_shortened,
    safe_join,
    validate_key,
    write_bytes_atomic,
)

BAD_KEYS = [
    "",
    "/etc/passwd",
    "../x",
    "../../etc/x",
    "a/../../b",
    "a/./b",
    ".",
    "..",
    "a/..",
    "a\\..\\b",
    "tab\there",
    "nl\n",
    "del\x7f",
]
GOOD_KEYS = [
    "w",
    "layer.0.weight",
    "a/b/c",
    "..hidden",
    "a..b",
    ".x",
    "x.",
    "sp ace",
    "per%cent",
    "ünïcødé/键",
    "colon:and*star?",
    "tilde~name",
    "_-.",
]


class TestValidateKey:
    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_rejects(self, key):
        with pytest.raises(InvalidKeyError, match="invalid checkpoint key") as info:
            validate_key(key)
        assert repr(key) in str(info.value)
        assert isinstance(info.value, CheckpointingException) and isinstance(info.value, ValueError)

    def test_non_str(self):
        with pytest.raises(InvalidKeyError):
            validate_key(None)  # type: ignore[arg-type]

    @pytest.mark.parametrize("key", GOOD_KEYS)
    def test_accepts(self, key):
        validate_key(key)

    def test_rank_in_message(self):
        with pytest.raises(InvalidKeyError, match=r"^\[rank 3\]"):
            validate_key("../x", rank=3)


class TestEncodeKey:
    @pytest.mark.parametrize("key", GOOD_KEYS)
    def test_single_safe_component_and_round_trip(self, key):
        name = encode_key(key)
        assert "/" not in name and "\\" not in name and name not in (".", "..")
        assert not name.startswith(".")
        assert set(name) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-%~")
        assert decode_key(name) == key
        assert not is_shortened(name)

    def test_safe_keys_unchanged(self):
        assert encode_key("layer.0.weight") == "layer.0.weight"
        assert encode_key("a_b-c") == "a_b-c"

    def test_injective(self):
        keys = ["a/b", "a%2Fb", "a_b", "a.b", "A/b", "a//b", "%", "%25", ".a", "%2Ea", "a~b", "a%7Eb"]
        names = [encode_key(k) for k in keys]
        assert len(set(names)) == len(keys)

    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_bad_keys_rejected(self, key):
        with pytest.raises(InvalidKeyError):
            encode_key(key)

    def test_long_keys_are_shortened_distinctly(self):
        a = "x" * 300 + "a"
        b = "x" * 300 + "b"
        na, nb = encode_key(a), encode_key(b)
        assert len(na) <= 200 and len(nb) <= 200
        assert na != nb
        assert is_shortened(na) and decode_key(na) is None
        assert encode_key(a) == na  # deterministic

    def test_multibyte_long_key(self):
        key = "键" * 100  # 9 encoded characters each
        name = encode_key(key)
        assert len(name) <= 200 and is_shortened(name)


class TestSafeJoin:
    def test_inside(self, tmp_path):
        assert safe_join(tmp_path, "a", "b.txt") == (tmp_path / "a" / "b.txt").resolve()

    @pytest.mark.parametrize("parts", [("..", "x"), ("a", "..", "..", "x"), ("/etc/passwd",)])
    def test_escape(self, tmp_path, parts):
        with pytest.raises(InvalidKeyError, match="escapes"):
            safe_join(tmp_path, *parts)

    def test_symlink_escape(self, tmp_path):
        (tmp_path / "root").mkdir()
        (tmp_path / "outside").mkdir()
        os.symlink(tmp_path / "outside", tmp_path / "root" / "link")
        with pytest.raises(InvalidKeyError):
            safe_join(tmp_path / "root", "link", "file")


class TestAtomicWrite:
    def test_writes(self, tmp_path):
        target = tmp_path / "f.bin"
        with atomic_write(target) as f:
            f.write(b"hello")
            assert not target.exists()  # invisible until the end
        assert target.read_bytes() == b"hello"
        assert os.listdir(tmp_path) == ["f.bin"]  # no temporary left

    def test_failure_leaves_nothing(self, tmp_path):
        target = tmp_path / "f.bin"
        with pytest.raises(RuntimeError):
            with atomic_write(target) as f:
                f.write(b"partial")
                raise RuntimeError("boom")
        assert os.listdir(tmp_path) == []

    def test_failure_keeps_old_content(self, tmp_path):
        target = tmp_path / "f.bin"
        target.write_bytes(b"old")
        with pytest.raises(RuntimeError):
            with atomic_write(target, fsync=False) as f:
                f.write(b"new")
                raise RuntimeError("boom")
        assert target.read_bytes() == b"old"
        assert os.listdir(tmp_path) == ["f.bin"]

    def test_write_bytes_atomic_replaces(self, tmp_path):
        target = tmp_path / "g"
        write_bytes_atomic(target, b"one")
        write_bytes_atomic(str(target), memoryview(b"two"), fsync=False)
        assert target.read_bytes() == b"two"
        assert os.listdir(tmp_path) == ["g"]

    def test_fsync_helpers(self, tmp_path):
        p = tmp_path / "x"
        p.write_bytes(b"1")
        fsync_file(p)
        fsync_dir(tmp_path)
        with pytest.raises(FileNotFoundError):
            fsync_file(tmp_path / "missing")
