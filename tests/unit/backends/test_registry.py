"""Unit tests of dist_ckpt.backends.base: base classes and the strategy registry.

A complete custom backend ("torchfiles": one ``torch.save`` file per rank, resharding of whole
tensors on load) is defined here and round-tripped through ``dist_ckpt.save`` / ``load``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
import sys
import uuid
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.asynchronous.queue import AsyncRequest
from dist_ckpt.backends import registry
from dist_ckpt.backends.base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    LoadStrategyBase,
    SaveCommonStrategy,
    SaveShardedStrategy,
    SaveStrategyBase,
)
from dist_ckpt.backends.registry import (
    ENTRY_POINT_GROUP,
    StrategyAction,
    StrategyKey,
    get_default_strategy,
    register_default_strategy,
    registered_strategies,
    resolve_strategy,
    unregister_strategy,
)
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import (
    CheckpointingException,
    IncompatibleStrategyError,
    MissingDependencyError,
    StrategyRegistrationError,
    UnknownStrategyError,
)
from dist_ckpt.model.dict_utils import dict_list_map_inplace, nested_values
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor, is_main_replica

A = StrategyAction


# --------------------------------------------------------------------------- a custom backend


def _overlap(a_off, a_shape, b_off, b_shape):
    """Per-axis (lo, hi) of the overlap of two boxes, or None."""
    out = []
    for ao, asz, bo, bsz in zip(a_off, a_shape, b_off, b_shape):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        out.append((lo, hi))
    return out


class TorchFilesSave(SaveShardedStrategy):
    """Writes this rank's main-replica shards into ``torchfiles/rank<r>.pt``."""

    owned_paths = ("torchfiles",)

    def __init__(self, backend: str = "torchfiles", version: int = 1) -> None:
        super().__init__(backend, version)

    def save(self, sharded_state_dict, checkpoint_dir):
        records = []
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id):
                if sh.flattened_range is not None:
                    raise CheckpointingException(f"{self} does not save flattened shards ({sh.key!r})")
                records.append(
                    {
                        "key": sh.key,
                        "global_shape": list(sh.global_shape),
                        "global_offset": list(sh.global_offset),
                        "data": sh.data.detach().cpu().clone().reshape(sh.full_local_shape),
                    }
                )
        directory = Path(checkpoint_dir) / "torchfiles"
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(records, directory / f"rank{get_rank()}.pt")


class TorchFilesLoad(LoadShardedStrategy):
    """Loads any box of any stored tensor by copying the overlapping parts of stored shards."""

    supported_backends = ("torchfiles",)
    supported_versions = (1,)

    @staticmethod
    def _records(checkpoint_dir) -> Dict[str, List[Dict[str, Any]]]:
        by_key: Dict[str, List[Dict[str, Any]]] = {}
        for f in sorted((Path(checkpoint_dir) / "torchfiles").glob("rank*.pt")):
            for rec in torch.load(f, weights_only=True):
                by_key.setdefault(rec["key"], []).append(rec)
        return by_key

    def load(self, sharded_state_dict, checkpoint_dir):
        by_key = self._records(checkpoint_dir)

        def load_one(sh):
            if not isinstance(sh, ShardedTensor):
                return sh
            if sh.key not in by_key:
                raise dc.KeyMismatchError(f"{sh.key!r} not stored", unexpected_keys=[sh.key])
            out = torch.zeros(sh.full_local_shape, dtype=sh.dtype)
            for rec in by_key[sh.key]:
                stored = rec["data"]
                ov = _overlap(sh.global_offset, sh.full_local_shape, rec["global_offset"], stored.shape)
                if ov is None:
                    continue
                dst = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(ov, sh.global_offset))
                src = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(ov, rec["global_offset"]))
                out[dst] = stored[src]
            return out.reshape(sh.local_shape)

        return dict_list_map_inplace(load_one, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir):
        out = {}
        for key, recs in self._records(checkpoint_dir).items():
            meta = torch.empty(recs[0]["global_shape"], dtype=recs[0]["data"].dtype, device="meta")
            out[key] = ShardedTensor.from_rank_offsets(key, meta)
        return out


