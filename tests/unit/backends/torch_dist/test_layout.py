"""Pure functions of the torch_dist backend: ShardedTensor -> DCP chunk, the .metadata layout of the
golden fixtures, the per-item checksum spans and their manifest."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.torch_dist.checksums import (
    ChecksummingFileSystem,
    FileSpans,
    manifest_json,
    parse_manifest,
    spans_within,
)
from dist_ckpt.backends.torch_dist.layout import parse_layout, write_chunk
from dist_ckpt.backends.torch_dist.metadata import read_metadata
from dist_ckpt.errors import CorruptCheckpointError, IncompatibleStrategyError, InvalidShardedTensorError
from dist_ckpt.integrity.checksums import crc32c
from tests.golden.torch_dist import expected as E
from tests.torch_dist_golden import fixture_dir


def test_write_chunk_regular_and_stacked() -> None:
    row = dc.ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4), (0, 1, 2))
    assert write_chunk(row) == ((2, 0), (2, 4), (4, 4))
    layer = dc.ShardedTensor.from_rank_offsets("l", torch.zeros(6, 8), (0, 3, 4), (1, 1, 2), prepend_axis_num=1)
    assert write_chunk(layer) == ((3, 6, 0), (1, 6, 8), (4, 12, 8))


def test_write_chunk_flattened_is_megatron_reformulated() -> None:
    # the fixture's qkv optimizer state: (2, 24, 8) stacked, TP on axis 1, local chunk 12 x 8 = 96
    flat = dc.ShardedTensor.from_rank_offsets_flat(
        "q", torch.zeros(76), (12, 8), (0, 1, 2), (1, 1, 2), prepend_axis_num=1, flattened_range=slice(20, 96)
    )
    assert write_chunk(flat) == ((1, 1, 0, 20), (1, 1, 1, 76), (2, 2, 1, 96))


def test_write_chunk_refuses_a_flattened_piece_off_the_grid() -> None:
    odd = dc.ShardedTensor("x", torch.zeros(3), torch.float32, (4,), (10,), (4,), None, flattened_range=slice(0, 3))
    with pytest.raises(InvalidShardedTensorError, match="regular grid"):
        write_chunk(odd)


@pytest.mark.parametrize("name", sorted(E.FIXTURES))
def test_layout_of_the_golden_fixtures(name: str) -> None:
    layout = parse_layout(read_metadata(fixture_dir(name)), name)
    for spec in E.FIXTURES[name].tensors:
        stored = layout.tensors[spec.key]
        assert stored.shape == spec.global_shape and stored.stored_shape == E.stored_shape(spec)
        assert sorted((c.offsets, c.sizes) for c in stored.chunks) == E.dcp_chunks(spec)
    assert set(layout.byte_items) == set(E.expected_objects(name))


def test_a_chunk_without_a_file_is_corruption() -> None:
    md = read_metadata(fixture_dir("tp2"))
    md.storage_data.pop(next(iter(md.storage_data)))
    with pytest.raises(CorruptCheckpointError, match="records no file"):
        parse_layout(md, "tp2")


def test_spans_of_items_are_recorded_as_they_are_written(tmp_path: Path) -> None:
    fs = ChecksummingFileSystem()
    with fs.create_stream(tmp_path / "__0_0.distcp", "wb") as stream:
        stream.tell()
        stream.write(b"item one")
        stream.tell()
        stream.write(memoryview(torch.arange(3, dtype=torch.int32).numpy()))
        stream.tell()
    spans = fs.digests["__0_0.distcp"]
    data = (tmp_path / "__0_0.distcp").read_bytes()
    assert spans == FileSpans(20, ((0, 8, crc32c(data[:8])), (8, 12, crc32c(data[8:]))))
    assert spans_within(spans.spans, 8, 12) == [spans.spans[1]]
    assert spans_within(spans.spans, 4, 8) is None  # crosses a span: cannot be checked alone
    assert parse_manifest(manifest_json({"__0_0.distcp": spans}), "m") == {"__0_0.distcp": spans}


@pytest.mark.parametrize(
    "files, error",
    [
        ({"a": {"size": 4, "spans": [[0, 3, "00000000"]]}}, CorruptCheckpointError),
        ({"a": {"size": 4, "spans": [[1, 3, "00000000"]]}}, CorruptCheckpointError),
        ({"../a": {"size": 0, "spans": []}}, CorruptCheckpointError),
    ],
)
def test_bad_manifests(files, error) -> None:
    import json

    doc = {"format": "dist_ckpt.torch_dist.checksums", "version": 1, "algorithm": "crc32c", "files": files}
    with pytest.raises(error):
        parse_manifest(json.dumps(doc).encode(), "m")
    doc["version"] = 2
    with pytest.raises(IncompatibleStrategyError, match="upgrade"):
        parse_manifest(json.dumps(doc).encode(), "m")
