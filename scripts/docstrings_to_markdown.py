#!/usr/bin/env python3
"""Rewrite dist_ckpt's reST-flavoured docstrings as the Markdown that mkdocstrings renders.

The API reference (docs/api/*.md) is rendered by mkdocstrings, which reads docstrings as Google-style
sections holding Markdown. Docstrings written for Sphinx show up there as raw text (``:func:`save```,
``Example::``). This script rewrites, in docstrings only:

* Sphinx roles (``:func:``, ``:class:``, ``:meth:``, ``:mod:``, ``:attr:``, ``:data:``, ``:exc:``, ``:obj:``,
  ``:const:``, optionally ``:py:``-prefixed, ``~`` and ``title <target>`` forms) into mkdocstrings
  cross-references ``[`name()`][dotted.path]`` when the site renders the target (it is in the
  ``objects.inv`` inventory of a fresh ``mkdocs build``), else into code spans ``name()``, so that
  ``mkdocs build --strict`` never meets a reference it cannot resolve;
* literal blocks (a paragraph ending in ``::`` followed by an indented block, e.g. ``Example::``) into
  the paragraph ending in ``:`` and a fenced block (``python``, ``pycon`` for ``>>>`` sessions,
  ``console`` for ``$`` commands, else ``text``);
* reST field lists (``:param x:``, ``:type x:``, ``:returns:``, ``:rtype:``, ``:raises E:``, ``:yields:``)
  into Google ``Args:`` / ``Returns:`` / ``Yields:`` / ``Raises:`` sections;
* docstring lines that end up longer than 120 characters, rewrapped at spaces (the overflow joins the
  next line of the same paragraph when there is one).

Code is never touched: each file's AST with its docstrings blanked is compared before and after, and a
file whose code would change is left alone (reported as an error). The script is idempotent: a second
run changes nothing. The ``ruff format`` and ``ruff check`` rules of the project hold for its output.

Usage, from the repository root (names resolve by importing the package, so use the checkout's)::

    PYTHONPATH=$PWD python scripts/docstrings_to_markdown.py            # rewrite dist_ckpt/ in place
    PYTHONPATH=$PWD python scripts/docstrings_to_markdown.py --check    # exit 1 if anything would change
    python scripts/docstrings_to_markdown.py --inventory site/objects.inv dist_ckpt/hf

Without ``--inventory`` it builds the site into a temporary directory (about 10 s) to read the inventory.
Exit status: 0 done (or, with ``--check``, nothing to change); 1 files would change (``--check``) or
a file could not be converted safely.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import types
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

LINE_LENGTH = 120
REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "dist_ckpt"
#: the documentation's example programs: shown as source code, so their roles become code spans, never links
EXAMPLES = "docs/examples"

#: a role, with the reST escaped space that may glue a suffix to it (``:class:`X`\\ s``; dropped)
ROLE = re.compile(r"(?<![\w`]):(?:py:)?(func|meth|class|mod|attr|data|exc|obj|const|type):`([^`]+)`(?:\\{1,2} )?")
TABLE_BORDER = re.compile(r"^\s*=+( +=+)+\s*$")
CALLABLE_ROLES = ("func", "meth")
FENCE = re.compile(r"^\s*(```|~~~)")
FIELD = re.compile(
    r"^(\s*):(param|parameter|arg|argument|key|keyword|type|returns?|rtype|raises?|except|yields?)\b([^:]*):(.*)$"
)
SECTION = re.compile(
    r"^\s*(Args|Arguments|Parameters|Params|Keyword Args|Keyword Arguments|Other Parameters|Raises|Exceptions|"
    r"Returns|Yields|Receives|Attributes|Warns|Warnings|Examples|Methods|Functions|Classes|Modules):\s*$"
)
LIST_ITEM = re.compile(r"^(\s*)([-*+]|\d+[.)])\s+")
BLOCK_START = re.compile(r"^\s*([-*+]\s|\d+[.)]\s|#|>|\||```|~~~)")


@dataclass
class Stats:
    """What a run changed, printed at the end."""

    linked: int = 0
    code_spans: int = 0
    blocks: int = 0
    tables: int = 0
    fields: int = 0
    rewrapped: int = 0
    too_long: List[str] = field(default_factory=list)
    changed: List[str] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)


@dataclass
class Scope:
    """Where a docstring sits: its module, its class if any, and the prefix naming that class relatively."""

    module: Optional[types.ModuleType]
    module_name: str
    cls: Optional[type]
    relative: Optional[str] = None


# --- the inventory: what the site renders ------------------------------------------------------------


def read_inventory(path: Path) -> Set[str]:
    """The identifiers of a Sphinx ``objects.inv`` (version 2) as written by mkdocstrings."""
    data = path.read_bytes()
    header_end = 0
    for _ in range(4):
        header_end = data.index(b"\n", header_end) + 1
    body = zlib.decompress(data[header_end:]).decode("utf-8")
    return {line.split(" ", 1)[0] for line in body.splitlines() if line.strip()}


def build_inventory() -> Set[str]:
    """Build the site into a temporary directory and read which identifiers it renders."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
        cmd = [sys.executable, "-m", "mkdocs", "build", "--quiet", "-d", tmp]
        subprocess.run(cmd, cwd=REPO_ROOT, env=env, check=True)
        return read_inventory(Path(tmp) / "objects.inv")


