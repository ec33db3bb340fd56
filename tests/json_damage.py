"""Seeded damaged copies of a JSON document, for the tests that feed them to parsers and loads.

`damaged_documents()` is the one loop: the i-th copy is made by ``kinds[i % len(kinds)]``, each
kind a function of the valid document, the seeded generator and the paths of the document's
nodes. The kinds every suite uses (random bytes, a truncation, a flipped byte) are here; each
suite adds its own (tests/unit/integrity/test_corruption.py: a wrong value at a node;
tests/unit/faults/test_metadata_fuzz.py: deep nesting, text that is not UTF-8, wrong types at
several nodes). The same seed gives the same copies.
"""

from __future__ import annotations

import json
import random
from typing import Any, Callable, List, Sequence, Tuple

#: the path of a node of a JSON document: its keys and list indexes from the root
Node = Tuple[Any, ...]
#: a damaged copy: what was done to the document, and its bytes
Damage = Tuple[str, bytes]
#: one way of damaging a document: ``(valid document, generator, its nodes) -> Damage``
Kind = Callable[[bytes, random.Random, List[Node]], Damage]


def json_nodes(doc: Any, path: Node = ()) -> List[Node]:
    """Paths of every node of a JSON document (the root excluded), each before its children."""
    out: List[Node] = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += [path + (k,)] + json_nodes(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += [path + (i,)] + json_nodes(v, path + (i,))
    return out


def set_node(doc: Any, path: Node, value: Any) -> None:
    """Replace the node of ``doc`` at ``path`` with ``value``."""
    for p in path[:-1]:
        doc = doc[p]
    doc[path[-1]] = value


def random_bytes(max_length: int) -> Kind:
    """Random bytes instead of the document: 1 to ``max_length - 1`` of them."""

    def kind(raw: bytes, rng: random.Random, nodes: List[Node]) -> Damage:
        return "random bytes", bytes(rng.randrange(256) for _ in range(rng.randrange(1, max_length)))

    return kind


def truncated(raw: bytes, rng: random.Random, nodes: List[Node]) -> Damage:
    """The document cut short."""
    return "truncated", raw[: rng.randrange(len(raw))]


def flipped_byte(raw: bytes, rng: random.Random, nodes: List[Node]) -> Damage:
    """One byte of the document replaced by a random one."""
    damaged = bytearray(raw)
    damaged[rng.randrange(len(raw))] = rng.randrange(256)
    return "flipped byte", bytes(damaged)


def damaged_documents(raw: bytes, rng: random.Random, count: int, kinds: Sequence[Kind]) -> List[Damage]:
    """``count`` damaged copies of the JSON document ``raw``, the i-th by ``kinds[i % len(kinds)]``."""
    nodes = json_nodes(json.loads(raw))
    return [kinds[i % len(kinds)](raw, rng, nodes) for i in range(count)]