class EpFilesSave(TorchFilesSave):
    def __init__(self) -> None:
        super().__init__("epfiles", 2)


class EpFilesLoad(TorchFilesLoad):
    supported_backends = ("epfiles",)
    supported_versions = (2,)


class AsyncFilesSave(AsyncSaveShardedStrategy):
    def __init__(self) -> None:
        super().__init__("torchfiles", 1)
        self.calls: List[str] = []

    def async_save(self, sharded_state_dict, checkpoint_dir):
        self.calls.append("async_save")
        return AsyncRequest(TorchFilesSave().save, (sharded_state_dict, checkpoint_dir))


@pytest.fixture(autouse=True)
def clean_registry():
    """Undo every registration a test makes (with unregister_strategy)."""
    before = dict(registry._registry)
    yield
    for key in list(registry._registry):
        if key not in before:
            unregister_strategy(key.action, key.backend, key.version)
    for key, value in before.items():
        register_default_strategy(key.action, key.backend, key.version, value, override=True)
    assert registry._registry == before


@pytest.fixture
def torchfiles():
    register_default_strategy(A.SAVE_SHARDED, "torchfiles", 1, TorchFilesSave)
    register_default_strategy(A.LOAD_SHARDED, "torchfiles", 1, TorchFilesLoad)


def _global(shape=(8, 6), dtype=torch.float32):
    return torch.arange(shape[0] * shape[1], dtype=torch.float64).reshape(shape).to(dtype)


def _four_rank_state(w, v):
    sd = {}
    for r in range(4):
        sd[f"rank{r}"] = {
            "w": ShardedTensor.from_rank_offsets("w", w.chunk(4, 0)[r].clone(), (0, r, 4)),
            "v": ShardedTensor.from_rank_offsets("v", v.chunk(2, 1)[r % 2].clone(), (1, r % 2, 2), replica_id=r // 2),
        }
    sd["obj"] = ShardedObject("obj", {"hello": [1, 2]}, (1,), (0,))
    sd["step"] = 11
    return sd


# --------------------------------------------------------------------------- custom backend round trip


class TestCustomBackend:
    def test_round_trip_with_resharding(self, tmp_path, torchfiles):
        w, v = _global(), _global((4, 6), torch.bfloat16)
        dc.save(_four_rank_state(w, v), tmp_path / "c", sharded_strategy=("torchfiles", 1))
        assert sorted(p.name for p in (tmp_path / "c" / "torchfiles").iterdir()) == ["rank0.pt"]
        meta = json.loads((tmp_path / "c" / "metadata.json").read_text())
        assert (meta["sharded_backend"], meta["sharded_backend_version"]) == ("torchfiles", 1)

        # the loader comes from the registry, chosen by metadata.json
        req = {
            "half0": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6), (0, 0, 2)),
            "half1": ShardedTensor.from_rank_offsets("w", torch.empty(4, 6), (0, 1, 2)),
            "v_whole": ShardedTensor.from_rank_offsets("v", torch.empty(4, 6, dtype=torch.bfloat16)),
            "obj": ShardedObject("obj", None, (1,), (0,)),
        }
        out = dc.load(req, tmp_path / "c")
        assert torch.equal(torch.cat([out["half0"], out["half1"]]), w)
        assert torch.equal(out["v_whole"], v)
        assert out["obj"] == {"hello": [1, 2]}
        assert out["step"] == 11

        assert dc.load_tensors_metadata(tmp_path / "c")["w"].global_shape == (8, 6)
        plain = dc.load_plain_tensors(tmp_path / "c")
        assert torch.equal(plain["w"], w) and torch.equal(plain["v"], v)

    def test_strategy_objects_passed_directly(self, tmp_path):
        w, v = _global(), _global((4, 6))
        dc.save(_four_rank_state(w, v), tmp_path / "c", sharded_strategy=TorchFilesSave())
        req = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 6))}
        # nothing registered: the caller passes the loader
        with pytest.raises(UnknownStrategyError):
            dc.load(req, tmp_path / "c")
        out = dc.load(req, tmp_path / "c", sharded_strategy=TorchFilesLoad())
        assert torch.equal(out["w"], w)

    def test_loader_checks_compatibility(self, tmp_path, torchfiles):
        dc.save(
            {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))},
            tmp_path / "c",
            sharded_strategy=("torchfiles", 1),
        )
        req = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(2))}
        with pytest.raises(IncompatibleStrategyError, match="epfiles|torchfiles") as info:
            dc.load(req, tmp_path / "c", sharded_strategy=EpFilesLoad())
        assert str(tmp_path / "c") in str(info.value)

    def test_async_strategy(self, tmp_path):
        strategy = AsyncFilesSave()
        w = _global()
        request = dc.save(
            {"w": ShardedTensor.from_rank_offsets("w", w.clone())},
            tmp_path / "c",
            sharded_strategy=strategy,
            async_sharded_save=True,
        )
        assert isinstance(request, AsyncRequest)
        assert not (tmp_path / "c" / "metadata.json").exists()  # not committed before the write ran
        assert not dc.check_is_distributed_checkpoint(tmp_path / "c")
        request.execute_sync()
        assert dc.check_is_distributed_checkpoint(tmp_path / "c")
        out = dc.load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 6))},
            tmp_path / "c",
            sharded_strategy=TorchFilesLoad(),
        )
        assert torch.equal(out["w"], w)
        # used synchronously, an async strategy goes through async_save too
        strategy.save({"w": ShardedTensor.from_rank_offsets("w", w.clone())}, tmp_path / "d")
        assert strategy.calls == ["async_save", "async_save"]
        assert (tmp_path / "d" / "torchfiles" / "rank0.pt").is_file()

    def test_async_needs_async_strategy(self, tmp_path):
        with pytest.raises(CheckpointingException, match="AsyncSaveShardedStrategy"):
            dc.save(
                {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))},
                tmp_path / "c",
                sharded_strategy=TorchFilesSave(),
                async_sharded_save=True,
            )
        assert not (tmp_path / "c" / "metadata.json").exists()


