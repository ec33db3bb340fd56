"""tests/deadlines.py: the one scale of the tests' wall-clock bounds."""

from __future__ import annotations

import pytest

from tests.deadlines import DEFAULT_SCALE, SCALE_ENV, scaled, time_scale


def test_the_default_scale_is_generous(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SCALE_ENV, raising=False)
    assert time_scale() == DEFAULT_SCALE >= 2
    assert scaled(60) == 60 * DEFAULT_SCALE


def test_the_environment_sets_the_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SCALE_ENV, "10")
    assert scaled(60) == 600
    monkeypatch.setenv(SCALE_ENV, " 0.5 ")
    assert scaled(60) == 30


@pytest.mark.parametrize("value", ["0", "-1", "fast", "inf", "nan"])
def test_a_bad_scale_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(SCALE_ENV, value)
    with pytest.raises(ValueError, match=SCALE_ENV):
        time_scale()