# --- Sphinx roles --------------------------------------------------------------------------------------


def import_path(dotted: str) -> Optional[object]:
    """The object at ``dotted`` (a module, then attributes), or None when nothing is there."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except Exception:  # noqa: BLE001 - any import failure means "not a module path"
            continue
        for part in parts[i:]:
            if not hasattr(obj, part):
                return None
            obj = getattr(obj, part)
        return obj
    return None


def canonical_path(obj: object) -> Optional[str]:
    """Where ``obj`` is defined (``module.Qual.name``) when Python records it."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if isinstance(obj, property) and obj.fget is not None:
        return canonical_path(obj.fget)
    if isinstance(obj, (classmethod, staticmethod)):
        return canonical_path(obj.__func__)
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and "<" not in qualname:
        return f"{module}.{qualname}"
    return None


def absolute_candidates(name: str, scope: Scope) -> Iterator[str]:
    """The absolute dotted paths ``name`` may mean, seen from ``scope``, most specific first."""
    if name.startswith("."):
        stripped = name.lstrip(".")
        package = scope.module_name
        if scope.module is None or not getattr(scope.module, "__path__", None):
            package = package.rpartition(".")[0]
        for _ in range(len(name) - len(stripped) - 1):
            package = package.rpartition(".")[0]
        yield f"{scope.module_name}.{stripped}"
        yield f"{package}.{stripped}"
        name = stripped
    if scope.cls is not None:
        path = canonical_path(scope.cls)
        if path is not None:
            yield f"{path}.{name}"
    yield f"{scope.module_name}.{name}"
    yield name
    yield f"{PACKAGE}.{name}"


def link_target(name: str, scope: Scope, inventory: Set[str]) -> Optional[str]:
    """The identifier to link ``name`` to: a member of the docstring's own class as a relative
    reference (``.member`` / ``..member``, mkdocstrings' ``relative_crossrefs``: short lines), else the
    identifier the site renders (canonical path preferred); None when the site does not render it."""
    path = absolute_link_target(name, scope, inventory)
    cls_path = canonical_path(scope.cls) if scope.cls is not None else None
    if path is None or cls_path is None or scope.relative is None:
        return path
    member = path.removeprefix(cls_path + ".")
    return scope.relative + member if member != path and "." not in member else path


def absolute_link_target(name: str, scope: Scope, inventory: Set[str]) -> Optional[str]:
    """The identifier the site renders for ``name`` (canonical path preferred), or None."""
    for candidate in absolute_candidates(name, scope):
        obj = import_path(candidate)
        if obj is None:
            continue
        for path in (canonical_path(obj), candidate):
            if path is not None and path in inventory:
                return path
        if scope.cls is not None and candidate.count(".") > 0:
            owner = import_path(candidate.rpartition(".")[0])
            owner_path = canonical_path(owner) if owner is not None else None
            member = f"{owner_path}.{candidate.rpartition('.')[2]}"
            if owner_path is not None and member in inventory:
                return member
        return None
    return None


def convert_roles(text: str, scope: Scope, inventory: Set[str], stats: Stats) -> str:
    """Every Sphinx role in ``text`` as a cross-reference or a code span."""

    def replace(match: re.Match[str]) -> str:
        role, body = match.group(1), match.group(2).strip()
        title: Optional[str] = None
        titled = re.fullmatch(r"(.*?)\s*<([^<>]+)>", body)
        if titled:
            title, body = titled.group(1), titled.group(2)
        short = body.startswith("~")
        target = body.lstrip("~!").removesuffix("()")
        display = title or (target.rpartition(".")[2] if short else target.lstrip("."))
        if role in CALLABLE_ROLES and not title and not display.endswith(")"):
            display += "()"
        path = link_target(target, scope, inventory)
        if path is None:
            stats.code_spans += 1
            return f"`{display}`"
        stats.linked += 1
        return f"[`{display}`][{path}]"

    return ROLE.sub(replace, text)