# --------------------------------------------------------------------------- registry


class TestRegistry:
    def test_unknown_backend_lists_registered(self):
        with pytest.raises(UnknownStrategyError) as info:
            get_default_strategy(A.LOAD_SHARDED, "nope", 1)
        msg = str(info.value)
        assert "load_sharded:nope:v1" in msg
        for key in registered_strategies():
            assert str(key) in msg
        assert "load_sharded:zarr:v1" in msg and "save_common:torch:v1" in msg

    def test_unknown_version_names_known_versions(self):
        with pytest.raises(UnknownStrategyError, match=r"'zarr' is registered for: load_sharded:zarr:v1"):
            get_default_strategy(A.LOAD_SHARDED, "zarr", 99)

    def test_registered_listing_includes_new_keys(self, torchfiles):
        keys = registered_strategies()
        assert StrategyKey(A.SAVE_SHARDED, "torchfiles", 1) in keys
        assert StrategyKey(A.LOAD_COMMON, "torch", 1) in keys
        assert keys == sorted(keys, key=lambda k: (k.action.value, k.backend, k.version))
        with pytest.raises(UnknownStrategyError, match="save_sharded:torchfiles:v1"):
            get_default_strategy(A.SAVE_SHARDED, "missing", 3)

    def test_builtins(self):
        from dist_ckpt.backends.torch_common.strategy import TorchCommonLoadStrategy, TorchCommonSaveStrategy

        assert isinstance(get_default_strategy(A.SAVE_COMMON, "torch", 1), TorchCommonSaveStrategy)
        assert isinstance(get_default_strategy(A.LOAD_COMMON, "torch", 1), TorchCommonLoadStrategy)
        save = get_default_strategy(A.SAVE_SHARDED, "zarr", 1)
        assert (save.backend, save.version) == ("zarr", 1)
        assert type(save).__name__ == "ZarrSaveShardedStrategy"
        assert type(get_default_strategy(A.LOAD_SHARDED, "zarr", 1)).__name__ == "ZarrLoadShardedStrategy"

    def test_duplicate_raises_unless_override(self, torchfiles):
        with pytest.raises(StrategyRegistrationError, match="override=True"):
            register_default_strategy(A.SAVE_SHARDED, "torchfiles", 1, TorchFilesSave)
        instance = TorchFilesSave()
        register_default_strategy(A.SAVE_SHARDED, "torchfiles", 1, instance, override=True)
        assert get_default_strategy(A.SAVE_SHARDED, "torchfiles", 1) is instance

    def test_builtin_cannot_be_shadowed_silently(self):
        with pytest.raises(StrategyRegistrationError, match="save_sharded:zarr:v1"):
            register_default_strategy(A.SAVE_SHARDED, "zarr", 1, TorchFilesSave)
        register_default_strategy(A.SAVE_SHARDED, "zarr", 1, TorchFilesSave, override=True)
        assert isinstance(get_default_strategy(A.SAVE_SHARDED, "zarr", 1), TorchFilesSave)
        unregister_strategy(A.SAVE_SHARDED, "zarr", 1)
        assert type(get_default_strategy(A.SAVE_SHARDED, "zarr", 1)).__name__ == "ZarrSaveShardedStrategy"

    def test_instance_vs_factory(self):
        instance = TorchFilesLoad()
        register_default_strategy(A.LOAD_SHARDED, "inst", 1, instance)
        assert get_default_strategy(A.LOAD_SHARDED, "inst", 1) is instance
        assert get_default_strategy(A.LOAD_SHARDED, "inst", 1) is instance
        calls = []

        def factory():
            calls.append(1)
            return TorchFilesLoad()

        register_default_strategy(A.LOAD_SHARDED, "fact", 1, factory)
        assert calls == []  # registration does not build anything
        s1 = get_default_strategy(A.LOAD_SHARDED, "fact", 1)
        s2 = get_default_strategy(A.LOAD_SHARDED, "fact", 1)
        assert isinstance(s1, TorchFilesLoad) and s1 is not s2 and len(calls) == 2
        register_default_strategy(A.LOAD_SHARDED, "cls", 1, TorchFilesLoad)
        assert get_default_strategy(A.LOAD_SHARDED, "cls", 1) is not get_default_strategy(A.LOAD_SHARDED, "cls", 1)

    def test_factory_of_wrong_kind(self):
        register_default_strategy(A.SAVE_SHARDED, "wrong", 1, TorchFilesLoad)
        with pytest.raises(UnknownStrategyError, match="save_sharded:wrong:v1"):
            get_default_strategy(A.SAVE_SHARDED, "wrong", 1)

    def test_bad_registrations(self):
        with pytest.raises(StrategyRegistrationError, match="StrategyAction"):
            register_default_strategy("save_sharded", "x", 1, TorchFilesSave)  # type: ignore[arg-type]
        with pytest.raises(StrategyRegistrationError, match="save_sharded:x:v1"):
            register_default_strategy(A.SAVE_SHARDED, "x", 1, "not a strategy")  # type: ignore[arg-type]

    @pytest.mark.parametrize("backend, version", [(5, 1), (None, 1), ("ok", "1"), ("ok", 1.5)])
    def test_bad_backend_or_version_rejected(self, backend, version):
        """A malformed key must be refused up front, not poison every later registry listing."""
        with pytest.raises(StrategyRegistrationError):
            register_default_strategy(A.SAVE_SHARDED, backend, version, TorchFilesSave)
        assert StrategyKey(A.SAVE_SHARDED, "zarr", 1) in registered_strategies()

    def test_unregister(self, torchfiles):
        unregister_strategy(A.SAVE_SHARDED, "torchfiles", 1)
        with pytest.raises(UnknownStrategyError):
            get_default_strategy(A.SAVE_SHARDED, "torchfiles", 1)
        unregister_strategy(A.SAVE_SHARDED, "never", 1)  # unknown keys are ignored

    def test_strategy_key(self):
        key = StrategyKey(A.LOAD_COMMON, "torch", 1)
        assert str(key) == "load_common:torch:v1"
        assert key == StrategyKey(A.LOAD_COMMON, "torch", 1) and hash(key) == hash(
            StrategyKey(A.LOAD_COMMON, "torch", 1)
        )
        with pytest.raises(Exception):
            key.backend = "x"  # type: ignore[misc]
        assert [a.value for a in StrategyAction] == ["load_common", "load_sharded", "save_common", "save_sharded"]


