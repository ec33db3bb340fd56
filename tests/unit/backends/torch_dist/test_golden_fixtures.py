"""The committed torch_dist golden checkpoints hold exactly what ``expected.py`` says.

These tests read the fixtures with nothing but torch and pickle (no dist_ckpt, no
megatron-core), so that the description the torch_dist backend's tests rely on is itself
checked against the bytes megatron-core wrote: ``metadata.json``, ``common.pt``, DCP's
``.metadata`` (tensor sizes, dtypes, chunks; ShardedObject bytes entries) and every chunk and
object stored in the ``.distcp`` files.
"""

from __future__ import annotations

import argparse
import io
import json
import pickle
from pathlib import Path
from typing import Any, Dict, Tuple

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from tests.golden.torch_dist import expected as E

ROOT = Path(__file__).resolve().parents[3] / "golden" / "torch_dist"
MCORE_CONFIG = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


class _LegacyMetadata(Metadata):
    """Stand-in for megatron-core <= 0.15's ``MCoreMetadata`` (Metadata plus ``mcore_data``)."""

    mcore_data: Dict[str, Dict[str, Any]]


class _LegacySavePlan:
    """Stand-in for megatron-core <= 0.15's ``MCoreSavePlan`` (only in ``all_local_plans``)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Test-only: resolves megatron-core's pickled classes without megatron-core installed."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "megatron.core.dist_checkpointing.strategies.torch":
            return {"MCoreMetadata": _LegacyMetadata, "MCoreSavePlan": _LegacySavePlan}[name]
        return super().find_class(module, name)


def _metadata(ckpt: Path) -> Any:
    with open(ckpt / ".metadata", "rb") as f:
        return _MetadataUnpickler(f).load()


def _read_item(ckpt: Path, md: Any, index: MetadataIndex) -> bytes:
    info = md.storage_data[index]
    with open(ckpt / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def _load(raw: bytes) -> Any:
    with torch.serialization.safe_globals([io.BytesIO, argparse.Namespace]):
        return torch.load(io.BytesIO(raw), weights_only=True)


@pytest.fixture(params=sorted(E.FIXTURES))
def fixture(request: pytest.FixtureRequest) -> E.Fixture:
    return E.FIXTURES[request.param]


def test_every_fixture_directory_is_described() -> None:
    on_disk = {p.name for p in ROOT.iterdir() if (p / "metadata.json").is_file()}
    assert on_disk == set(E.FIXTURES)


def test_metadata_json_is_megatron_config(fixture: E.Fixture) -> None:
    assert json.loads((ROOT / fixture.name / "metadata.json").read_text()) == MCORE_CONFIG


def test_common_pt(fixture: E.Fixture) -> None:
    raw = (ROOT / fixture.name / "common.pt").read_bytes()
    E.assert_same(_load(raw), E.expected_common(fixture.name), "common.pt")


def test_dcp_metadata_lists_tensors_and_objects(fixture: E.Fixture) -> None:
    md = _metadata(ROOT / fixture.name)
    tensors = {k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    objects = {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    assert tensors == {t.key for t in fixture.tensors}
    assert objects == set(E.expected_objects(fixture.name))
    for spec in fixture.tensors:
        entry = md.state_dict_metadata[spec.key]
        assert tuple(entry.size) == E.stored_shape(spec), spec.key
        assert entry.properties.dtype == spec.dtype, spec.key
        chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
        assert chunks == E.dcp_chunks(spec), spec.key


def test_legacy_metadata_records_reformulated_shapes() -> None:
    fixture = E.FIXTURES["flat_legacy_mcore015"]
    md = _metadata(ROOT / fixture.name)
    assert isinstance(md, _LegacyMetadata)
    for spec in fixture.tensors:
        if any(p.flattened_range for p in spec.pieces):
            assert md.mcore_data[spec.key] == {"nd_reformulated_orig_global_shape": spec.global_shape}


def _expected_chunk(spec: E.TensorSpec, offsets: Tuple[int, ...], sizes: Tuple[int, ...]) -> torch.Tensor:
    """The content of the stored chunk at ``offsets``: a slice of the (reformulated) tensor."""
    whole = E.full_tensor(spec.key, spec.global_shape, spec.dtype)
    flat = [p for p in spec.pieces if p.flattened_range is not None]
    if flat:
        # [X, Y] with local chunk [x, y] is stored as [X//x, Y//y, x*y]: chunk i, j is the
        # flattened block whole[i*x:(i+1)*x, j*y:(j+1)*y].
        loc = E.local_shape(spec, flat[0])
        prepend = flat[0].prepend_axis_num
        block = tuple(
            slice(i, i + 1) if axis < prepend else slice(i * loc[axis - prepend], (i + 1) * loc[axis - prepend])
            for axis, i in enumerate(offsets[:-1])
        )
        start = offsets[-1]
        return whole[block].flatten()[start : start + sizes[-1]].reshape(sizes)
    return whole[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]


def test_every_stored_chunk_holds_expected_values(fixture: E.Fixture) -> None:
    ckpt = ROOT / fixture.name
    md = _metadata(ckpt)
    for spec in fixture.tensors:
        for offsets, sizes in E.dcp_chunks(spec):
            got = _load(_read_item(ckpt, md, MetadataIndex(spec.key, offsets)))
            E.assert_same(got, _expected_chunk(spec, offsets, sizes), f"{spec.key}@{offsets}")


def test_every_stored_object_holds_expected_value(fixture: E.Fixture) -> None:
    ckpt = ROOT / fixture.name
    md = _metadata(ckpt)
    want: Dict[str, Any] = E.expected_objects(fixture.name)
    for key, value in want.items():
        # Megatron-Core torch.saves a list holding the object (one per local shard of the key).
        E.assert_same(_load(_read_item(ckpt, md, MetadataIndex(key))), [value], key)