# --- literal blocks and field lists ------------------------------------------------------------------


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip())


def fence_language(block: Sequence[str]) -> str:
    """The language to name on a fenced block holding ``block`` (lines, common indent removed)."""
    code = [line for line in block if line.strip()]
    if code and code[0].lstrip().startswith(">>>"):
        return "pycon"
    if code and all(line.lstrip().startswith("$ ") for line in code):
        return "console"
    try:
        ast.parse("\n".join(block))
    except SyntaxError:
        return "text"
    return "python"


def in_fence_flags(lines: Sequence[str]) -> List[bool]:
    """For each line, whether it lies in (or opens/closes) a fenced block."""
    flags: List[bool] = []
    inside = False
    for line in lines:
        if FENCE.match(line):
            flags.append(True)
            inside = not inside
        else:
            flags.append(inside)
    return flags


def literal_block_end(lines: Sequence[str], start: int, indent: int) -> Optional[int]:
    """The end (exclusive) of the literal block after line ``start - 1``, or None when there is none."""
    first = start
    while first < len(lines) and not lines[first].strip():
        first += 1
    if first >= len(lines) or indent_of(lines[first]) <= indent or is_closing(lines[first]):
        return None
    block_indent = indent_of(lines[first])
    end = first
    while end < len(lines) and (not lines[end].strip() or indent_of(lines[end]) >= block_indent):
        if is_closing(lines[end]):
            break
        end += 1
    while end > first and not lines[end - 1].strip():
        end -= 1
    return end


def is_closing(line: str) -> bool:
    """Whether ``line`` holds nothing but a docstring's closing quotes."""
    return line.strip() in ('"""', "'''")


def literal_head(line: str) -> Optional[str]:
    """reST's rule for the line that opens a literal block: ``text::`` -> ``text:``, ``text ::`` ->
    ``text``, a bare ``::`` -> nothing (None)."""
    text = line.rstrip()[:-2]
    if not text.strip():
        return None
    return text.rstrip() if text.endswith(" ") else text + ":"


def convert_literal_blocks(lines: List[str], stats: Stats) -> List[str]:
    """``paragraph::`` + indented block -> ``paragraph:`` + a fenced block at the paragraph's indent.

    A block whose last line also holds the docstring's closing quotes gets them after its closing fence,
    so the quotes stay the last characters of the docstring.
    """
    out: List[str] = []
    fenced = in_fence_flags(lines)
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.rstrip()
        end = None
        if stripped.endswith("::") and not fenced[i] and not stripped.lstrip().startswith(".."):
            end = literal_block_end(lines, i + 1, indent_of(line))
        if end is None:
            out.append(line)
            i += 1
            continue
        block_lines = lines[i + 1 : end]
        closing = ""
        quotes = re.search(r"(\"\"\"|''')\s*$", block_lines[-1]) if end == len(lines) else None
        if quotes is not None:
            closing = quotes.group(1)
            block_lines[-1] = block_lines[-1][: quotes.start()].rstrip()
        block = textwrap.dedent("\n".join(block_lines).strip("\n")).split("\n")
        pad = " " * indent_of(line)
        head = literal_head(line)
        if head is not None:
            out += [head, ""]
        out.append(f"{pad}```{fence_language(block)}")
        out += [pad + b if b.strip() else "" for b in block]
        out.append(f"{pad}```{closing}")
        stats.blocks += 1
        i = end
    return out