class TestResolveStrategy:
    def test_none_uses_default(self, torchfiles):
        assert isinstance(resolve_strategy(None, A.SAVE_SHARDED, ("torchfiles", 1)), TorchFilesSave)

    def test_tuple_and_key(self, torchfiles):
        assert isinstance(resolve_strategy(("torchfiles", 1), A.LOAD_SHARDED, ("zarr", 1)), TorchFilesLoad)
        key = StrategyKey(A.LOAD_SHARDED, "torchfiles", 1)
        assert isinstance(resolve_strategy(key, A.LOAD_SHARDED, ("zarr", 1)), TorchFilesLoad)

    def test_object_as_given(self):
        s = TorchFilesSave()
        assert resolve_strategy(s, A.SAVE_SHARDED, ("zarr", 1)) is s

    @pytest.mark.parametrize("spec", [TorchFilesLoad(), "torchfiles", ("torchfiles",), 5])
    def test_wrong_kind(self, spec):
        with pytest.raises(UnknownStrategyError, match="SaveShardedStrategy"):
            resolve_strategy(spec, A.SAVE_SHARDED, ("zarr", 1))

    def test_unknown_tuple(self):
        with pytest.raises(UnknownStrategyError, match="save_sharded:nope:v1"):
            resolve_strategy(("nope", 1), A.SAVE_SHARDED, ("zarr", 1))


