#!/usr/bin/env python3
"""Check that dist_ckpt's imports follow its layers (DESIGN.md section 2); `make check` runs it.

Every ``import`` in the package, at module level or deferred inside a function (not those under
``if TYPE_CHECKING:``, which never run), is an edge from one module to another. The check fails
on an edge that points up a layer, on one from a concrete backend into another, and on an import
cycle between modules. Edges that exist today and are still to be removed are listed in
``scripts/layer_debt.txt``: the check fails on any edge not in that list (a new violation) and on
any listed edge that no longer exists (so the list only shrinks). Run
``python scripts/check_layers.py --write-debt`` after removing violations.

Usage: ``python scripts/check_layers.py [--write-debt]``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "dist_ckpt"
ROOT = Path(__file__).resolve().parent.parent
DEBT_FILE = ROOT / "scripts" / "layer_debt.txt"

# Bottom to top. Packages in one band may import each other (except backend into backend);
# a module that is not listed (the root modules, strategies/, testing/) is the public facade
# at the top, which may import anything below and is imported by nothing below.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"_version", "errors"}),
    frozenset({"model"}),
    frozenset({"storage"}),
    frozenset({"collectives"}),
    frozenset({"integrity"}),
    frozenset({"record"}),
    frozenset({"backends", "parallel", "asynchronous"}),
    frozenset({"engine"}),
    frozenset({"hf", "training", "tools", "dcp", "tiers"}),
    frozenset({"cli"}),
)
FACADE = len(LAYERS)
# Modules of backends/ that every backend shares; any other subpackage is a concrete backend.
SHARED_BACKEND_MODULES = frozenset({"base", "registry", "request_checks", "stored_shards"})


def module_name(path: Path) -> str:
    """The dotted name of a package file, e.g. ``dist_ckpt.engine.save``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, module: str, known: set[str]) -> Iterator[str]:
    """Every package module that ``path`` imports, resolved to a module that exists."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names]
            # `from pkg import mod` imports the module; `from mod import func` imports ``mod``
            names = [name if name in known else base for name in names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith(PACKAGE + ".") and name != module:
                yield name


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:``, which never run (an
    annotation's import makes no dependency at run time, and no cycle)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def layer_of(module: str) -> int:
    """The index of the band that holds ``module`` in LAYERS (FACADE for the facade)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    if len(parts) == 2 and top not in {"_version", "errors"} and not _is_package(module):
        return FACADE
    for index, band in enumerate(LAYERS):
        if top in band:
            return index
    return FACADE


def _is_package(module: str) -> bool:
    return (ROOT / Path(*module.split("."))).is_dir()


def concrete_backend(module: str) -> str | None:
    """The concrete backend package ``module`` belongs to, or None."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "backends" and parts[2] not in SHARED_BACKEND_MODULES:
        return parts[2]
    return None


def violation(source: str, target: str) -> str | None:
    """Why the edge ``source -> target`` breaks the layers, or None if it does not."""
    if layer_of(target) > layer_of(source):
        return "up"
    source_backend, target_backend = concrete_backend(source), concrete_backend(target)
    if source_backend and target_backend and source_backend != target_backend:
        return "backend"
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def findings() -> list[str]:
    """Every layer violation and cycle of the package, one sorted line each."""
    files = sorted((ROOT / PACKAGE).rglob("*.py"))
    known = {module_name(path) for path in files}
    graph = {module_name(path): set(imported_modules(path, module_name(path), known)) for path in files}
    lines = []
    for source, targets in graph.items():
        for target in targets:
            why = violation(source, target)
            if why:
                lines.append(f"{why} {source} -> {target}")
    lines.extend("cycle " + " ".join(component) for component in cycles(graph))
    return sorted(lines)


def read_debt() -> set[str]:
    if not DEBT_FILE.exists():
        return set()
    lines = DEBT_FILE.read_text(encoding="utf-8").splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--write-debt", action="store_true", help="record today's violations as the debt list")
    args = parser.parse_args(argv)
    found = findings()
    if args.write_debt:
        header = (
            "# Import edges that break dist_ckpt's layers today (scripts/check_layers.py).\n"
            "# This list may only shrink: remove a violation, then rerun with --write-debt.\n"
        )
        DEBT_FILE.write_text(header + "".join(line + "\n" for line in found), encoding="utf-8")
        print(f"check_layers: recorded {len(found)} known violations in {DEBT_FILE.relative_to(ROOT)}")
        return 0
    debt = read_debt()
    new = [line for line in found if line not in debt]
    gone = sorted(debt - set(found))
    for line in new:
        print(f"check_layers: new layer violation: {line}")
    for line in gone:
        print(f"check_layers: fixed, remove it from {DEBT_FILE.name}: {line}")
    if new or gone:
        return 1
    print(f"check_layers: OK ({len(found)} known violations left in {DEBT_FILE.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