def field_sections(fields: List[Tuple[str, str, str, List[str]]], indent: str) -> List[str]:
    """Google sections for parsed ``(kind, argument, text, continuation lines)`` fields."""
    types_by_name = {arg.strip(): text.strip() for kind, arg, text, _ in fields if kind == "type"}
    rtype = next((text.strip() for kind, _, text, _ in fields if kind == "rtype"), "")
    sections: Dict[str, List[str]] = {"Args": [], "Returns": [], "Yields": [], "Raises": []}
    kinds = {"param": "Args", "parameter": "Args", "arg": "Args", "argument": "Args", "key": "Args"}
    kinds.update(keyword="Args", returns="Returns", raises="Raises", raise_="Raises", yields="Yields")
    kinds.update({"return": "Returns", "raise": "Raises", "except": "Raises", "yield": "Yields"})
    for kind, arg, text, more in fields:
        section = kinds.get(kind)
        if section is None:
            continue
        words = arg.split()
        if section == "Args":
            name = words[-1] if words else ""
            typ = " ".join(words[:-1]) or types_by_name.get(name, "")
            label = f"{name} ({typ})" if typ else name
        elif section == "Raises":
            label = words[-1] if words else "Exception"
        else:
            label = rtype
        item = f"{label}: {text.strip()}" if label else text.strip()
        sections[section].append(f"{indent}    {item}")
        base = min((indent_of(m) for m in more if m.strip()), default=0)
        sections[section] += [f"{indent}        {m[base:]}" if m.strip() else "" for m in more]
    out: List[str] = []
    for title, items in sections.items():
        if items:
            out += ([""] if out else []) + [f"{indent}{title}:"] + items
    return out


def convert_fields(lines: List[str], stats: Stats) -> List[str]:
    """Runs of reST field lines (``:param x: ...``) -> Google sections at the same indentation."""
    out: List[str] = []
    fenced = in_fence_flags(lines)
    i = 0
    while i < len(lines):
        match = FIELD.match(lines[i]) if not fenced[i] else None
        if match is None:
            out.append(lines[i])
            i += 1
            continue
        indent = match.group(1)
        fields: List[Tuple[str, str, str, List[str]]] = []
        while i < len(lines) and not fenced[i]:
            match = FIELD.match(lines[i])
            if match is not None and match.group(1) == indent:
                kind = match.group(2).lower()
                fields.append((kind, match.group(3), match.group(4), []))
            elif lines[i].strip() and indent_of(lines[i]) > len(indent) and fields:
                fields[-1][3].append(lines[i])
            else:
                break
            i += 1
        stats.fields += len(fields)
        out += field_sections(fields, indent)
    return out


def table_columns(border: str) -> List[Tuple[int, int]]:
    """The ``(start, end)`` character spans of a reST simple table's columns, from its border line."""
    return [(m.start(), m.end()) for m in re.finditer(r"=+", border)]


def table_rows(lines: Sequence[str], columns: List[Tuple[int, int]]) -> List[List[str]]:
    """The rows of a simple table body: a line whose first column is blank continues the row above
    (reST's rule), and so does a line with only its first column filled (a wrapped first cell)."""
    rows: List[List[str]] = []
    for line in lines:
        if not line.strip():
            continue
        ends = [start for start, _ in columns[1:]] + [len(line)]
        cells = [line[start:end].strip() for (start, _), end in zip(columns, ends)]
        continues = rows and (not cells[0] or not any(cells[1:]))
        if continues:
            rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells)]
        else:
            rows.append(cells)
    return rows


def simple_table_end(lines: Sequence[str], start: int) -> Optional[int]:
    """The end (exclusive) of the simple table whose top border is line ``start``, or None."""
    borders = [i for i in range(start, len(lines)) if lines[i].strip() == lines[start].strip()]
    if len(borders) < 3 or any(not lines[i].strip() for i in range(start, borders[2])):
        return None
    return borders[2] + 1


def convert_simple_tables(lines: List[str], stats: Stats) -> List[str]:
    """reST simple tables (``=====  =====`` borders, one header row) -> Markdown.

    Two columns become a bullet list (``* first -- second``), which rewraps to the line length; wider
    tables become Markdown tables.
    """
    out: List[str] = []
    fenced = in_fence_flags(lines)
    i = 0
    while i < len(lines):
        end = simple_table_end(lines, i) if TABLE_BORDER.match(lines[i]) and not fenced[i] else None
        if end is None:
            out.append(lines[i])
            i += 1
            continue
        border = lines[i]
        pad = " " * indent_of(border)
        columns = table_columns(border)
        header_end = next(j for j in range(i + 1, end) if lines[j].strip() == border.strip())
        header = table_rows(lines[i + 1 : header_end], columns)[0]
        body = table_rows(lines[header_end + 1 : end - 1], columns)
        if len(columns) == 2:
            out += [f"{pad}* {first} -- {second}" if second else f"{pad}* {first}" for first, second in body]
        else:
            out.append(pad + "| " + " | ".join(header) + " |")
            out.append(pad + "|" + "---|" * len(columns))
            out += [pad + "| " + " | ".join(row) + " |" for row in body]
        stats.tables += 1
        i = end
    return out


# --- rewrapping long lines ---------------------------------------------------------------------------


