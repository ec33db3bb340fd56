"""scripts/check_layers.py: upward imports, backend-to-backend imports and cycles are found."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

from tests.paths import REPO_ROOT


@pytest.fixture(scope="module")
def layers() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("check_layers", REPO_ROOT / "scripts" / "check_layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_an_import_down_a_layer_is_allowed(layers: types.ModuleType) -> None:
    assert layers.violation("dist_ckpt.engine.save", "dist_ckpt.backends.base") is None
    assert layers.violation("dist_ckpt.backends.zarr.nodes", "dist_ckpt.storage.base") is None
    assert layers.violation("dist_ckpt.model.sharded", "dist_ckpt.errors") is None


def test_an_import_up_a_layer_is_a_violation(layers: types.ModuleType) -> None:
    assert layers.violation("dist_ckpt.storage.local", "dist_ckpt.engine.save") == "up"
    assert layers.violation("dist_ckpt.errors", "dist_ckpt.model.sharded") == "up"
    # the root modules are the public facade: nothing below may import them
    assert layers.violation("dist_ckpt.engine.load", "dist_ckpt.mapping") == "up"
    assert layers.violation("dist_ckpt.mapping", "dist_ckpt.engine.load") is None


def test_a_backend_importing_another_is_a_violation(layers: types.ModuleType) -> None:
    assert layers.violation("dist_ckpt.backends.zarr.nodes", "dist_ckpt.backends.safetensors.format") == "backend"
    assert layers.violation("dist_ckpt.backends.zarr.nodes", "dist_ckpt.backends.base") is None
    assert layers.violation("dist_ckpt.backends.zarr.nodes", "dist_ckpt.backends.zarr.layout") is None


def test_cycles_are_found_and_acyclic_graphs_pass(layers: types.ModuleType) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert layers.cycles(graph) == [["a", "b", "c"]]
    assert layers.cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_deferred_imports_are_edges(layers: types.ModuleType, tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text(
        "from . import sibling\n"
        "def later():\n"
        "    from dist_ckpt.engine.save import save\n"
        "    import dist_ckpt.storage.base\n",
        encoding="utf-8",
    )
    known = {"dist_ckpt.storage.sibling", "dist_ckpt.engine.save", "dist_ckpt.storage.base", "dist_ckpt.storage"}
    found = set(layers.imported_modules(source, "dist_ckpt.storage.mod", known))
    assert found == {"dist_ckpt.storage.sibling", "dist_ckpt.engine.save", "dist_ckpt.storage.base"}


def test_the_package_has_no_violation_beyond_the_recorded_debt(layers: types.ModuleType) -> None:
    found = set(layers.findings())
    debt = layers.read_debt()
    assert found - debt == set(), "new layer violations; see scripts/check_layers.py"
    assert debt - found == set(), "fixed violations still listed in scripts/layer_debt.txt"


def test_imports_for_type_checking_only_are_not_edges(layers: types.ModuleType, tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import typing\n"
        "if TYPE_CHECKING:\n"
        "    from dist_ckpt.engine.save import save\n"
        "if typing.TYPE_CHECKING:\n"
        "    import dist_ckpt.engine.load\n"
        "else:\n"
        "    import dist_ckpt.storage.base\n",
        encoding="utf-8",
    )
    known = {"dist_ckpt.engine.save", "dist_ckpt.engine.load", "dist_ckpt.storage.base"}
    assert set(layers.imported_modules(source, "dist_ckpt.storage.mod", known)) == {"dist_ckpt.storage.base"}
