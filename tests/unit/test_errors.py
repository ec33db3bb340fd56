"""Unit tests of dist_ckpt.errors: one exception family, each also its matching builtin."""

from __future__ import annotations

import pytest

import dist_ckpt
from dist_ckpt import errors
from dist_ckpt.errors import CheckpointingException, KeyMismatchError, format_keys, with_rank

BUILTIN_OF = {
    "ArgumentTypeError": TypeError,
    "ShardingIntegrityError": ValueError,
    "InvalidShardedTensorError": ValueError,
    "StateDictStructureError": ValueError,
    "KeyMismatchError": KeyError,
    "LoadMismatchError": ValueError,
    "ShardedObjectLayoutError": ValueError,
    "NotACheckpointError": FileNotFoundError,
    "CheckpointExistsError": FileExistsError,
    "CorruptCheckpointError": ValueError,
    "UnknownStrategyError": ValueError,
    "IncompatibleStrategyError": ValueError,
    "MissingDependencyError": ImportError,
    "InvalidKeyError": ValueError,
}


@pytest.mark.parametrize("name, builtin", sorted(BUILTIN_OF.items()))
def test_family(name, builtin):
    cls = getattr(errors, name)
    assert getattr(dist_ckpt, name) is cls
    assert issubclass(cls, CheckpointingException) and issubclass(cls, builtin)


@pytest.mark.parametrize("name", ["UnsafeObjectError", "RankFailedError"])
def test_family_without_builtin(name):
    assert issubclass(getattr(errors, name), CheckpointingException)


def test_key_mismatch_error():
    e = KeyMismatchError("keys 'b' differ", missing_keys={"z", "a"}, unexpected_keys=["y"])
    # not the quoted KeyError form; Megatron-Core's words with the keys are added (callers match on them)
    assert str(e) == "keys 'b' differ (Unexpected keys: ['y']; Missing keys: ['a', 'z'])"
    assert e.missing_keys == ["a", "z"] and e.unexpected_keys == ["y"]
    assert KeyMismatchError("m").missing_keys == [] and str(KeyMismatchError("m")) == "m"
    # a message that already says them is kept as it is
    said = "Unexpected keys (requested but absent): ['y']"
    assert str(KeyMismatchError(said, unexpected_keys=["y"])) == said


def test_format_keys():
    assert format_keys(["b", "a"]) == "['a', 'b']"
    assert format_keys([]) == "[]"
    many = format_keys([f"k{i:02d}" for i in range(25)], limit=20)
    assert "'k19'" in many and "'k20'" not in many and "(5 more)" in many


def test_with_rank():
    assert with_rank("msg", None) == "msg"
    assert with_rank("msg", 3) == "[rank 3] msg"


def test_counted_says_one_thing_in_the_singular():
    from dist_ckpt.errors import counted

    assert counted(1, "file") == "1 file" and counted(0, "file") == "0 files" and counted(2, "rank") == "2 ranks"
    assert counted(1, "entry", "entries") == "1 entry" and counted(3, "entry", "entries") == "3 entries"
    assert counted(1_000_000, "byte") == "1,000,000 bytes"


def test_with_article_says_an_before_a_vowel():
    from dist_ckpt.errors import with_article

    assert with_article("AdamW") == "an AdamW" and with_article("int") == "an int"
    assert with_article("dict") == "a dict" and with_article("Tensor") == "a Tensor"