def continuation_indents(lines: Sequence[str]) -> List[int]:
    """For each line, the indentation its paragraph's continuation lines take (Google items: +4)."""
    result: List[int] = []
    section_indent: Optional[int] = None
    item_indent: Optional[int] = None
    for line in lines:
        indent = indent_of(line)
        if line.strip() and section_indent is not None and indent <= section_indent:
            section_indent = item_indent = None
        if SECTION.match(line):
            section_indent, item_indent = indent, None
            result.append(indent)
            continue
        if section_indent is not None and line.strip() and item_indent is None:
            item_indent = indent
        list_item = LIST_ITEM.match(line)
        if list_item:
            result.append(len(list_item.group(0)))
        elif item_indent is not None and indent == item_indent:
            result.append(indent + 4)
        else:
            result.append(indent)
    return result


def split_at(line: str, limit: int, protected: int) -> Optional[Tuple[str, str]]:
    """``line`` cut at the last space within ``limit`` characters (after ``protected``), or None.

    When the first word is longer than the limit (a long cross-reference), the cut comes right after it:
    a line of one word is the one kind of long line ruff accepts. A list marker is never left alone.
    """
    text = line[protected:]
    words = list(re.finditer(r"\S+", text))
    marker = LIST_ITEM.match(line)
    first = 1 if marker is not None and marker.end() - protected >= words[0].end() else 0
    if len(words) < first + 2:
        return None
    cut_word = first
    for index in range(first + 1, len(words)):
        if protected + words[index].end() > limit:
            break
        cut_word = index
    if cut_word + 1 >= len(words):
        return None
    cut = protected + words[cut_word].end()
    return line[:cut].rstrip(), line[cut:].strip()


def joins_paragraph(line: str, indent: int) -> bool:
    """Whether ``line`` continues a paragraph whose continuation lines take ``indent``."""
    if not line.strip() or indent_of(line) != indent or BLOCK_START.match(line) or SECTION.match(line):
        return False
    return line.strip() not in ('"""', "'''")


def rewrap(lines: List[str], protected_first: int, stats: Stats, where: str) -> List[str]:
    """Lines over LINE_LENGTH broken at spaces; ``protected_first`` characters of line 0 are code."""
    out = list(lines)
    fenced = in_fence_flags(out)
    conts = continuation_indents(out)
    i = 0
    while i < len(out):
        line = out[i]
        if len(line) <= LINE_LENGTH or fenced[i] or line.lstrip().startswith("|"):
            if len(line) > LINE_LENGTH and len(line.split()) > 1:  # ruff accepts a long line of one word
                stats.too_long.append(f"{where}+{i}")
            i += 1
            continue
        protected = protected_first if i == 0 else indent_of(line)
        parts = split_at(line, LINE_LENGTH, protected)
        if parts is None:
            if len(line.split()) > 1:
                stats.too_long.append(f"{where}+{i}")
            i += 1
            continue
        head, rest = parts
        indent = conts[i] if i > 0 else max(conts[i], indent_of(out[1]) if len(out) > 1 else 0)
        out[i] = head
        stats.rewrapped += 1
        if i + 1 < len(out) and not fenced[i + 1] and joins_paragraph(out[i + 1], indent):
            out[i + 1] = " " * indent + rest + " " + out[i + 1].strip()
        else:
            out.insert(i + 1, " " * indent + rest)
            fenced.insert(i + 1, False)
            conts.insert(i + 1, indent)
        i += 1
    return out


# --- docstrings in a file ----------------------------------------------------------------------------


DocstringNode = Tuple[ast.Constant, Optional[type], Optional[str]]


