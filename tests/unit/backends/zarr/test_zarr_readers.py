"""Plain zarr-python 3 reads every array a zarr-backend save writes, without dist_ckpt.

zarr-python 3 knows no bfloat16 or float8 data type; the backend stores those tensors as the
unsigned integers of their width (raw bits) and names the tensor's dtype in the array's
``dist_ckpt`` attributes. A subprocess that imports zarr and numpy only (not dist_ckpt, not
ml_dtypes) opens every array of checkpoints written by both engines, chunked and flattened, and
must find the bits that were saved. Checkpoints written with the zarr-extensions names
(``"bfloat16"``, tests/golden/zarr_v1*) still load: tests/unit/test_golden.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.zarr.layout import fragment_name, tensor_dir_name
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.testing.layouts import bitwise_equal, random_bits_tensor
from tests.unit.backends.zarr.test_zarr_strategy import flat_pieces, split_state

#: every dtype zarr-python 3 has no data type for, with the unsigned integer that stores it
RAW_BITS = {
    torch.bfloat16: "uint16",
    torch.float8_e4m3fn: "uint8",
    torch.float8_e5m2: "uint8",
    torch.float8_e4m3fnuz: "uint8",
    torch.float8_e5m2fnuz: "uint8",
    **({torch.float8_e8m0fnu: "uint8"} if hasattr(torch, "float8_e8m0fnu") else {}),
}

READER = """
import json, sys
import numpy as np
import zarr

root = sys.argv[1]
out = {}
for path in json.loads(sys.argv[2]):
    array = zarr.open_array(store=root, path=path, mode="r")
    values = np.asarray(array[...])
    out[path] = {
        "data_type": str(array.dtype),
        "attributes": dict(array.attrs)["dist_ckpt"],
        "bits": values.reshape(-1).view(f"u{values.dtype.itemsize}").tolist(),
    }
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("dist_ckpt", "ml_dtypes", "torch"))
assert not leaked, leaked
print(json.dumps(out))
"""


def _state() -> Dict[str, Any]:
    sd: Dict[str, Any] = {}
    for i, dtype in enumerate(RAW_BITS):
        sd.update(split_state(f"chunked.{dtype}", random_bits_tensor(dtype, (4, 6), seed=i), 0, 2))
    sd["flat"] = flat_pieces("flattened.bf16", random_bits_tensor(torch.bfloat16, (3, 5), seed=9), [0, 7, 15])
    sd["f32"] = ShardedTensor.from_rank_offsets("f32", random_bits_tensor(torch.float32, (5,), seed=10))
    return sd


def _unsigned_bits(t: torch.Tensor) -> List[int]:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().view(f"u{t.element_size()}").tolist()


def _whole(sd: Dict[str, Any], key: str) -> torch.Tensor:
    """The whole tensor ``key`` of the state (its virtual ranks split dim 0)."""
    parts = [v for v in sd.values() if isinstance(v, ShardedTensor) and v.key == key]
    return torch.cat([p.data for p in sorted(parts, key=lambda p: p.global_offset)])


def _expected_arrays(sd: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """``{array path under zarr/: the values it holds}``: one array per chunked tensor, one
    fragment array per flattened shard."""
    out: Dict[str, torch.Tensor] = {}
    for value in sd.values():
        if isinstance(value, list):
            for sh in value:
                out[f"{tensor_dir_name(sh.key)}/{fragment_name(sh)}"] = sh.data
        else:
            out[tensor_dir_name(value.key)] = _whole(sd, value.key)
    return out


def _read_with_plain_zarr(root: Path, paths: List[str]) -> Dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", READER, str(root), json.dumps(paths)],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result: Dict[str, Any] = json.loads(proc.stdout)
    return result


@pytest.mark.parametrize("engine", ["zarr-python", "tensorstore"])
def test_plain_zarr_python_reads_bf16_and_float8_arrays(engine: str, tmp_path: Path) -> None:
    strategy: Any = ("zarr", 1)
    if engine == "tensorstore":
        pytest.importorskip("tensorstore")
        from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreSaveShardedStrategy

        strategy = TensorStoreSaveShardedStrategy()
    sd = _state()
    dc.save(sd, tmp_path / "c", sharded_strategy=strategy)
    arrays = _expected_arrays(sd)
    got = _read_with_plain_zarr(tmp_path / "c" / "zarr", sorted(arrays))
    assert set(got) == set(arrays)
    for path, values in arrays.items():
        name = str(values.dtype).removeprefix("torch.")
        assert got[path]["attributes"]["dtype"] == name, path  # the tensor's dtype, for any reader
        assert got[path]["data_type"] == RAW_BITS.get(values.dtype, name), path
        assert got[path]["bits"] == _unsigned_bits(values), path


@pytest.mark.parametrize("engine", ["zarr-python", "tensorstore"])
def test_raw_bits_arrays_load_back_bit_exactly(engine: str, tmp_path: Path) -> None:
    load_strategy: Any = None
    if engine == "tensorstore":
        pytest.importorskip("tensorstore")
        from dist_ckpt.backends.zarr.tensorstore_engine import TensorStoreLoadShardedStrategy

        load_strategy = TensorStoreLoadShardedStrategy()
    sd = _state()
    dc.save(sd, tmp_path / "c", sharded_strategy=("zarr", 1))
    for dtype in RAW_BITS:
        key = f"chunked.{dtype}"
        request = {"t": ShardedTensor.from_rank_offsets(key, torch.zeros(4, 6, dtype=dtype))}
        loaded = dc.load(request, tmp_path / "c", sharded_strategy=load_strategy)["t"]
        assert bitwise_equal(loaded, _whole(sd, key)), key


def test_convert_rewrites_an_older_checkpoint_with_raw_bits(tmp_path: Path) -> None:
    # zarr_v1 stored bfloat16 as "data_type": "bfloat16", which plain zarr-python cannot open
    from tests.golden.state import full_tensors
    from tests.paths import GOLDEN_DIR

    old = tmp_path / "old"
    shutil.copytree(GOLDEN_DIR / "zarr_v1", old)  # a copy: the golden is never written
    assert json.loads((old / "zarr" / "layer.b" / "zarr.json").read_text())["data_type"] == "bfloat16"
    dc.convert(old, tmp_path / "new", ("zarr", 1))
    got = _read_with_plain_zarr(tmp_path / "new" / "zarr", ["layer.b"])["layer.b"]
    assert got["data_type"] == "uint16" and got["bits"] == _unsigned_bits(full_tensors()["layer.b"])