class TestBaseClasses:
    def test_compatibility_checks(self):
        s = TorchFilesLoad()
        s.check_backend_compatibility("torchfiles")
        s.check_version_compatibility(1)
        with pytest.raises(IncompatibleStrategyError, match="'zarr'"):
            s.check_backend_compatibility("zarr")
        with pytest.raises(IncompatibleStrategyError, match=r"\[1\].*version 2"):
            s.check_version_compatibility(2)

    def test_defaults(self, tmp_path):
        save = TorchFilesSave()
        assert (save.backend, save.version) == ("torchfiles", 1)
        assert save.can_handle_sharded_objects is False
        assert "torchfiles" in str(save)
        load = TorchFilesLoad()
        assert load.can_handle_sharded_objects is False
        assert str(load) == "TorchFilesLoad"
        with pytest.raises(IncompatibleStrategyError):
            load.remove_sharded_tensors(str(tmp_path), "x")

    def test_load_sharded_metadata_defaults_to_tensors_metadata(self, tmp_path):
        TorchFilesSave().save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(3))}, tmp_path)
        meta = TorchFilesLoad().load_sharded_metadata(tmp_path)
        assert list(meta) == ["w"] and meta["w"].global_shape == (3,)

    def test_object_handling_loader_must_override_metadata(self, tmp_path):
        class ObjLoad(TorchFilesLoad):
            @property
            def can_handle_sharded_objects(self):
                return True

        with pytest.raises(IncompatibleStrategyError):
            ObjLoad().load_sharded_metadata(tmp_path)

    def test_common_defaults(self, tmp_path):
        class MinimalCommonSave(SaveCommonStrategy):
            def save_common(self, common_state_dict, checkpoint_dir):
                pass

        class MinimalCommonLoad(LoadCommonStrategy):
            def load_common(self, checkpoint_dir):
                return {}

            def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
                return sharded_objects_state_dict

        with pytest.raises(IncompatibleStrategyError):
            MinimalCommonSave("x", 1).save_sharded_objects({}, tmp_path)
        with pytest.raises(IncompatibleStrategyError):
            MinimalCommonLoad().load_sharded_metadata(tmp_path)
        assert issubclass(MinimalCommonLoad, LoadStrategyBase) and issubclass(MinimalCommonSave, SaveStrategyBase)

    def test_abstract(self):
        with pytest.raises(TypeError):
            SaveShardedStrategy("x", 1)  # type: ignore[abstract]
        with pytest.raises(TypeError):
            LoadShardedStrategy()  # type: ignore[abstract]


