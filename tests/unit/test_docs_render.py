"""The documentation site renders as Markdown: no raw Sphinx markup, an API reference split per area.

The site is built with ``mkdocs build --strict`` (an unresolved cross-reference is a warning, so a
failure) into a temporary directory, or taken from ``DIST_CKPT_DOCS_SITE`` when scripts/run_tests.sh
has already built it. Docstrings written for Sphinx are converted by scripts/docstrings_to_markdown.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import List, Tuple

import pytest

from tests.paths import REPO_ROOT

SITE_ENV = "DIST_CKPT_DOCS_SITE"
RUN_TESTS = REPO_ROOT / "scripts" / "run_tests.sh"
#: the options of run_tests.sh's documentation build (``mkdocs build --strict ...``)
_BUILD_OPTIONS = re.compile(r"-m mkdocs build((?: --[a-z][a-z-]*)*)")
ROLES = "func|meth|class|mod|attr|data|exc|obj|const|type|ref|doc|term"
#: a Sphinx role as it renders: the role name, then its target as a code span (or raw backticks)
RAW_ROLE = re.compile(rf"(?<![\w:]):(?:py:)?(?:{ROLES}):`")
#: a reST field (``:param x:``, ``:returns:``) at the start of a rendered line
RAW_FIELD = re.compile(r"(?m)^\s*:(?:param|type|returns?|rtype|raises?|yields?)\b[^:\n]*:")
#: a reST literal-block marker (``Example::``) left in prose
RAW_LITERAL = re.compile(r"\w::(?=\s|$)")
#: tags that end a line of text
BLOCK_TAGS = ("p", "div", "li", "pre", "h1", "h2", "h3", "h4", "h5", "h6", "td", "th", "tr", "dd", "dt", "br")
API_PAGES = (
    "save-load",
    "sharded",
    "training",
    "async",
    "backends",
    "hf",
    "storage",
    "integrity",
    "tools",
    "observability",
    "errors",
)


class _Text(HTMLParser):
    """A page's text twice: all of it (code wrapped in backticks) and its prose (code left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.full: List[str] = []
        self.prose: List[str] = []
        self._hidden = 0
        self._code = 0

    def handle_starttag(self, tag: str, attrs: object) -> None:
        if tag in ("script", "style"):
            self._hidden += 1
        elif tag in ("code", "pre"):
            self._code += 1
            self.full.append("`")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._hidden -= 1
        elif tag in ("code", "pre"):
            self._code -= 1
            self.full.append("`")
        if tag in BLOCK_TAGS:
            self.full.append("\n")
            self.prose.append("\n")

    def handle_data(self, data: str) -> None:
        if self._hidden:
            return
        self.full.append(data)
        if not self._code:
            self.prose.append(data)


def raw_markup(html: str) -> List[str]:
    """Each piece of unrendered Sphinx/reST markup in a page, with some context."""
    parser = _Text()
    parser.feed(html)
    full, prose = "".join(parser.full), "".join(parser.prose)
    found: List[Tuple[str, re.Match[str]]] = [(full, m) for m in RAW_ROLE.finditer(full)]
    found += [(prose, m) for m in RAW_FIELD.finditer(prose)]
    found += [(prose, m) for m in RAW_LITERAL.finditer(prose)]
    return [" ".join(text[max(m.start() - 40, 0) : m.end() + 30].split()) for text, m in found]


def build_options() -> List[str]:
    """The options scripts/run_tests.sh builds the documentation with: this module builds the same way."""
    found = _BUILD_OPTIONS.search(RUN_TESTS.read_text(encoding="utf-8"))
    assert found, f"{RUN_TESTS} does not build the documentation with `python -m mkdocs build`"
    return found.group(1).split()


def build(project: Path, out: Path) -> "subprocess.CompletedProcess[str]":
    """``mkdocs build`` of ``project`` into ``out`` with run_tests.sh's options."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    cmd = [sys.executable, "-m", "mkdocs", "build", *build_options(), "-d", str(out)]
    return subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built site: the one run_tests.sh built, else a fresh build the same way."""
    given = os.environ.get(SITE_ENV)
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("site")
    result = build(REPO_ROOT, out)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def test_the_documentation_build_fails_on_any_warning(tmp_path: Path) -> None:
    # --quiet hides mkdocs' warnings from the count that --strict fails on, so a build with both
    # passes with an unresolved link or cross-reference
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\nSee [the missing page](missing.md).\n")
    (tmp_path / "mkdocs.yml").write_text("site_name: t\n")
    result = build(tmp_path, tmp_path / "site")
    assert result.returncode != 0, f"a build with a warning passed ({build_options()}):\n{result.stderr}"
    assert "missing.md" in result.stderr, result.stderr


