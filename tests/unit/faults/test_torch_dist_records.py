"""A torch_dist checkpoint written by dist_ckpt keeps failing closed once its side records are gone.

``dist_ckpt.json`` (the list of integrity records) and ``torch_dist.checksums.json`` (the crc32c
of every item) are files that Megatron-Core and DCP never read, so deleting both leaves a
checkpoint that every reader still loads. Without a mark inside a file every reader needs, it
would then look like one written by Megatron-Core (no checksums) and load a flipped byte
silently. ``.metadata`` carries that mark, in a field DCP and Megatron-Core ignore.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dist_ckpt as dc
from dist_ckpt.backends.torch_dist.checksums import CHECKSUMS_FILENAME
from dist_ckpt.backends.torch_dist.save import TorchDistSaveOptions, TorchDistSaveShardedStrategy
from dist_ckpt.record.commit import RECORD_FILENAME

from .scenario import check_loads, request, state, strategy


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    dc.save(state(2.0), path, sharded_strategy=strategy("torch_dist"))
    return path


def _flip_in_data_of_w(ckpt: Path) -> None:
    """Flip one bit inside the stored data of tensor ``w`` (16 x 16 of 2.0)."""
    record = torch.full((16, 16), 2.0).numpy().tobytes()
    for f in sorted(ckpt.glob("*.distcp")):
        raw = bytearray(f.read_bytes())
        at = raw.find(record)
        if at >= 0:
            raw[at + len(record) // 2] ^= 0x01
            f.write_bytes(bytes(raw))
            return
    raise AssertionError(f"the data of 'w' is in no .distcp file of {ckpt}")


def _drop_side_records(ckpt: Path) -> None:
    (ckpt / RECORD_FILENAME).unlink()
    (ckpt / CHECKSUMS_FILENAME).unlink()


def test_a_flipped_byte_without_the_side_records_is_refused(saved):
    _drop_side_records(saved)
    _flip_in_data_of_w(saved)
    with pytest.raises(dc.CorruptCheckpointError, match=CHECKSUMS_FILENAME) as info:
        dc.load(request(), saved)
    assert str(saved) in str(info.value)
    with pytest.raises(dc.CorruptCheckpointError, match=CHECKSUMS_FILENAME):
        dc.load_plain_tensors(saved)
    assert not dc.verify_checkpoint(saved).ok


def test_a_missing_manifest_fails_closed_without_the_side_record(saved):
    """Nothing flipped: the manifest alone is gone (and the record listing it), still refused."""
    _drop_side_records(saved)
    with pytest.raises(dc.CorruptCheckpointError, match="checksummed"):
        dc.load_tensors_metadata(saved)
    report = dc.verify_checkpoint(saved)
    assert not report.ok and any(CHECKSUMS_FILENAME in p.problem for p in report.problems), report


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_plain_dcp_still_loads_what_dist_ckpt_wrote(saved):
    """The mark in ``.metadata`` is invisible to torch.distributed.checkpoint's own reader."""
    out = {"w": torch.zeros(16, 16), "e": torch.zeros(8, dtype=torch.int64)}
    dcp.load(out, checkpoint_id=str(saved), no_dist=True)
    assert torch.equal(out["w"], torch.full((16, 16), 2.0))
    assert torch.equal(out["e"], torch.arange(8, dtype=torch.int64) * 2)


def test_a_checkpoint_saved_without_checksums_still_loads_without_a_manifest(tmp_path):
    """No checksums recorded: no mark, so the absent manifest is what the save wrote."""
    path = tmp_path / "ckpt"
    plain = TorchDistSaveShardedStrategy(thread_count=1, options=TorchDistSaveOptions(checksums=False))
    dc.save(state(2.0), path, sharded_strategy=plain)
    (path / RECORD_FILENAME).unlink()
    check_loads(path, 2.0)