class TestAsyncRequest:
    def test_execute_and_freeze(self):
        order = []
        req = AsyncRequest(lambda a, b: order.append(("fn", a, b)), (1, 2))
        req.add_finalize_fn(lambda: order.append("fin1"))
        frozen = req.freeze()
        with pytest.raises(CheckpointingException, match="frozen"):
            frozen.add_finalize_fn(lambda: None)
        req.add_finalize_fn(lambda: order.append("fin2"))  # the original is not frozen
        frozen.execute_sync()
        assert order == [("fn", 1, 2), "fin1"]
        AsyncRequest(None, ()).execute_sync()


# --------------------------------------------------------------------------- entry points


PLUGIN_SOURCE = """
from dist_ckpt.backends.base import LoadShardedStrategy


class PluginLoad(LoadShardedStrategy):
    supported_backends = ("plugged",)
    supported_versions = (7,)

    def load(self, sharded_state_dict, checkpoint_dir):
        return sharded_state_dict

    def load_tensors_metadata(self, checkpoint_dir):
        return {}
"""


def _fake_entry_points(monkeypatch, eps):
    def entry_points(**kwargs):
        if kwargs.get("group") == ENTRY_POINT_GROUP:
            return list(eps)
        return []

    monkeypatch.setattr(registry.importlib_metadata, "entry_points", entry_points)


class TestEntryPoints:
    def test_plugin_module_is_loaded_lazily(self, tmp_path, monkeypatch):
        module = f"dc_test_plugin_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{module}.py").write_text(PLUGIN_SOURCE)
        monkeypatch.syspath_prepend(str(tmp_path))
        ep = importlib.metadata.EntryPoint(
            name="load_sharded.plugged.7", value=f"{module}:PluginLoad", group=ENTRY_POINT_GROUP
        )
        _fake_entry_points(monkeypatch, [ep])
        assert StrategyKey(A.LOAD_SHARDED, "plugged", 7) in registered_strategies()
        assert module not in sys.modules  # listing does not import the plugin
        strategy = get_default_strategy(A.LOAD_SHARDED, "plugged", 7)
        assert type(strategy).__name__ == "PluginLoad" and module in sys.modules
        with pytest.raises(UnknownStrategyError, match="load_sharded:plugged:v7"):
            get_default_strategy(A.LOAD_SHARDED, "plugged", 8)
        sys.modules.pop(module, None)

    def test_round_trip_through_entry_points(self, tmp_path, monkeypatch):
        eps = [
            importlib.metadata.EntryPoint(
                name="save_sharded.epfiles.2", value=f"{__name__}:EpFilesSave", group=ENTRY_POINT_GROUP
            ),
            importlib.metadata.EntryPoint(
                name="load_sharded.epfiles.2", value=f"{__name__}:EpFilesLoad", group=ENTRY_POINT_GROUP
            ),
        ]
        _fake_entry_points(monkeypatch, eps)
        w = _global()
        dc.save(_four_rank_state(w, _global((4, 6))), tmp_path / "c", sharded_strategy=("epfiles", 2))
        assert json.loads((tmp_path / "c" / "metadata.json").read_text())["sharded_backend"] == "epfiles"
        out = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 6))}, tmp_path / "c", strict="log_all")
        assert torch.equal(out["w"], w)

    def test_application_registration_wins_over_entry_point(self, monkeypatch):
        ep = importlib.metadata.EntryPoint(
            name="load_sharded.epfiles.2", value=f"{__name__}:EpFilesLoad", group=ENTRY_POINT_GROUP
        )
        _fake_entry_points(monkeypatch, [ep])
        mine = TorchFilesLoad()
        register_default_strategy(A.LOAD_SHARDED, "epfiles", 2, mine)
        assert get_default_strategy(A.LOAD_SHARDED, "epfiles", 2) is mine

    def test_dotted_backend_name(self, monkeypatch):
        ep = importlib.metadata.EntryPoint(
            name="load_sharded.my.backend.3", value=f"{__name__}:TorchFilesLoad", group=ENTRY_POINT_GROUP
        )
        _fake_entry_points(monkeypatch, [ep])
        assert isinstance(get_default_strategy(A.LOAD_SHARDED, "my.backend", 3), TorchFilesLoad)

    @pytest.mark.parametrize("name", ["garbage", "load_sharded.nover", "frobnicate.x.1", "load_sharded.x.one"])
    def test_malformed_names_are_ignored_with_warning(self, monkeypatch, caplog, name):
        ep = importlib.metadata.EntryPoint(name=name, value=f"{__name__}:TorchFilesLoad", group=ENTRY_POINT_GROUP)
        _fake_entry_points(monkeypatch, [ep])
        with caplog.at_level(logging.WARNING, logger="dist_ckpt"):
            keys = registered_strategies()
        assert all(k.backend not in ("x", "nover") for k in keys)
        assert name in caplog.text


