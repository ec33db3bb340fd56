"""Every fenced ``python`` block of README.md and docs/**/*.md runs, as the page says to run it.

Conventions of the pages (docs/index.md says them to contributors too):

* A block is a whole program. Its first line may say how to launch it:
  ``# train.py -- run with: torchrun --nproc-per-node 2 train.py`` (several launches may be
  listed, e.g. ``python first.py, or torchrun --nproc-per-node 2 first.py``; each is run, with
  the ``--flags`` it names after the file, e.g. ``train.py --async-save``).
  ``torchrun`` / ``python -m torch.distributed.run`` start N ranks (``--standalone`` is added so
  that parallel runs do not share a port); a block without a launch runs as ``python block.py``.
* ``<!-- continues -->`` on the line before a fence: the block continues the previous block of
  the page (one program, run once with the first block's launch) -- for pages that build one
  example step by step.
* ``<!-- not-run: reason -->`` on the line before a fence: the block is not a program (e.g. a
  signature listing). Such exemptions are few (:data:`MAX_NOT_RUN`), and each has a reason.
* A program that uses ``s3://`` runs against the test S3 server (moto, on 127.0.0.1), with the
  bucket it names created empty.

Each launch runs in a fresh empty directory, so relative paths (``ckpt/iter_1000``) land there.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple

import pytest

from tests.unit.torchrun import ROOT, run

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: at most this many blocks may be exempted with <!-- not-run: ... -->
MAX_NOT_RUN = 3

_FENCE = re.compile(r"^```python\s*$")
_NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.*?)\s*-->$")
_CONTINUES = re.compile(r"^<!--\s*continues\s*-->$")
_SNIPPET = re.compile(r'^--8<--\s+"([^"]+)"\s*$')
_TORCHRUN = re.compile(
    r"(?:torchrun|python3? -m torch\.distributed\.run)\s+--nproc[-_]per[-_]node[= ](\d+)\s+([\w./-]+\.py)"
    r"((?:\s+--[\w-]+)*)"
)
_PYTHON = re.compile(r"(?<![\w-])python3?\s+([\w./-]+\.py)((?:\s+--[\w-]+)*)")
_S3_BUCKET = re.compile(r"s3://([a-z0-9][a-z0-9.-]+)")


@dataclass
class Program:
    """One runnable program of a page: a block and the blocks that continue it."""

    page: Path
    line: int
    code: str
    not_run: Optional[str] = None
    #: (torchrun ranks or None for python, file, arguments)
    launches: List[Tuple[Optional[int], str, Tuple[str, ...]]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks(page: Path) -> Iterator[Tuple[int, str, str]]:
    """``(line, marker, code)`` of each python block; marker is the comment line before it."""
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if _FENCE.match(lines[i]):
            before = next((ln.strip() for ln in reversed(lines[:i]) if ln.strip()), "")
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            body: List[str] = []
            for ln in lines[i + 1 : end]:
                snippet = _SNIPPET.match(ln.strip())
                body.append((ROOT / snippet.group(1)).read_text(encoding="utf-8") if snippet else ln)
            yield i + 1, before, "\n".join(body) + "\n"
            i = end
        i += 1


def _launches(code: str) -> List[Tuple[Optional[int], str, Tuple[str, ...]]]:
    """``(ranks, file, arguments)`` of each launch the first line states: torchrun's ranks, or
    None for python."""
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    if "run with:" not in first:
        return [(None, "block.py", ())]
    command = first.split("run with:", 1)[1]
    found: List[Tuple[int, Optional[int], str, Tuple[str, ...]]] = [
        (m.start(), int(m.group(1)), m.group(2), tuple(m.group(3).split())) for m in _TORCHRUN.finditer(command)
    ]
    spans = [(m.start(), m.end()) for m in _TORCHRUN.finditer(command)]
    for m in _PYTHON.finditer(command):
        if not any(a <= m.start() < b for a, b in spans):
            found.append((m.start(), None, m.group(1), tuple(m.group(2).split())))
    assert found, f"cannot read the launch in {first!r}"
    return [(ranks, name, args) for _, ranks, name, args in sorted(found)]


def programs() -> List[Program]:
    out: List[Program] = []
    for page in PAGES:
        previous: Optional[Program] = None
        for line, marker, code in _blocks(page):
            not_run = _NOT_RUN.match(marker)
            if not_run:
                out.append(Program(page, line, code, not_run=not_run.group(1)))
                continue
            if _CONTINUES.match(marker):
                assert previous is not None, f"{page.name}:{line} continues no block"
                previous.code += "\n" + code
                continue
            previous = Program(page, line, code, launches=_launches(code))
            out.append(previous)
    return out


PROGRAMS = programs()


def test_the_pages_have_programs_and_few_exemptions():
    by_page = {p.page.name for p in PROGRAMS if p.not_run is None}
    assert {"README.md", "index.md", "getting-started.md"} <= by_page
    exempt = [p for p in PROGRAMS if p.not_run is not None]
    assert len(exempt) <= MAX_NOT_RUN, [p.name for p in exempt]
    assert all(len(p.not_run or "") >= 10 for p in exempt), "each exemption says why"


@pytest.fixture
def s3_buckets(request: pytest.FixtureRequest) -> Any:
    """For a program that uses ``s3://``: the test server's environment, its buckets made empty."""
    program: Program = request.param
    buckets = set(_S3_BUCKET.findall(program.code))
    if not buckets:
        yield program
        return
    request.getfixturevalue("s3_env")
    server = request.getfixturevalue("s3_server")
    client = server.client()
    for bucket in buckets:
        existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
        if bucket not in existing:
            server.create_bucket(bucket)
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=bucket, Key=obj["Key"])
    yield program


@pytest.mark.parametrize("s3_buckets", [p for p in PROGRAMS if p.not_run is None], ids=lambda p: p.name, indirect=True)
def test_code_block_runs_as_the_page_says(s3_buckets: Program, tmp_path: Path) -> None:
    program = s3_buckets
    for i, (ranks, name, args) in enumerate(program.launches):
        workdir = tmp_path / f"launch{i}"

        def prepare() -> None:
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir()
            (workdir / Path(name).name).write_text(program.code, encoding="utf-8")

        proc = run(workdir, ranks, Path(name).name, *args, prepare=prepare)
        assert proc.returncode == 0, (
            f"{program.name} ({'python' if ranks is None else f'torchrun, {ranks} ranks'}, {name} {' '.join(args)}) "
            f"failed:\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
