"""Injected corruption: damaged, truncated, deleted and rewritten files of every format.

Every case must end in a :class:`CheckpointingException` that names the file (or in a correct
load, when the damage does not matter) -- never a hang, never a raw exception of a dependency
(json, zarr, tensorstore, torch, safetensors). A seeded fuzz test rewrites every metadata file
(metadata.json, index.json, zarr.json, the checksum manifests) with random JSON values of wrong
types, random bytes and truncations; it runs in CI with fixed seeds and a bounded count.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.errors import CheckpointingException, ChecksumMismatchError, NotACheckpointError
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor
from tests.json_damage import Damage, Node, damaged_documents, flipped_byte, random_bytes, set_node, truncated

FORMATS = ["safetensors", "zarr", "zarr-tensorstore"]


def _full() -> Dict[str, torch.Tensor]:
    return {
        "a.w": torch.arange(48, dtype=torch.float32).reshape(8, 6) / 7,
        "b": torch.arange(10, dtype=torch.int64) * 1_000_003,
        "opt": torch.linspace(-1, 1, 12).reshape(3, 4),
    }


def _state() -> Dict[str, Any]:
    full = _full()
    sd: Dict[str, Any] = {
        f"w{r}": ShardedTensor.from_rank_offsets("a.w", full["a.w"][4 * r : 4 * r + 4].clone(), (0, r, 2))
        for r in range(2)
    }
    sd["b"] = ShardedTensor.from_rank_offsets("b", full["b"].clone())
    flat = full["opt"].flatten()
    sd["o0"] = ShardedTensor.from_rank_offsets_flat("opt", flat[:5].clone(), (3, 4), flattened_range=slice(0, 5))
    sd["o1"] = ShardedTensor.from_rank_offsets_flat("opt", flat[5:].clone(), (3, 4), flattened_range=slice(5, 12))
    sd["obj"] = ShardedObject("rng", {"seed": 3}, (1,), (0,))
    sd["step"] = 11
    return sd


def _request() -> Dict[str, Any]:
    return {
        **{k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in _full().items()},
        "obj": ShardedObject("rng", None, (1,), (0,)),
    }


def _save(path: Path, fmt: str) -> Path:
    if fmt == "safetensors":
        dc.save(_state(), path)
    elif fmt == "zarr":
        dc.save(_state(), path, sharded_strategy=("zarr", 1))
    else:
        from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreSaveShardedStrategy

        dc.save(_state(), path, sharded_strategy=TensorStoreSaveShardedStrategy())
    return path


def _load_strategy(fmt: str) -> Any:
    if fmt == "zarr-tensorstore":
        from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreLoadShardedStrategy

        return TensorStoreLoadShardedStrategy()
    return None


def _load_ok(path: Path, fmt: str) -> bool:
    """Load everything; True if it loads bit-exactly, raise if it loads anything else."""
    loaded = dc.load(_request(), path, sharded_strategy=_load_strategy(fmt))
    for key, expected in _full().items():
        if not torch.equal(loaded[key], expected):
            raise AssertionError(f"{key!r} loaded wrong values without an error")
    assert loaded["obj"] == {"seed": 3} and loaded["step"] == 11
    return True


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("pristine")
    return {fmt: _save(root / fmt, fmt) for fmt in FORMATS}


@pytest.fixture
def copy(pristine: Dict[str, Path], tmp_path: Path) -> Callable[[str], Path]:
    def make(fmt: str) -> Path:
        target = tmp_path / fmt
        shutil.copytree(pristine[fmt], target)
        return target

    return make


def _data_files(path: Path, fmt: str) -> List[Path]:
    if fmt == "safetensors":
        return sorted((path / "safetensors").glob("*.safetensors"))
    return sorted(
        p
        for p in (path / "zarr").rglob("*")
        if p.is_file() and "/c" in str(p.relative_to(path / "zarr")).replace("\\", "/") and p.name != "zarr.json"
    )


def _metadata_files(path: Path) -> List[Path]:
    names = [
        "metadata.json",
        "safetensors/index.json",
        "zarr/checksums.json",
        "common.checksums.json",
        "objects/checksums.json",
    ]
    files = [path / n for n in names if (path / n).is_file()]
    return files + sorted((path / "zarr").rglob("zarr.json"))


# --------------------------------------------------------------------------- data files


def _assert_names_a_key(message: str) -> None:
    """Damage to a data file must be reported with the tensor it belongs to, quoted."""
    assert any(f"'{key}'" in message for key in _full()), f"no tensor key named in: {message}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_pristine_checkpoints_load_and_verify(pristine, fmt):
    assert _load_ok(pristine[fmt], fmt)
    assert dc.verify_checkpoint(pristine[fmt]).ok


@pytest.mark.parametrize("fmt", FORMATS)
def test_flipped_byte_in_every_data_file(copy, fmt):
    path = copy(fmt)
    files = _data_files(path, fmt)
    assert files
    for f in files:
        original = f.read_bytes()
        damaged = bytearray(original)
        damaged[len(damaged) - 3] ^= 0x01  # in the data (the end of any file holds data)
        f.write_bytes(bytes(damaged))
        with pytest.raises(ChecksumMismatchError) as info:
            _load_ok(path, fmt)
        assert f.name in str(info.value) or str(f.relative_to(path / "zarr").parent) in str(info.value)
        _assert_names_a_key(str(info.value))
        report = dc.verify_checkpoint(path)
        assert [p.path for p in report.problems] == [str(f.relative_to(path))]
        f.write_bytes(original)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_truncated_and_deleted_data_files(copy, fmt, damage):
    path = copy(fmt)
    for f in _data_files(path, fmt):
        original = f.read_bytes()
        if damage == "truncate":
            f.write_bytes(original[: len(original) // 2])
        else:
            f.unlink()
        with pytest.raises(CheckpointingException) as info:
            _load_ok(path, fmt)
        assert f.name in str(info.value)
        _assert_names_a_key(str(info.value))
        problems = dc.verify_checkpoint(path).problems
        assert [p.path for p in problems] == [str(f.relative_to(path))]
        assert ("missing" if damage == "delete" else "bytes") in problems[0].problem
        f.write_bytes(original)


@pytest.mark.parametrize("name", ["common.pt", "objects/rng/shard_0_1.pt"])
def test_damaged_common_files(copy, name):
    path = copy("safetensors")
    f = path / name
    original = f.read_bytes()
    for damaged in (original[:-1] + bytes([original[-1] ^ 1]), original[:100], None):
        if damaged is None:
            f.unlink()
        else:
            f.write_bytes(damaged)
        with pytest.raises(CheckpointingException) as info:
            _load_ok(path, "safetensors")
        assert name.split("/")[-1] in str(info.value)
        assert [p.path for p in dc.verify_checkpoint(path).problems] == [name]
        f.write_bytes(original)


def test_missing_metadata_json_is_refused(copy):
    path = copy("safetensors")
    (path / "metadata.json").unlink()
    with pytest.raises(NotACheckpointError, match="metadata.json is missing"):
        _load_ok(path, "safetensors")
    report = dc.verify_checkpoint(path)
    assert not report.ok and report.problems[0].path == "metadata.json"
    assert len(report.problems) == 1  # every other file is intact


# --------------------------------------------------------------------------- metadata files


_WRONG_VALUES: List[Any] = [None, True, 0, -1, 2**70, 1.5, "", "x", [], [1, "a"], {}, {"a": None}]


def _wrong_value(raw: bytes, rng: random.Random, nodes: List[Node]) -> Damage:
    mutated = json.loads(raw)
    node = rng.choice(nodes)
    value = rng.choice(_WRONG_VALUES)
    set_node(mutated, node, value)
    return f"{'/'.join(map(str, node))} = {value!r}", json.dumps(mutated).encode()


def _mutations(raw: bytes, rng: random.Random, count: int) -> List[Tuple[str, bytes]]:
    return damaged_documents(raw, rng, count, (random_bytes(64), truncated, flipped_byte, _wrong_value, _wrong_value))


def _check_outcome(path: Path, fmt: str, what: str, must_name: str = "") -> None:
    try:
        _load_ok(path, fmt)
    except CheckpointingException as e:
        assert must_name in str(e), f"{what}: the error does not name {must_name!r}: {e}"
    except Exception as e:  # noqa: BLE001 -- the point of the test
        raise AssertionError(f"{what}: a raw {type(e).__name__} escaped: {e}") from e
    try:
        dc.verify_checkpoint(path)  # never raises, whatever the damage
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"{what}: verify raised {type(e).__name__}: {e}") from e


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_bytes_in_every_metadata_file_name_the_file(copy, fmt):
    path = copy(fmt)
    for f in _metadata_files(path):
        original = f.read_bytes()
        f.write_bytes(b"\x00\xff not json \x80")
        rel = str(f.relative_to(path))
        try:
            _load_ok(path, fmt)
            # a tensor's zarr.json: a load takes it from the root group's index (checked against
            # the manifest) and never reads the file
            assert rel.startswith("zarr/") and rel.count("/") >= 2, f"{rel} is damaged, yet the load succeeded"
        except CheckpointingException as e:
            assert f.name in str(e), f"{rel}: {e}"
        problems = dc.verify_checkpoint(path).problems
        assert rel in {p.path for p in problems}, f"{rel}: {problems}"
        f.write_bytes(original)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fuzz_metadata_files(copy, fmt):
    """Seeded: 30 mutations of each metadata file; each load raises our error or loads right."""
    path = copy(fmt)
    rng = random.Random(f"dist_ckpt-fuzz-{fmt}")
    for f in _metadata_files(path):
        original = f.read_bytes()
        for what, data in _mutations(original, rng, 30):
            f.write_bytes(data)
            unparsable = what in ("random bytes", "truncated")  # such errors must name the file
            _check_outcome(path, fmt, f"{f.relative_to(path)}: {what}", f.name if unparsable else "")
        f.write_bytes(original)
    assert _load_ok(path, fmt)
