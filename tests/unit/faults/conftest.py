"""Print the fault-injection scoreboard (tests/unit/faults/tally.py) at the end of the run."""

from __future__ import annotations

from typing import Any

from tests.unit.faults import tally


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if tally.ROWS:
        terminalreporter.write_sep("=", "fault injection: outcome of every attempt")
        terminalreporter.write_line(tally.table())
