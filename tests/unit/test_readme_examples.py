"""The README's programs can be run one after another in one directory, and run again.

A reader runs them where they are, not each in a fresh directory as
``test_docs_code_blocks.py`` does: two programs that write the same checkpoint collide (the
second save raises ``CheckpointExistsError``), and a program run twice meets its own checkpoint.
So each program says, in its opening comment, which directory it writes and how to run it
again (``# writes DIR/ -- ...run it again...``), no two programs' directories overlap, and every
relative path the program names lies in its own directory.
"""

from __future__ import annotations

import itertools
import re
from pathlib import PurePosixPath
from typing import Dict, List

from tests.unit.test_docs_code_blocks import Program, programs

_WRITES = re.compile(r"^# writes ([\w.-]+(?:/[\w.-]+)*)/ -- (.*run it again.*)$")
#: a string literal (or f-string) holding a relative path with at least one directory in it
_PATH_LITERAL = re.compile(r"""(?<![\w])f?["']((?:[\w.{}-]+/)+[\w.{}<>-]*)["']""")


def readme_programs() -> List[Program]:
    return [p for p in programs() if p.page.name == "README.md" and p.not_run is None]


def written_directory(program: Program) -> str:
    header = itertools.takewhile(lambda line: line.startswith("#"), program.code.lstrip().splitlines())
    match = next((m for m in map(_WRITES.match, header) if m), None)
    assert match, f"{program.name}: its opening comment must say '# writes DIR/ -- how to run it again'"
    return match.group(1)


def inside(path: str, directory: str) -> bool:
    return PurePosixPath(path).parts[: len(PurePosixPath(directory).parts)] == PurePosixPath(directory).parts


def test_each_program_writes_its_own_directory_and_says_how_to_run_it_again() -> None:
    owned: Dict[str, str] = {}
    for program in readme_programs():
        directory = written_directory(program)
        for other, name in owned.items():
            assert not inside(directory, other) and not inside(other, directory), (
                f"{program.name} writes {directory}/, which overlaps {other}/ of {name}"
            )
        owned[directory] = program.name
        for path in _PATH_LITERAL.findall(program.code):
            assert inside(path, directory), f"{program.name} names {path!r}, outside its directory {directory}/"
    assert len(owned) >= 4, owned


def test_the_rules_catch_a_collision() -> None:
    """The checks above can fail: what the README had before each program had a directory."""
    assert inside("ckpt/iter_1000", "ckpt") and not inside("ckpt_zarr/iter_1000", "ckpt")
    assert _PATH_LITERAL.findall('dc.save(sd, "ckpt/iter_1000"); f"ckpt/iter_{step}"') == [
        "ckpt/iter_1000",
        "ckpt/iter_{step}",
    ]
    assert not _WRITES.match("# writes ckpt/")  # says nothing about running it again
