"""A fault at the write calls of a conversion (``dist-ckpt convert``), whose stream writers write
tensor by tensor: raised (a failing disk) or a kill (no cleanup at all).

The source is a committed safetensors checkpoint; each attempt converts it to zarr or torch_dist
with one write call failing (tests/unit/faults/inject.py; kills: every second call). Each attempt
must leave the source untouched, commit nothing partial, leave no partial data under a final name
(a ``zarr/`` tree without its manifest, a ``.distcp`` file shorter than a whole one) and, when
the conversion raised, nothing at all in the destination; a typed error or the injected OSError
itself passes. The outcomes go to the suite's scoreboard.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, List, Optional

import pytest

import dist_ckpt as dc
from dist_ckpt.errors import NotACheckpointError
from dist_ckpt.tools.convert import convert

from . import tally
from .inject import InjectedFault, Injector, attack_points
from .scenario import DataLost, Run, SilentWrong, check_loads, fingerprint, kill_at, raise_at
from .scenario import _no_partial_data_under_final_names as no_partial_data
from .scenario import _nothing_left as nothing_left

TARGETS = ["zarr", "torch_dist"]


class _Conversions(Run):
    """A committed ``iter_1`` (safetensors) to convert, and a complete conversion of it to
    compare the sizes of DCP files with."""

    def __init__(self, root: Path, to: str) -> None:
        super().__init__(root, "safetensors")
        self.to = to
        self.reference = root / "reference"
        convert(self.previous, self.reference, to=to)

    def convert(self, target: Path) -> None:
        convert(self.previous, target, to=self.to)

    def check_after(self, target: Path, error: Optional[BaseException]) -> None:
        if error is not None and not tally.is_typed(error, InjectedFault):
            raise error
        if fingerprint(self.previous) != self.before:
            raise DataLost(f"{self.previous} changed while converting it to {target}")
        if (target / "metadata.json").exists():  # the fault came after the commit
            check_loads(target, 1.0)
            if not dc.verify_checkpoint(target).ok:
                raise SilentWrong(f"{target} is committed but verify finds problems")
        else:
            no_partial_data(target, self.reference)
            if error is not None:
                nothing_left(target)
            try:
                dc.load({}, target)
            except NotACheckpointError:
                pass
            else:
                raise SilentWrong(f"{target} loaded although it was never committed")
        shutil.rmtree(target, ignore_errors=True)


def _points(run: _Conversions) -> List[int]:
    with Injector() as injector:
        run.convert(run.root / "count")
    return attack_points(injector.calls)


@pytest.mark.parametrize("to", TARGETS)
def test_raised_io_error_at_every_write_of_a_conversion(tmp_path: Path, to: str) -> None:
    run = _Conversions(tmp_path, to)
    row = f"raise at each write, conversion to {to}"
    for at in _points(run):
        tally.attempt(row, f"write call {at}", raise_at(run, at, run.convert))
    tally.assert_clean(row)


@pytest.mark.parametrize("to", TARGETS)
def test_kill_at_every_write_of_a_conversion(tmp_path: Path, to: str) -> None:
    run = _Conversions(tmp_path, to)
    row = f"kill at each write, conversion to {to}"
    points: Any = _points(run)[::2]
    for at in points:
        tally.attempt(row, f"write call {at}", kill_at(run, at, run.convert))
    tally.assert_clean(row)
