"""ObjectPath: the part of pathlib.Path the zarr layout uses, over any Storage (here a local one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dist_ckpt.storage import LocalStorage, ObjectNotFoundError
from dist_ckpt.storage.object_path import ObjectPath, node_files, subdirs


def test_object_path_behaves_like_the_paths_it_stands_for(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    root = ObjectPath(storage, "zarr")
    node = root / "w" / "zarr.json"
    assert node.key == "zarr/w/zarr.json" and node.name == "zarr.json" and node.parent == root / "w"
    assert ObjectPath(storage).parent == ObjectPath(storage) and (ObjectPath(storage) / "a").key == "a"
    assert not node.is_file() and not root.is_dir() and not root.exists()
    with pytest.raises(ObjectNotFoundError):
        node.read_bytes()
    node.write_bytes(b"{}")
    (root / "w" / "c" / "0").write_bytes(b"1234")
    (root / "v" / "zarr.json").write_bytes(b"{}")
    (root / "checksums.json").write_bytes(b"{}")
    assert node.read_bytes() == b"{}" and node.is_file() and (root / "w").is_dir() and root.exists()
    assert (root / "w" / "c" / "0").stat().st_size == 4
    assert subdirs(root) == ["v", "w"]  # prefixes only: checksums.json is a file
    assert [p.relative_to(root) for p in node_files(root)] == ["checksums.json", "v/zarr.json", "w/c/0", "w/zarr.json"]  # type: ignore[union-attr]
    assert {root / "w", root / "w"} == {root / "w"} and sorted([root / "w", root / "v"]) == [root / "v", root / "w"]
    assert str(node) == storage.url_of("zarr/w/zarr.json")
    with pytest.raises(ValueError, match="not under"):
        ObjectPath(storage, "other/x").relative_to(root)
