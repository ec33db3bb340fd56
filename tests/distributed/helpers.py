"""Helpers for multi-rank tests: agree on outcomes so no rank runs ahead into a collective."""

from __future__ import annotations

from typing import Callable, List, Tuple, Type

import pytest
import torch
import torch.distributed as dist

from dist_ckpt.strategies.base import StrategyAction, get_default_strategy, registered_strategies


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def assert_on_all_ranks(ok: bool, message: str = "") -> None:
    """Fail on every rank if ``ok`` is False on any rank (each reports its own message)."""
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    if int(flag.item()):
        pytest.fail(f"check failed on {int(flag.item())} rank(s); rank {rank()}: {'ok' if ok else message}")


def raises_on_all_ranks(exc_type: Type[BaseException], fn: Callable[[], object], match: str = "") -> BaseException:
    """Run ``fn`` (a collective) and require that it raises ``exc_type`` on every rank."""
    caught = None
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        caught = e
    ok = isinstance(caught, exc_type) and (not match or match in str(caught))
    assert_on_all_ranks(ok, f"expected {exc_type.__name__} matching {match!r}, got {caught!r}")
    assert caught is not None
    return caught


def backend_pairs() -> List[Tuple[str, int]]:
    """(backend, version) of every registered sharded backend that can both save and load."""
    keys = registered_strategies()
    saves = {(k.backend, k.version) for k in keys if k.action == StrategyAction.SAVE_SHARDED}
    loads = {(k.backend, k.version) for k in keys if k.action == StrategyAction.LOAD_SHARDED}
    usable = []
    for pair in sorted(saves & loads):
        try:
            get_default_strategy(StrategyAction.SAVE_SHARDED, *pair)
            get_default_strategy(StrategyAction.LOAD_SHARDED, *pair)
        except Exception:  # noqa: BLE001 -- a backend whose dependency is missing is not tested
            continue
        usable.append(pair)
    return usable
