"""scripts/docstrings_to_markdown.py: docstrings only, Markdown out, idempotent."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import types

import pytest

from tests.paths import REPO_ROOT


@pytest.fixture(scope="module")
def conv() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        "docstrings_to_markdown", REPO_ROOT / "scripts" / "docstrings_to_markdown.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


INVENTORY = {
    "dist_ckpt.engine.save.save",
    "dist_ckpt.model.sharded.ShardedTensor",
    "dist_ckpt.model.sharded.ShardedTensor.from_rank_offsets",
    "dist_ckpt.engine.save",
}

SOURCE = '''\
"""Module summary: :func:`save` writes, :class:`~dist_ckpt.model.sharded.ShardedTensor` describes.

Example::

    import dist_ckpt as dc
    dc.save(sd, "ckpt")
"""

from dist_ckpt.engine.save import save
from dist_ckpt.model.sharded import ShardedTensor

LIMIT = 3
"""How many, see :data:`LIMIT` and :mod:`dist_ckpt.engine.save`."""


def f(x: int) -> str:
    """Do it, as :func:`not_rendered_anywhere` does.

    :param x: the value, as in :func:`save`
        over two lines.
    :type x: int
    :returns: the text.
    :raises ValueError: when ``x`` is negative.
    """
    return ":func:`kept` in code"


class C:
    """A class :attr:`size`.

    >>> session::

        >>> f(1)
        '1'
    """

    size = 1

    def m(self) -> None:
        """Calls :meth:`m` and :meth:`C.size`::

            $ dist-ckpt inspect ckpt
            $ dist-ckpt verify ckpt"""
'''


def convert(conv: types.ModuleType, source: str, module_name: str = "sample") -> str:
    module = types.ModuleType(module_name)
    exec(compile(source, f"{module_name}.py", "exec"), module.__dict__)
    scope = conv.Scope(module, module_name, None)
    return conv.convert_source(source, scope, INVENTORY, conv.Stats(), module_name)


def test_roles_become_links_when_rendered_else_code_spans(conv: types.ModuleType) -> None:
    out = convert(conv, SOURCE)
    assert "[`save()`][dist_ckpt.engine.save.save] writes" in out
    assert "[`ShardedTensor`][dist_ckpt.model.sharded.ShardedTensor] describes" in out
    assert "[`dist_ckpt.engine.save`][dist_ckpt.engine.save]" in out
    assert "as `not_rendered_anywhere()` does" in out
    assert "see `LIMIT` and" in out
    assert '(self) -> None:\n        """Calls `m()` and `C.size()`:' in out
    assert "A class `size`." in out  # C is not rendered: a code span
    assert 'return ":func:`kept` in code"' in out  # code is never touched


def test_literal_blocks_become_fenced_blocks_with_a_language(conv: types.ModuleType) -> None:
    out = convert(conv, SOURCE)
    assert "Example::" not in out
    assert 'Example:\n\n```python\nimport dist_ckpt as dc\ndc.save(sd, "ckpt")\n```\n"""' in out
    assert "    >>> session:\n\n    ```pycon\n    >>> f(1)\n    '1'\n    ```\n" in out
    # a block that ends on the closing quotes keeps them after the fence
    assert (
        '        ```console\n        $ dist-ckpt inspect ckpt\n        $ dist-ckpt verify ckpt\n        ```"""' in out
    )


def test_fields_become_google_sections(conv: types.ModuleType) -> None:
    out = convert(conv, SOURCE)
    expected = textwrap.indent(
        textwrap.dedent(
            """\
            Args:
                x (int): the value, as in [`save()`][dist_ckpt.engine.save.save]
                    over two lines.

            Returns:
                the text.

            Raises:
                ValueError: when ``x`` is negative.
            """
        ),
        "    ",
    )
    assert expected in out


def test_second_run_changes_nothing_and_code_is_untouched(conv: types.ModuleType) -> None:
    once = convert(conv, SOURCE)
    assert convert(conv, once) == once
    assert conv.code_fingerprint(conv.ast.parse(once)) == conv.code_fingerprint(conv.ast.parse(SOURCE))


def test_long_lines_are_rewrapped_into_their_paragraph(conv: types.ModuleType) -> None:
    words = " ".join(f"word{i}" for i in range(30))
    item = f"x: {words} :func:`save` {words}"
    source = f'def g() -> None:\n    """Summary.\n\n    Args:\n        {item}\n            end.\n    """\n'
    out = convert(conv, source)
    lines = out.split("\n")
    assert max(len(line) for line in lines) <= conv.LINE_LENGTH
    assert "[`save()`][dist_ckpt.engine.save.save]" in out
    continuation = [line for line in lines if line.startswith("            ")]
    assert continuation and continuation[-1].endswith("end."), out  # the overflow joined the next line
    assert convert(conv, out) == out


def test_members_of_the_own_class_link_relatively(conv: types.ModuleType) -> None:
    source = '''\
class ShardedTensor:
    """See :meth:`from_rank_offsets`."""

    def from_rank_offsets(self) -> None:
        """Like :meth:`from_rank_offsets`."""
'''
    module = types.ModuleType("dist_ckpt.model.sharded")
    exec(compile(source, "sharded.py", "exec"), module.__dict__)
    module.ShardedTensor.__module__ = "dist_ckpt.model.sharded"
    scope = conv.Scope(module, "dist_ckpt.model.sharded", None)
    out = conv.convert_source(source, scope, INVENTORY, conv.Stats(), "sharded")
    assert '"""See [`from_rank_offsets()`][.from_rank_offsets]."""' in out
    assert '"""Like [`from_rank_offsets()`][..from_rank_offsets]."""' in out


def test_check_mode_reports_and_changes_nothing(conv: types.ModuleType, tmp_path, monkeypatch, capsys) -> None:
    inventory = tmp_path / "objects.inv"
    body = "\n".join(f"{name} py:function 1 api/#$ -" for name in sorted(INVENTORY)).encode()
    header = b"# Sphinx inventory version 2\n# Project: x\n# Version: 0\n# The remainder is compressed using zlib.\n"
    inventory.write_bytes(header + conv.zlib.compress(body))
    assert conv.read_inventory(inventory) == INVENTORY
    sample = REPO_ROOT / "docs" / "examples" / "custom_backend.py"
    before = sample.read_text()
    status = conv.main(["--check", "--inventory", str(inventory), str(sample)])
    assert sample.read_text() == before
    assert status == (1 if conv.ROLE.search(before) else 0)


def test_simple_tables_and_escaped_spaces(conv: types.ModuleType) -> None:
    source = '''\
"""Operations:

=========  ==========================
operation  what it does
=========  ==========================
``write``  writes the whole object
           at once
``read``   reads it
``a`` /    either
``b``
=========  ==========================

Three :class:`~dist_ckpt.model.sharded.ShardedTensor`\\\\ s.
"""
'''
    out = convert(conv, source)
    assert "* ``write`` -- writes the whole object at once\n* ``read`` -- reads it\n* ``a`` / ``b`` -- either\n" in out
    assert "===" not in out
    assert "Three [`ShardedTensor`][dist_ckpt.model.sharded.ShardedTensor]s." in out
    assert convert(conv, out) == out
