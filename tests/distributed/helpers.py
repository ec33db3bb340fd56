"""Helpers for multi-rank tests: agree on outcomes so no rank runs ahead into a collective."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Type

import pytest
import torch
import torch.distributed as dist

from dist_ckpt.backends.base import LoadShardedStrategy, SaveShardedStrategy
from dist_ckpt.backends.registry import (
    StrategyAction,
    alternative_strategies,
    get_alternative_strategy,
    get_default_strategy,
    registered_strategies,
)


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


@dataclass(frozen=True)
class StrategyCombo:
    """A (save strategy, load strategy) pair that every conformance test runs with.

    Factories, not instances: each test gets fresh strategies (wrappers hold per-load state).
    ``any_replica_writes``: the saver may write any replica of a shard, not only the main one,
    so replicas must hold identical data (true of data parallelism; see fully_parallel).
    """

    name: str
    save: Callable[[], SaveShardedStrategy]
    load: Callable[[], LoadShardedStrategy]
    any_replica_writes: bool = False


def _default(action: StrategyAction, backend: str, version: int) -> Callable[[], object]:
    return lambda: get_default_strategy(action, backend, version)


def _alternative(action: StrategyAction, backend: str, version: int, name: str) -> Optional[Callable[[], object]]:
    try:
        get_alternative_strategy(action, backend, version, name)
    except Exception:  # noqa: BLE001 -- an engine whose dependency is missing is not tested
        return None
    return lambda: get_alternative_strategy(action, backend, version, name)


def _wrappers(tag: str, save: Callable[[], object], load: Callable[[], object]) -> List[StrategyCombo]:
    from dist_ckpt.parallel.fully_parallel import FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper
    from dist_ckpt.parallel.two_stage import TwoStageDataParallelLoadShardedStrategy

    return [
        # base_strategy=None: the two-stage loader wraps whatever is registered for the backend
        StrategyCombo(f"{tag}:default->two_stage", save, lambda: TwoStageDataParallelLoadShardedStrategy(None)),  # type: ignore[arg-type]
        StrategyCombo(
            f"{tag}:fully_parallel->default",
            lambda: FullyParallelSaveStrategyWrapper(save()),
            load,
            any_replica_writes=True,
        ),  # type: ignore[arg-type]
        StrategyCombo(f"{tag}:default->fully_parallel", save, lambda: FullyParallelLoadStrategyWrapper(load())),  # type: ignore[arg-type]
    ]


def strategy_combinations() -> List[StrategyCombo]:
    """Every pair that must interoperate, built from the registry (a new backend is picked up
    without editing this list): for each registered backend its default saver and loader; each
    built-in alternative engine against the default one, both ways; and the two-stage and
    fully-parallel wrappers around the defaults."""
    combos: List[StrategyCombo] = []
    for backend, version in backend_pairs():
        tag = f"{backend}-v{version}"
        save = _default(StrategyAction.SAVE_SHARDED, backend, version)
        load = _default(StrategyAction.LOAD_SHARDED, backend, version)
        combos.append(StrategyCombo(tag, save, load))  # type: ignore[arg-type]
        for name in alternative_strategies(StrategyAction.SAVE_SHARDED, backend, version):
            alt = _alternative(StrategyAction.SAVE_SHARDED, backend, version, name)
            if alt is not None:
                combos.append(StrategyCombo(f"{tag}:{name}->default", alt, load))  # type: ignore[arg-type]
        for name in alternative_strategies(StrategyAction.LOAD_SHARDED, backend, version):
            alt = _alternative(StrategyAction.LOAD_SHARDED, backend, version, name)
            if alt is not None:
                combos.append(StrategyCombo(f"{tag}:default->{name}", save, alt))  # type: ignore[arg-type]
        combos.extend(_wrappers(tag, save, load))
    return combos


def combo_named(name: str) -> StrategyCombo:
    """The combination called ``name`` (for spawned jobs, which rebuild it from its name)."""
    return next(c for c in strategy_combinations() if c.name == name)


def slow_write(delay_s: float, fn: Callable[..., object], *args: object) -> object:
    """An async_fn that waits ``delay_s`` before running ``fn`` (runs in the writer process)."""
    import time

    time.sleep(delay_s)
    return fn(*args)
