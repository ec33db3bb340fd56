"""The one JSON reader of checkpoint metadata: caps, strict decoding, typed field checks."""

from __future__ import annotations

import json

import pytest

from dist_ckpt.errors import CorruptCheckpointError
from dist_ckpt.integrity.safe_json import (
    MAX_DEPTH,
    check_tensor_bytes,
    json_depth,
    loads,
    read_json,
    shown,
    want_int,
    want_ints,
    want_object,
    want_str_map,
)


@pytest.mark.parametrize(
    "raw, depth",
    [
        (b"1", 0),
        (b'{"a": [[1], "]]"]}', 3),
        (b'"[[[[" ', 0),
        (b'["\\"[[", [[]]]', 3),
        (b"[" * 70 + b"]" * 70, 70),
        (b'{"k": "' + b"[" * 100 + b'"}', 1),
    ],
)
def test_depth_ignores_brackets_in_strings(raw, depth):
    assert json_depth(raw) == depth


@pytest.mark.parametrize(
    "raw, problem",
    [
        (b"[" * 100_000, "nests"),  # json would raise RecursionError
        (b'{"a": ' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1), "nests"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"a": NaN}', "not valid JSON"),
        (b'{"a": Infinity}', "not valid JSON"),
        (b"1" * 5000, "not valid JSON"),  # beyond Python's int-from-string limit
        (b'{"a": 1', "not valid JSON"),
    ],
)
def test_malformed_documents_raise_our_error_naming_the_file(raw, problem):
    with pytest.raises(CorruptCheckpointError, match=problem) as info:
        loads(raw, "ckpt/x.json")
    assert "ckpt/x.json" in str(info.value)


def test_size_cap_is_checked_before_reading(tmp_path):
    path = tmp_path / "big.json"
    path.write_bytes(b" " * 2000 + b"{}")
    with pytest.raises(CorruptCheckpointError, match="2002 bytes"):
        read_json(path, max_bytes=1000)
    assert read_json(path, max_bytes=4000) == {}
    assert read_json(tmp_path / "absent.json") is None
    with pytest.raises(CorruptCheckpointError, match="directory"):
        read_json(tmp_path)


def test_a_document_at_the_depth_limit_parses():
    raw = json.dumps(json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH)).encode()
    assert json_depth(raw) == MAX_DEPTH
    assert loads(raw, "x") is not None


def test_field_checks_name_the_field_and_bound_the_value_shown():
    with pytest.raises(CorruptCheckpointError, match="f.json: 'shape' must be a list of ints >= 0"):
        want_ints([1, True], "f.json: 'shape'")
    with pytest.raises(CorruptCheckpointError, match="of length 2"):
        want_ints([1, 2, 3], "f", length=2)
    with pytest.raises(CorruptCheckpointError, match="must be a JSON object"):
        want_object([], "f")
    with pytest.raises(CorruptCheckpointError):
        want_int(2**70, "f")
    with pytest.raises(CorruptCheckpointError):
        want_str_map({"a": 1}, "f")
    assert want_ints([0, 3], "f") == (0, 3)
    assert len(shown(list(range(10**6)))) < 100
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    assert len(shown(deep)) < 100  # repr() itself would recurse 5000 levels


def test_tensor_sizes_that_overflow_are_refused_before_allocation():
    assert check_tensor_bytes((1024, 512), 2, "w") == 1 << 20
    with pytest.raises(CorruptCheckpointError, match="more than any tensor can hold"):
        check_tensor_bytes((2**40, 2**40), 4, "index.json (tensor 'w')")
