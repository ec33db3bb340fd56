"""The worked examples of the documentation run as tests, so the docs cannot drift from the code."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from dist_ckpt.backends.registry import StrategyAction, unregister_strategy
from tests.paths import REPO_ROOT

EXAMPLES = REPO_ROOT / "docs" / "examples"


def _import(name: str):
    spec = importlib.util.spec_from_file_location(f"docs_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def custom_backend():
    module = _import("custom_backend")
    yield module
    unregister_strategy(StrategyAction.SAVE_SHARDED, "rawbin", 1)
    unregister_strategy(StrategyAction.LOAD_SHARDED, "rawbin", 1)


def test_custom_backend_example_round_trips(tmp_path, custom_backend):
    custom_backend.main(str(tmp_path))
    assert (tmp_path / "iter_10" / "rawbin").is_dir()


def test_custom_backend_example_reports_absent_keys(tmp_path, custom_backend):
    import torch

    import dist_ckpt as dc

    custom_backend.main(str(tmp_path))
    request = {"x": dc.ShardedTensor.from_rank_offsets("not_saved", torch.empty(2))}
    with pytest.raises(dc.KeyMismatchError, match="not_saved"):
        dc.load(request, tmp_path / "iter_10")
