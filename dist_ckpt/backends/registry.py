"""The registry of strategies, keyed by ``(action, backend, version)``.

Where strategies come from (nothing registers at import time):

1. [`register_default_strategy()`][dist_ckpt.backends.registry.register_default_strategy] calls made by the application;
2. the built-in table below (``"module:Class"`` strings imported on first use);
3. the entry-point group ``dist_ckpt.strategies``: an entry point named
   ``<action>.<backend>.<version>`` (e.g. ``load_sharded.mybackend.1``) pointing at a strategy
   class or factory.

A key has one default. Other built-in engines for the same on-disk format (TensorStore for
``("zarr", 1)``) are *alternatives*, listed by
[`alternative_strategies()`][dist_ckpt.backends.registry.alternative_strategies] and built by
[`get_alternative_strategy()`][dist_ckpt.backends.registry.get_alternative_strategy]; they are never chosen implicitly.
The engine looks backends up here and never imports a concrete one.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from enum import Enum
from importlib import metadata as importlib_metadata
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

from dist_ckpt.backends.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    LoadStrategyBase,
    SaveCommonStrategy,
    SaveShardedStrategy,
    SaveStrategyBase,
)
from dist_ckpt.errors import MissingDependencyError, StrategyRegistrationError, UnknownStrategyError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "dist_ckpt.strategies"

#: (backend, version) used by ``save`` when no sharded strategy is given
DEFAULT_SHARDED_BACKEND: Tuple[str, int] = ("safetensors", 1)
#: (backend, version) of the common state when no common strategy is given
DEFAULT_COMMON_BACKEND: Tuple[str, int] = ("torch", 1)


class StrategyAction(Enum):
    """Save vs load, sharded vs common."""

    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


@dataclass(frozen=True)
class StrategyKey:
    """Registry key: what the strategy does, and which on-disk format and version."""

    action: StrategyAction
    backend: str
    version: int

    def __str__(self) -> str:
        return f"{self.action.value}:{self.backend}:v{self.version}"


Strategy = Union[SaveStrategyBase, LoadStrategyBase]


StrategyFactory = Callable[[], Strategy]


_ACTION_BASES: Dict[StrategyAction, type] = {
    StrategyAction.SAVE_SHARDED: SaveShardedStrategy,
    StrategyAction.LOAD_SHARDED: LoadShardedStrategy,
    StrategyAction.SAVE_COMMON: SaveCommonStrategy,
    StrategyAction.LOAD_COMMON: LoadCommonStrategy,
}


@dataclass(frozen=True)
class _Builtin:
    target: str  # "module:attribute"
    extra: Optional[str]  # pip extra that provides the dependency, if any


def builtin_save_owned_paths() -> List[str]:
    """The top-level names (or patterns) that dist_ckpt's built-in save strategies write, of the
    backends whose dependencies are installed: what a save may clear after an interrupted save of
    another built-in backend (imports those strategies' modules; used only then)."""
    names: Set[str] = set()
    for key, builtin in _BUILTINS.items():
        if key.action not in (StrategyAction.SAVE_SHARDED, StrategyAction.SAVE_COMMON):
            continue
        try:
            factory = _load_builtin(key, builtin)
        except MissingDependencyError:
            continue
        names.update(getattr(factory, "owned_paths", ()))
    return sorted(names)


def _key(action: StrategyAction, backend: str, version: int) -> StrategyKey:
    return StrategyKey(action, backend, version)


_BUILTINS: Dict[StrategyKey, _Builtin] = {
    _key(StrategyAction.SAVE_COMMON, "torch", 1): _Builtin(
        "dist_ckpt.backends.torch_common.strategy:TorchCommonSaveStrategy", None
    ),
    _key(StrategyAction.LOAD_COMMON, "torch", 1): _Builtin(
        "dist_ckpt.backends.torch_common.strategy:TorchCommonLoadStrategy", None
    ),
    _key(StrategyAction.SAVE_SHARDED, "zarr", 1): _Builtin(
        "dist_ckpt.backends.zarr.zarr_python:ZarrSaveShardedStrategy", "zarr"
    ),
    _key(StrategyAction.LOAD_SHARDED, "zarr", 1): _Builtin(
        "dist_ckpt.backends.zarr.zarr_python:ZarrLoadShardedStrategy", "zarr"
    ),
    _key(StrategyAction.SAVE_SHARDED, "safetensors", 1): _Builtin(
        "dist_ckpt.backends.safetensors.strategy:SafetensorsSaveShardedStrategy", None
    ),
    _key(StrategyAction.LOAD_SHARDED, "safetensors", 1): _Builtin(
        "dist_ckpt.backends.safetensors.strategy:SafetensorsLoadShardedStrategy", None
    ),
    # Megatron-Core's format, on torch.distributed.checkpoint
    _key(StrategyAction.SAVE_SHARDED, "torch_dist", 1): _Builtin(
        "dist_ckpt.backends.torch_dist.save:TorchDistSaveShardedStrategy", None
    ),
    _key(StrategyAction.LOAD_SHARDED, "torch_dist", 1): _Builtin(
        "dist_ckpt.backends.torch_dist.load:TorchDistLoadShardedStrategy", None
    ),
    # plain DCP directories (read only): chosen for a folder with DCP's .metadata and no metadata.json
    _key(StrategyAction.LOAD_SHARDED, "dcp", 1): _Builtin(
        "dist_ckpt.backends.torch_dist.plain:DCPLoadShardedStrategy", None
    ),
    _key(StrategyAction.LOAD_COMMON, "dcp", 1): _Builtin(
        "dist_ckpt.backends.torch_dist.plain:DCPCommonLoadStrategy", None
    ),
    # HuggingFace folders (read only): chosen for a folder with HF weights and no metadata.json
    _key(StrategyAction.LOAD_SHARDED, "hf", 1): _Builtin("dist_ckpt.hf.strategy:HFLoadShardedStrategy", None),
    _key(StrategyAction.LOAD_COMMON, "hf", 1): _Builtin("dist_ckpt.hf.strategy:HFCommonLoadStrategy", None),
}


#: further built-in implementations of a key (other engines for the same on-disk format),
#: selectable by name; the default of each key stays in _BUILTINS
_ALTERNATIVES: Dict[StrategyKey, Dict[str, _Builtin]] = {
    _key(StrategyAction.SAVE_SHARDED, "zarr", 1): {
        "tensorstore": _Builtin(
            "dist_ckpt.backends.zarr.tensorstore_engine:TensorStoreSaveShardedStrategy", "tensorstore"
        )
    },
    _key(StrategyAction.LOAD_SHARDED, "zarr", 1): {
        "tensorstore": _Builtin(
            "dist_ckpt.backends.zarr.tensorstore_engine:TensorStoreLoadShardedStrategy", "tensorstore"
        )
    },
}


_registry: Dict[StrategyKey, Union[Strategy, StrategyFactory]] = {}


def register_default_strategy(
    action: StrategyAction,
    backend: str,
    version: int,
    strategy: Union[Strategy, StrategyFactory],
    override: bool = False,
) -> None:
    """Make ``strategy`` the default for ``(action, backend, version)``.

    Args:
        action: what the strategy does.
        backend: on-disk format name (recorded in ``metadata.json``).
        version: format version.
        strategy: a strategy instance (returned as-is by every lookup) or a zero-argument
            factory, such as the class itself (called on every lookup).
        override: replace an existing registration instead of raising.

    Example:

    ```python
    register_default_strategy(StrategyAction.LOAD_SHARDED, "mybackend", 1, MyLoadStrategy)
    ```
    """
    if not isinstance(action, StrategyAction):
        raise StrategyRegistrationError(f"action must be a StrategyAction, got {action!r}")
    if not isinstance(backend, str) or not backend:
        raise StrategyRegistrationError(f"backend must be a non-empty str, got {backend!r}")
    if not isinstance(version, int) or isinstance(version, bool):
        raise StrategyRegistrationError(f"version must be an int, got {version!r}")
    key = _key(action, backend, version)
    if not override and (key in _registry or key in _BUILTINS):
        raise StrategyRegistrationError(f"a strategy is already registered for {key}; pass override=True to replace it")
    if not isinstance(strategy, (SaveStrategyBase, LoadStrategyBase)) and not callable(strategy):
        raise StrategyRegistrationError(
            f"strategy for {key} must be a strategy instance or a factory, got {strategy!r}"
        )
    _registry[key] = strategy


def unregister_strategy(action: StrategyAction, backend: str, version: int) -> None:
    """Remove an application registration (built-ins and entry points stay available)."""
    _registry.pop(_key(action, backend, version), None)


def _entry_points() -> Dict[StrategyKey, importlib_metadata.EntryPoint]:
    found: Dict[StrategyKey, importlib_metadata.EntryPoint] = {}
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        action_name, _, rest = ep.name.partition(".")
        backend, _, version = rest.rpartition(".")
        try:
            found[_key(StrategyAction(action_name), backend, int(version))] = ep
        except ValueError:
            logger.warning(
                "ignoring entry point %r in group %r: its name must be <action>.<backend>.<version>",
                ep.name,
                ENTRY_POINT_GROUP,
            )
    return found


def registered_strategies() -> List[StrategyKey]:
    """Every key that [`get_default_strategy()`][dist_ckpt.backends.registry.get_default_strategy] can resolve,
    sorted."""
    keys = set(_registry) | set(_BUILTINS) | set(_entry_points())
    return sorted(keys, key=lambda k: (k.action.value, k.backend, k.version))


def _instantiate(key: StrategyKey, entry: Union[Strategy, StrategyFactory]) -> Strategy:
    if isinstance(entry, (SaveStrategyBase, LoadStrategyBase)):
        return entry
    strategy: Strategy = entry()
    if not isinstance(strategy, _ACTION_BASES[key.action]):
        raise UnknownStrategyError(
            f"the factory registered for {key} returned {type(strategy).__name__}, "
            f"not a {_ACTION_BASES[key.action].__name__}"
        )
    return strategy


def _load_builtin(key: StrategyKey, builtin: _Builtin) -> Any:
    module_name, _, attr = builtin.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = f": pip install 'dist_ckpt[{builtin.extra}]'" if builtin.extra else ""
        raise MissingDependencyError(
            f"the {key.backend!r} backend needs a package that is not installed ({e}){hint}"
        ) from e
    factory: StrategyFactory = getattr(module, attr)
    return factory


def register_builtin_strategies(backend: str, version: int = 1) -> List[StrategyKey]:
    """Register the built-in strategies of ``(backend, version)`` explicitly, replacing any
    application registration of their keys; returns the keys registered.

    Built-ins are resolved lazily without this; it exists for code that registers defaults the
    Megatron-Core way, and to restore a built-in after an override. Idempotent: each call
    registers the same classes again. Imports the backend's module (not an optional dependency
    of another backend).

    Raises:
        UnknownStrategyError: ``(backend, version)`` has no built-in strategy.
        MissingDependencyError: the backend's optional dependency is not installed.
    """
    keys = [k for k in _BUILTINS if (k.backend, k.version) == (backend, version)]
    if not keys:
        known = sorted({f"({k.backend!r}, {k.version})" for k in _BUILTINS})
        raise UnknownStrategyError(f"no built-in strategy for ({backend!r}, {version}); built-ins: {', '.join(known)}")
    for key in keys:
        _registry[key] = _load_builtin(key, _BUILTINS[key])
    return keys


def register_default_common_strategies() -> None:
    """Register the built-in common strategies ``("torch", 1)`` (Megatron-Core's function of
    this name; see `register_builtin_strategies()`).

    Example:

    ```python
    register_default_common_strategies()
    get_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1)   # TorchCommonSaveStrategy
    ```
    """
    register_builtin_strategies(*DEFAULT_COMMON_BACKEND)


def register_default_torch_strategies() -> None:
    """Register the built-in ``("torch_dist", 1)`` save and load strategies (Megatron-Core's
    function of this name; see `register_builtin_strategies()`).

    Example:

    ```python
    register_default_torch_strategies()
    get_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1)   # TorchDistLoadShardedStrategy
    ```
    """
    register_builtin_strategies("torch_dist", 1)


def get_default_strategy(action: StrategyAction, backend: str, version: int) -> Strategy:
    """The default strategy for ``(action, backend, version)``.

    Raises:
        UnknownStrategyError: nothing is registered for the key (the message lists what is).
        MissingDependencyError: a built-in backend whose optional dependency is missing.
    """
    key = _key(action, backend, version)
    if key in _registry:
        return _instantiate(key, _registry[key])
    if key in _BUILTINS:
        return _instantiate(key, _load_builtin(key, _BUILTINS[key]))
    entry_points = _entry_points()
    if key in entry_points:
        loaded: StrategyFactory = entry_points[key].load()
        return _instantiate(key, loaded)
    same_backend = [str(k) for k in registered_strategies() if k.backend == backend and k.action == action]
    listing = ", ".join(str(k) for k in registered_strategies())
    detail = f" ({backend!r} is registered for: {', '.join(same_backend)})" if same_backend else ""
    raise UnknownStrategyError(f"no strategy registered for {key}{detail}. Registered: {listing}")


def alternative_strategies(action: StrategyAction, backend: str, version: int) -> List[str]:
    """Names of the built-in alternatives to the default strategy of ``(action, backend, version)``:
    other engines for the same on-disk format (e.g. ``"tensorstore"`` for ``("zarr", 1)``).

    Listing imports nothing. Example:

    ```python
    alternative_strategies(StrategyAction.LOAD_SHARDED, "zarr", 1)   # ['tensorstore']
    ```
    """
    return sorted(_ALTERNATIVES.get(_key(action, backend, version), {}))


def get_alternative_strategy(action: StrategyAction, backend: str, version: int, name: str) -> Strategy:
    """A new instance of the built-in alternative ``name`` for ``(action, backend, version)``.

    Raises:
        UnknownStrategyError: no alternative of that name (the message lists the known ones).
        MissingDependencyError: its optional dependency is missing (names the pip extra).
    """
    key = _key(action, backend, version)
    alternatives = _ALTERNATIVES.get(key, {})
    if name not in alternatives:
        raise UnknownStrategyError(
            f"no alternative strategy {name!r} for {key}; known alternatives: {sorted(alternatives) or 'none'}"
        )
    return _instantiate(key, _load_builtin(key, alternatives[name]))


StrategySpec = Union[Strategy, Tuple[str, int], StrategyKey, None]


def resolve_strategy(spec: StrategySpec, action: StrategyAction, default: Tuple[str, int]) -> Strategy:
    """Turn what a caller passed (None, ``(backend, version)``, a key, a strategy) into a strategy."""
    base = _ACTION_BASES[action]
    if spec is None:
        return get_default_strategy(action, *default)
    if isinstance(spec, StrategyKey):
        return get_default_strategy(spec.action, spec.backend, spec.version)
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str):
        return get_default_strategy(action, spec[0], int(spec[1]))
    if isinstance(spec, base):
        return spec
    raise UnknownStrategyError(
        f"expected a {base.__name__}, a (backend, version) tuple or None for {action.value}, got {spec!r}"
    )


__all__ = [
    "ENTRY_POINT_GROUP",
    "Strategy",
    "StrategyAction",
    "StrategyFactory",
    "StrategyKey",
    "StrategySpec",
    "alternative_strategies",
    "builtin_save_owned_paths",
    "get_alternative_strategy",
    "get_default_strategy",
    "register_builtin_strategies",
    "register_default_common_strategies",
    "register_default_strategy",
    "register_default_torch_strategies",
    "registered_strategies",
    "resolve_strategy",
    "unregister_strategy",
]
