"""Hostile DCP ``.metadata`` that the restricted unpickler accepts (only DCP's own classes).

A plain torch.distributed.checkpoint directory is forged by editing its metadata: a chunk listed
many times, chunks that overlap or leave a gap, a huge declared size, a dtype that is not the one
its data is stored in. Every loader (``load``, ``load_plain_tensors``, ``load_tensors_metadata``,
``unshard``, ``convert``) must refuse it with a typed error, and ``verify`` must report it: both
run the same structural checks of the layout (issue 41, items 5 and 7).
"""

from __future__ import annotations

import pickle
import shutil
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

import dist_ckpt as dc
from dist_ckpt.engine.load_parts import load_plain_tensors, load_tensors_metadata

Change = Callable[[Metadata], None]


@pytest.fixture(scope="module")
def plain_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plain DCP directory holding ``w`` (4x4 float32) as two chunks of two rows, and ``step``.

    ``dcp.save`` in one process writes a tensor as one chunk: the two halves are saved as two
    tensors and their metadata entries merged into one tensor of two chunks, as a two-rank save
    writes it.
    """
    root = tmp_path_factory.mktemp("dcp") / "src"
    w = torch.arange(16.0).reshape(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"top": w[:2].clone(), "bottom": w[2:].clone(), "step": 3}, checkpoint_id=str(root), no_dist=True)
    md = pickle.loads((root / ".metadata").read_bytes())
    entry = md.state_dict_metadata.pop("top")
    del md.state_dict_metadata["bottom"]
    entry.size = torch.Size((4, 4))
    entry.chunks = []
    for name, row in (("top", 0), ("bottom", 2)):
        offsets = torch.Size((row, 0))
        entry.chunks.append(ChunkStorageMetadata(offsets, torch.Size((2, 4))))
        md.storage_data[MetadataIndex("w", offsets)] = md.storage_data.pop(MetadataIndex(name, torch.Size((0, 0))))
    md.state_dict_metadata["w"] = entry
    (root / ".metadata").write_bytes(pickle.dumps(md))
    assert torch.equal(dc.load(_request(), root)["w"], w)
    return root


def _forge(src: Path, target: Path, change: Change) -> Path:
    shutil.copytree(src, target)
    md = pickle.loads((target / ".metadata").read_bytes())
    change(md)
    (target / ".metadata").write_bytes(pickle.dumps(md))
    return target


def _request() -> dict:
    return {"w": dc.ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4))}


def _refused_everywhere(ckpt: Path, words: str) -> None:
    """Every loader raises CorruptCheckpointError naming the key and ``words``; verify reports it."""
    loaders = {
        "load": lambda: dc.load(_request(), ckpt),
        "load_plain_tensors": lambda: load_plain_tensors(ckpt),
        "load_tensors_metadata": lambda: load_tensors_metadata(ckpt),
        "unshard": lambda: dc.unshard(ckpt),
    }
    for name, call in loaders.items():
        with pytest.raises(dc.CorruptCheckpointError, match=words) as info:
            call()
        assert "'w'" in str(info.value) and str(ckpt) in str(info.value), name
    report = dc.verify_checkpoint(ckpt)
    assert not report.ok
    assert any("'w'" in str(p) and words in str(p) for p in report.problems), report.problems


def _chunks(md: Metadata):  # type: ignore[no-untyped-def]
    return md.state_dict_metadata["w"].chunks


def test_a_chunk_listed_many_times_is_refused(plain_dcp, tmp_path):
    def duplicate(md: Metadata) -> None:
        md.state_dict_metadata["w"].chunks = _chunks(md) * 200

    _refused_everywhere(_forge(plain_dcp, tmp_path / "dup", duplicate), "listed 200 times")


def test_overlapping_chunks_are_refused(plain_dcp, tmp_path):
    def overlap(md: Metadata) -> None:
        second = _chunks(md)[1]
        md.storage_data[MetadataIndex("w", torch.Size((1, 0)))] = md.storage_data.pop(
            MetadataIndex("w", second.offsets)
        )
        second.offsets = torch.Size((1, 0))  # rows 1..2: row 1 twice, row 3 never

    _refused_everywhere(_forge(plain_dcp, tmp_path / "overlap", overlap), "overlap")


def test_a_coverage_gap_is_refused(plain_dcp, tmp_path):
    def gap(md: Metadata) -> None:
        md.state_dict_metadata["w"].size = torch.Size((6, 4))

    _refused_everywhere(_forge(plain_dcp, tmp_path / "gap", gap), "gap")


def test_a_huge_declared_size_is_refused_before_allocating(plain_dcp, tmp_path):
    def huge(md: Metadata) -> None:
        md.state_dict_metadata["w"].size = torch.Size((2**40, 2**40))

    _refused_everywhere(_forge(plain_dcp, tmp_path / "huge", huge), "gap")


def test_a_huge_chunk_without_its_bytes_is_refused(plain_dcp, tmp_path):
    def huge(md: Metadata) -> None:
        entry = md.state_dict_metadata["w"]
        entry.size = torch.Size((2**40, 2**40))
        info = md.storage_data.pop(MetadataIndex("w", entry.chunks[1].offsets))
        entry.chunks = [ChunkStorageMetadata(torch.Size((0, 0)), torch.Size((2**40, 2**40)))]
        md.storage_data[MetadataIndex("w", torch.Size((0, 0)))] = info

    _refused_everywhere(_forge(plain_dcp, tmp_path / "huge_chunk", huge), "bytes")


def test_a_key_read_from_the_metadata_is_validated(plain_dcp, tmp_path):
    def hostile(md: Metadata) -> None:
        md.state_dict_metadata["../../../x"] = md.state_dict_metadata.pop("step")
        md.storage_data[MetadataIndex("../../../x")] = md.storage_data.pop(MetadataIndex("step"))

    ckpt = _forge(plain_dcp, tmp_path / "key", hostile)
    for call in (lambda: load_tensors_metadata(ckpt), lambda: dc.load_common_state_dict(ckpt)):
        with pytest.raises(dc.CorruptCheckpointError, match=r"\.\./\.\./\.\./x") as info:
            call()
        assert isinstance(info.value.__cause__, dc.InvalidKeyError)
    assert not dc.verify_checkpoint(ckpt).ok


def test_a_declared_dtype_over_data_of_another_is_refused_unless_a_cast_is_asked(plain_dcp, tmp_path):
    """``.metadata`` says float64, the items hold float32: loads cast silently before."""

    def retype(md: Metadata) -> None:
        md.state_dict_metadata["w"].properties.dtype = torch.float64

    ckpt = _forge(plain_dcp, tmp_path / "dtype", retype)
    calls = {
        "load_plain_tensors": lambda: load_plain_tensors(ckpt),
        "unshard": lambda: dc.unshard(ckpt),
        "convert": lambda: dc.convert(ckpt, tmp_path / "converted", "safetensors"),
        "load": lambda: dc.load(
            {"w": dc.ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4, dtype=torch.float64))}, ckpt
        ),
    }
    for name, call in calls.items():
        with pytest.raises(dc.CorruptCheckpointError, match="stored as torch.float32") as info:
            call()
        assert "'w'" in str(info.value) and "float64" in str(info.value), name
    report = dc.verify_checkpoint(ckpt)
    assert not report.ok
    assert any("stored as torch.float32, the DCP metadata declares torch.float64" in str(p) for p in report.problems)
    # a request of another dtype asks for a cast: it gets the stored values, converted
    wanted = dc.ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4, dtype=torch.float16))
    loaded = dc.load({"w": wanted}, ckpt)["w"]
    assert loaded.dtype == torch.float16 and torch.equal(loaded, torch.arange(16.0).reshape(4, 4).half())


def test_a_huge_chunk_with_forged_bytes_is_refused_before_allocating(plain_dcp, tmp_path):
    """4 TiB declared in one chunk whose item claims 4 TiB of a small file: allocating it for
    ``unshard`` failed with a raw RuntimeError (or took the machine's memory)."""

    def huge(md: Metadata) -> None:
        entry = md.state_dict_metadata["w"]
        entry.size = torch.Size((2**20, 2**20))
        info = md.storage_data.pop(MetadataIndex("w", entry.chunks[1].offsets))
        del md.storage_data[MetadataIndex("w", entry.chunks[0].offsets)]
        entry.chunks = [ChunkStorageMetadata(torch.Size((0, 0)), torch.Size((2**20, 2**20)))]
        info.length = 2**42 + 4096
        md.storage_data[MetadataIndex("w", torch.Size((0, 0)))] = info

    _refused_everywhere(_forge(plain_dcp, tmp_path / "forged_length", huge), "truncated")


def test_chunks_that_tile_but_do_not_match_their_items_are_refused(plain_dcp, tmp_path):
    """Rows [0, 3) and [3, 4) tile the tensor, but the items hold two rows each."""

    def reshape(md: Metadata) -> None:
        top, bottom = _chunks(md)
        md.storage_data[MetadataIndex("w", torch.Size((3, 0)))] = md.storage_data.pop(
            MetadataIndex("w", bottom.offsets)
        )
        top.sizes, bottom.offsets, bottom.sizes = torch.Size((3, 4)), torch.Size((3, 0)), torch.Size((1, 4))

    ckpt = _forge(plain_dcp, tmp_path / "reshaped", reshape)
    for call in (lambda: dc.load(_request(), ckpt), lambda: load_plain_tensors(ckpt), lambda: dc.unshard(ckpt)):
        with pytest.raises(dc.CorruptCheckpointError, match=str(ckpt)):
            call()