# --------------------------------------------------------------------------- missing dependency


class TestMissingDependency:
    @pytest.fixture
    def no_zarr(self, monkeypatch):
        real = importlib.import_module

        def fake(name, package=None):
            if name == "dist_ckpt.backends.zarr.zarr_python" or name == "zarr" or name.startswith("zarr."):
                raise ModuleNotFoundError("No module named 'zarr'", name="zarr")
            return real(name, package)

        monkeypatch.setattr(registry.importlib, "import_module", fake)

    @pytest.mark.parametrize("action", [A.SAVE_SHARDED, A.LOAD_SHARDED])
    def test_builtin_names_pip_extra(self, no_zarr, action):
        with pytest.raises(MissingDependencyError) as info:
            get_default_strategy(action, "zarr", 1)
        assert "pip install 'dist_ckpt[zarr]'" in str(info.value)
        assert "'zarr'" in str(info.value)
        assert isinstance(info.value, ImportError) and isinstance(info.value, CheckpointingException)
        assert isinstance(info.value.__cause__, ImportError)

    def test_save_with_zarr_backend(self, no_zarr, tmp_path):
        with pytest.raises(MissingDependencyError, match=r"dist_ckpt\[zarr\]"):
            dc.save(
                {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, tmp_path / "c", sharded_strategy=("zarr", 1)
            )
        assert not (tmp_path / "c" / "metadata.json").exists()

    def test_default_backend_needs_no_optional_dependency(self, no_zarr, tmp_path):
        dc.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, tmp_path / "c")
        out = dc.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(2))}, tmp_path / "c")
        assert torch.equal(out["w"], torch.ones(2))

    def test_common_backend_unaffected(self, no_zarr):
        assert type(get_default_strategy(A.SAVE_COMMON, "torch", 1)).__name__ == "TorchCommonSaveStrategy"


@pytest.mark.parametrize(
    "module, function, backend, expected",
    [
        (
            "dist_ckpt.strategies.common",
            "register_default_common_strategies",
            "torch",
            {
                StrategyAction.SAVE_COMMON: "TorchCommonSaveStrategy",
                StrategyAction.LOAD_COMMON: "TorchCommonLoadStrategy",
            },
        ),
        (
            "dist_ckpt.strategies.torch",
            "register_default_torch_strategies",
            "torch_dist",
            {
                StrategyAction.SAVE_SHARDED: "TorchDistSaveShardedStrategy",
                StrategyAction.LOAD_SHARDED: "TorchDistLoadShardedStrategy",
            },
        ),
    ],
)
def test_megatron_register_default_functions_register_the_builtins_idempotently(
    module: str, function: str, backend: str, expected: Dict[StrategyAction, str]
) -> None:
    register = getattr(importlib.import_module(module), function)
    try:
        for action in expected:  # an application's override, which the call replaces
            register_default_strategy(action, backend, 1, lambda: None, override=True)
        register()
        register()  # again: the same registrations, no duplicate error
        for action, name in expected.items():
            assert type(get_default_strategy(action, backend, 1)).__name__ == name
            assert registry._registry[StrategyKey(action, backend, 1)].__name__ == name
    finally:
        for action in expected:
            unregister_strategy(action, backend, 1)


def test_register_builtin_strategies_names_the_builtins_for_an_unknown_backend() -> None:
    with pytest.raises(dc.UnknownStrategyError, match=r"no built-in strategy for \('nope', 1\).*'torch_dist'"):
        registry.register_builtin_strategies("nope")