def test_scanner_finds_raw_roles_fields_and_literal_markers() -> None:
    page = (
        "<p>Calls :func:<code>save</code> and :class:`Foo`.</p><p>Example::</p>"
        "<p>:param x: the value</p><pre><code>w = :meth:`load`</code></pre>"
    )
    found = raw_markup(page)
    assert len(found) == 5, found
    assert any("Example::" in f for f in found)


def test_scanner_passes_rendered_markdown() -> None:
    page = (
        '<p>Calls <a href="#x"><code>save()</code></a>; see <code>x[::2]</code>, <code>a::b</code>.</p>'
        "<p>Example:</p><pre><code>std::vector&lt;int&gt; v; x[::2]</code></pre>"
        "<script>var s = ':func:`x` Example:: ';</script>"
    )
    assert raw_markup(page) == []


def test_no_page_shows_raw_sphinx_markup(site: Path) -> None:
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > len(API_PAGES), f"only {len(pages)} pages under {site}"
    problems = [
        f"{page.relative_to(site)}: {snippet}"
        for page in pages
        for snippet in raw_markup(page.read_text(encoding="utf-8"))
    ]
    fix = "run: PYTHONPATH=$PWD python scripts/docstrings_to_markdown.py"
    assert not problems, f"{len(problems)} raw Sphinx/reST markup in the rendered site ({fix}):\n" + "\n".join(
        problems[:50]
    )


@pytest.mark.parametrize("name", API_PAGES)
def test_api_reference_is_one_page_per_area_with_links_and_examples(site: Path, name: str) -> None:
    page = site / "api" / name / "index.html"
    assert page.is_file(), f"API page {name} was not rendered"
    html = page.read_text(encoding="utf-8")
    assert 'class="doc doc-object' in html, f"{page}: no API object rendered"
    assert len(html) < 600_000, f"{page}: {len(html)} bytes; split the page"


def test_api_reference_cross_references_and_fenced_examples(site: Path) -> None:
    html = "".join((site / "api" / name / "index.html").read_text(encoding="utf-8") for name in API_PAGES)
    links = len(re.findall(r'<a class="autorefs autorefs-internal"', html))
    examples = len(re.findall(r'<div class="language-python highlight">', html))
    assert links >= 100, f"only {links} cross-references in the API reference"
    assert examples >= 20, f"only {examples} fenced Python examples in the API reference"


def test_no_exponent_renders_as_bold(site: Path) -> None:
    # `2**30` written outside a code span renders as "2<strong>30 ... 10</strong>9"
    bold = [
        f"{page.relative_to(site)}: {m.group(0)}"
        for page in sorted(site.rglob("*.html"))
        for m in re.finditer(r"\d<strong>\d[^<]{0,20}", page.read_text(encoding="utf-8"))
    ]
    assert not bold, "a power written as a**b outside a code span renders bold: " + "; ".join(bold)


def test_box_diagrams_keep_their_columns(site: Path) -> None:
    # the site wraps long code lines (extra.css); a diagram is fenced as ```{.text .diagram}, which
    # extra.css keeps unwrapped, and every line of its box is as wide as its top border
    css = (REPO_ROOT / "docs" / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    assert re.search(r"\.diagram pre > code \{[^}]*white-space: pre;", css), "extra.css wraps diagrams"
    boxes = 0
    for source in sorted((REPO_ROOT / "docs").rglob("*.md")):
        for block in re.findall(r"(?ms)^```([^\n]*)\n(.*?)^```", source.read_text(encoding="utf-8")):
            fence, body = block
            box = [line for line in body.splitlines() if line.strip()[:1] in ("┌", "│", "├", "└")]
            if not box:
                continue
            boxes += 1
            assert ".diagram" in fence, f"{source.name}: a box diagram fenced as {fence!r}, not {{.text .diagram}}"
            widths = {len(line.rstrip()) for line in box}
            assert len(widths) == 1, f"{source.name}: the box's lines are {sorted(widths)} characters wide"
    assert boxes, "no box diagram found in docs/"
    html = (site / "architecture" / "index.html").read_text(encoding="utf-8")
    assert re.search(r'class="language-text diagram highlight"><pre><span></span><code> *dist_ckpt/__init__', html)
