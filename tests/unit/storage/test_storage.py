"""Unit tests of dist_ckpt.storage: key validation/encoding and atomic local writes."""

from __future__ import annotations

import os

import pytest

from dist_ckpt.errors import CheckpointingException, InvalidKeyError, UnsafeLinkError
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
        with pytest.raises(UnsafeLinkError):  # a link out of the root (a "../" key: InvalidKeyError)
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


class TestLocalFastPaths:
    """What LocalStorage adds to the interface: durable directories, positional readers, the
    commit marker where hard links are missing, and the directory for code written for paths."""

    def test_put_if_absent_without_hard_links_still_creates_only_if_absent(self, tmp_path, monkeypatch):
        import errno

        from dist_ckpt.storage import LocalStorage, ObjectExistsError, local

        def no_links(src, dst):
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(local.os, "link", no_links)
        storage = LocalStorage(tmp_path)
        storage.put_if_absent("metadata.json", b"first")
        with pytest.raises(ObjectExistsError):
            storage.put_if_absent("metadata.json", b"second")
        assert (tmp_path / "metadata.json").read_bytes() == b"first"
        assert os.listdir(tmp_path) == ["metadata.json"]  # no temporary left behind

    def test_make_dir_fsyncs_the_parent_of_each_new_directory(self, tmp_path, monkeypatch):
        from dist_ckpt.storage import LocalStorage, files

        synced = []
        monkeypatch.setattr(files, "fsync_dir", lambda path: synced.append(os.path.relpath(path, tmp_path)))
        LocalStorage(tmp_path / "ckpt").make_dir("a/b")
        assert (tmp_path / "ckpt" / "a" / "b").is_dir()
        assert synced == [".", "ckpt", os.path.join("ckpt", "a")]
        synced.clear()
        LocalStorage(tmp_path / "ckpt").make_dir("a")  # exists: nothing to make durable
        assert synced == []

    def test_reader_is_the_descriptor_and_reads_positionally(self, tmp_path):
        from dist_ckpt.storage import LocalStorage, ObjectNotFoundError, TruncatedObjectError

        storage = LocalStorage(tmp_path)
        storage.write("d/a.bin", bytes(range(100)))
        with storage.open_reader("d/a.bin") as reader:
            assert reader.positional and reader.size() == 100 and os.fstat(reader).st_size == 100
            a, b = bytearray(3), bytearray(5)
            assert reader.read_into([memoryview(a), memoryview(b)], 10) == 8
            assert bytes(a + b) == bytes(range(10, 18))
            with pytest.raises(TruncatedObjectError, match="a.bin"):
                reader.read_into([memoryview(bytearray(10))], 95)
        with pytest.raises(ObjectNotFoundError, match="missing.bin"):
            storage.open_reader("missing.bin")

    def test_a_local_storage_is_its_directory_for_path_based_code(self, tmp_path):
        from pathlib import Path

        from dist_ckpt.storage import LocalStorage, Storage, StorageConfigError

        storage = LocalStorage(tmp_path / "ckpt")
        assert storage.local_paths and storage.local_dir == tmp_path / "ckpt"
        assert Path(storage) == tmp_path / "ckpt" and os.fspath(storage) == str(tmp_path / "ckpt")
        assert LocalStorage("rel/dir").url == "rel/dir" and LocalStorage("rel/dir").url_of("x") == "rel/dir/x"
        assert LocalStorage("rel/dir").child("c").url == "rel/dir/c"
        assert not storage.dir_exists() and storage.list_dirs() == []
        storage.make_dir("sub")
        assert storage.dir_exists() and storage.dir_exists("sub") and storage.list_dirs() == ["sub"]
        with pytest.raises(StorageConfigError, match="not a local directory"):
            Storage.local_dir.fget(_NoPaths())  # the default of a storage without local files


class _NoPaths:
    """Stands for a storage without local files (only ``url`` is read)."""

    url = "s3://bucket/run"


def test_local_storage_refuses_symlinks_that_leave_its_root(tmp_path):
    """Keys cannot name '..', but a link planted inside the directory could lead out of it:
    the storage resolves every directory (and a linked last component) and refuses that with the
    one symlink policy's error (UnsafeLinkError, a CorruptCheckpointError)."""
    from dist_ckpt.storage import LocalStorage

    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"x")
    root.mkdir()
    os.symlink(outside, root / "linkdir")
    os.symlink(outside / "secret", root / "linkfile")
    (root / "inside").mkdir()
    os.symlink(root / "inside", root / "innerlink")
    storage = LocalStorage(root)
    for key in ("linkdir/secret", "linkfile"):
        with pytest.raises(UnsafeLinkError, match="outside the checkpoint directory"):
            storage.read(key)
        with pytest.raises(UnsafeLinkError, match="outside the checkpoint directory"):
            storage.write(key, b"y")
    storage.write("innerlink/a", b"ok")  # a link that stays inside is followed
    assert (root / "inside" / "a").read_bytes() == b"ok" and storage.read("innerlink/a") == b"ok"
    assert (outside / "secret").read_bytes() == b"x"


def test_local_storage_child_follows_links_within_the_parent_root(tmp_path):
    """A child (``safetensors/``) may follow a link elsewhere inside its checkpoint -- the
    policy protects the checkpoint directory, not each subdirectory -- but not out of it; a
    pickled storage keeps its link roots; ``exists`` answers for a link out (a question, not a
    read) while reading through it is refused."""
    import pickle

    from dist_ckpt.storage import LocalStorage

    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    (ckpt / "safetensors").mkdir(parents=True)
    (ckpt / "other").mkdir()
    outside.mkdir()
    (ckpt / "other" / "data").write_bytes(b"inside")
    (outside / "data").write_bytes(b"outside")
    os.symlink(ckpt / "other" / "data", ckpt / "safetensors" / "in")
    os.symlink(outside / "data", ckpt / "safetensors" / "out")
    child = LocalStorage(ckpt).child("safetensors")
    for storage in (child, pickle.loads(pickle.dumps(child))):
        assert storage.read("in") == b"inside"
        assert storage.exists("out")
        with pytest.raises(UnsafeLinkError):
            storage.read("out")
    with pytest.raises(UnsafeLinkError):  # rooted at safetensors/ itself, ckpt/other is outside
        LocalStorage(ckpt / "safetensors").read("in")


def test_local_listing_resolves_only_links_not_every_directory(tmp_path, monkeypatch):
    """A zarr checkpoint has several directories per tensor: resolving each one (a realpath per
    directory) cost a listing more than the save it reported on. Directories that are not links
    are known from their parent; links are still resolved and confined."""
    from dist_ckpt.storage import LocalStorage
    from dist_ckpt.storage import local as local_module

    root = tmp_path / "ckpt"
    for i in range(40):
        (root / f"t{i}" / "c" / "0").mkdir(parents=True)
        (root / f"t{i}" / "c" / "0" / "0").write_bytes(b"x" * i)
    os.symlink(root / "t1", root / "inner")  # a link inside the root: followed, listed under its name
    calls = []
    real_confined = local_module.confined
    monkeypatch.setattr(local_module, "confined", lambda *a: (calls.append(a[0]), real_confined(*a))[1])
    listed = {o.key: o.size for o in LocalStorage(root).list()}
    assert listed["t7/c/0/0"] == 7 and len(listed) == 40  # t1 once: 'inner' leads to a listed directory
    assert len(calls) <= 2, calls  # the root and the link, not 121 directories
