"""Fixtures of the torch_dist backend's tests."""

from __future__ import annotations

import subprocess
from typing import Callable

import pytest

from dist_ckpt.cli import main

#: runs ``dist-ckpt ARGS...`` and returns its exit status and output, like subprocess.run
Cli = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Cli:
    """``dist-ckpt`` run in this process (``dist_ckpt.cli.main``): the commands' code and output
    are the same as the console script's, without starting an interpreter and importing torch
    for each command (about 4 s each on the 2-core test VM). The entry point itself is tested in
    tests/unit/cli/test_cli_entry_point.py."""

    def run(*args: str) -> "subprocess.CompletedProcess[str]":
        capsys.readouterr()  # drop what came before
        code = main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["dist-ckpt", *args], code, out.out, out.err)

    return run