def docstring_nodes(tree: ast.Module, module: Optional[types.ModuleType]) -> Iterator[DocstringNode]:
    """Every docstring of the file (module, class, function and attribute docstrings), with its class and
    the relative cross-reference prefix that names that class from the docstring (``.`` in the class's
    own docstring, ``..`` in a method's or attribute's, None elsewhere)."""

    def visit(
        body: Sequence[ast.stmt], cls: Optional[type], owner: object, own: Optional[str], attr: Optional[str]
    ) -> Iterator[DocstringNode]:
        previous: Optional[ast.stmt] = None
        for index, stmt in enumerate(body):
            value = stmt.value if isinstance(stmt, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                if index == 0:
                    yield value, cls, own
                elif isinstance(previous, (ast.Assign, ast.AnnAssign)):
                    yield value, cls, attr
            if isinstance(stmt, ast.ClassDef):
                inner = getattr(owner, stmt.name, None) if owner is not None else None
                inner_cls = inner if isinstance(inner, type) else None
                yield from visit(stmt.body, inner_cls, inner, "." if inner_cls else None, ".." if inner_cls else None)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(stmt.body, cls, None, attr, None)
            previous = stmt

    yield from visit(tree.body, None, module, None, None)


def code_fingerprint(tree: ast.Module) -> str:
    """The file's AST with every string statement blanked: equal before and after means code untouched."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            node.value.value = ""
    return ast.dump(tree, include_attributes=False)


def convert_docstring(
    lines: List[str], protected: int, scope: Scope, inventory: Set[str], stats: Stats, where: str
) -> List[str]:
    """One docstring's source lines (line 0 starts with the code before the quotes), converted."""
    lines = convert_fields(lines, stats)
    lines = convert_simple_tables(lines, stats)
    lines = convert_literal_blocks(lines, stats)
    lines = convert_roles("\n".join(lines), scope, inventory, stats).split("\n")
    return rewrap(lines, protected, stats, where)


def convert_source(source: str, scope: Scope, inventory: Set[str], stats: Stats, where: str) -> str:
    """The file's source with its docstrings converted (code untouched)."""
    tree = ast.parse(source)
    lines = source.split("\n")
    nodes = sorted(docstring_nodes(tree, scope.module), key=lambda n: n[0].lineno, reverse=True)
    for node, cls, relative in nodes:
        start, end = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        opening = lines[start][node.col_offset :]
        quote = re.match(r"[rRuU]?(\"\"\"|''')", opening)
        if quote is None or lines[end][(node.end_col_offset or 0) :].strip():
            continue  # a one-quote string or code after the closing quotes: leave it
        protected = node.col_offset + len(quote.group(0))
        inner = Scope(scope.module, scope.module_name, cls, relative)
        new = convert_docstring(lines[start : end + 1], protected, inner, inventory, stats, f"{where}:{start + 1}")
        lines[start : end + 1] = new
    return "\n".join(lines)


def module_name(path: Path) -> str:
    relative = path.resolve().relative_to(REPO_ROOT).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def process_file(path: Path, inventory: Set[str], stats: Stats, write: bool) -> None:
    """Convert one file's docstrings, in place when ``write``; record what changed.

    Files of the package are imported, to resolve names as their module sees them; other files (the
    documentation's examples) are not, and all their roles become code spans.
    """
    source = path.read_text(encoding="utf-8")
    name = module_name(path)
    module: Optional[types.ModuleType] = None
    in_package = path.resolve().is_relative_to(REPO_ROOT / PACKAGE)
    if in_package:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an unimportable module still gets absolute names resolved
            module = None
    else:
        inventory = set()
    where = str(path.resolve().relative_to(REPO_ROOT))
    new = convert_source(source, Scope(module, name, None), inventory, stats, where)
    if new == source:
        return
    if code_fingerprint(ast.parse(new)) != code_fingerprint(ast.parse(source)):
        stats.errors.append(f"{where}: the conversion would change code; file left alone")
        return
    stats.changed.append(where)
    if write:
        path.write_text(new, encoding="utf-8")


def python_files(paths: Sequence[str]) -> List[Path]:
    found: List[Path] = []
    for given in paths:
        path = Path(given)
        found += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return found


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    default = [str(REPO_ROOT / PACKAGE), str(REPO_ROOT / EXAMPLES)]
    parser.add_argument("paths", nargs="*", default=default, help="files or directories")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file would change")
    parser.add_argument("--inventory", type=Path, help="objects.inv of a built site (default: build one)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    inventory = read_inventory(args.inventory) if args.inventory else build_inventory()
    stats = Stats()
    for path in python_files(args.paths):
        process_file(path, inventory, stats, write=not args.check)
    verb = "would change" if args.check else "changed"
    print(
        f"{len(stats.changed)} files {verb}: {stats.linked} cross-references, {stats.code_spans} code spans, "
        f"{stats.blocks} fenced blocks, {stats.tables} tables, {stats.fields} fields, {stats.rewrapped} lines rewrapped"
    )
    for where in stats.changed:
        print(f"  {verb}: {where}")
    for where in stats.too_long:
        print(f"  line longer than {LINE_LENGTH} left as is (code or no space to break at): {where}")
    for error in stats.errors:
        print(f"  error: {error}", file=sys.stderr)
    return 1 if stats.errors or (args.check and stats.changed) else 0


if __name__ == "__main__":
    sys.exit(main())
