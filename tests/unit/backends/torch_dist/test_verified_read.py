"""torch_dist checksums are computed as DCP writes the bytes and checked as DCP reads them: a
tensor's data record has a span of its own, the small writes of each archive are gathered into
one, a damaged byte anywhere in an item is caught at load and by verify, and the data record is
not read a second time to check it."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

import dist_ckpt as dc
from dist_ckpt.backends.torch_dist import checksums as checksums_module
from dist_ckpt.backends.torch_dist import verified_read
from dist_ckpt.backends.torch_dist.checksums import (
    CHECKSUMS_FILENAME,
    OWN_SPAN_BYTES,
    FileSpans,
    RecordingStream,
    item_spans,
    parse_manifest,
)
from dist_ckpt.backends.torch_dist.metadata import read_metadata
from dist_ckpt.backends.torch_dist.save import TorchDistSaveShardedStrategy
from dist_ckpt.backends.torch_dist.verified_read import CheckedView, ItemCheck
from dist_ckpt.errors import ChecksumMismatchError, CorruptCheckpointError
from dist_ckpt.integrity.checksums import crc32c
from dist_ckpt.tools.verify import verify_checkpoint

BIG = OWN_SPAN_BYTES  # float32 elements: a data record of 4 x OWN_SPAN_BYTES bytes


def state() -> Dict[str, Any]:
    return {
        "big": dc.ShardedTensor.from_rank_offsets("big", torch.arange(BIG, dtype=torch.float32)),
        "small": dc.ShardedTensor.from_rank_offsets("small", torch.arange(4, dtype=torch.float32)),
        "obj": dc.ShardedObject("obj", {"seed": 3}, (1,), (0,)),
    }


def request() -> Dict[str, Any]:
    return {
        "big": dc.ShardedTensor.from_rank_offsets("big", torch.zeros(BIG)),
        "small": dc.ShardedTensor.from_rank_offsets("small", torch.zeros(4)),
        "obj": dc.ShardedObject("obj", None, (1,), (0,)),
    }


def save(path: Path) -> Path:
    dc.save(state(), path, sharded_strategy=TorchDistSaveShardedStrategy(thread_count=1))
    return path


def item_of(ckpt: Path, key: str, offset: Any = None) -> Any:
    return read_metadata(ckpt).storage_data[MetadataIndex(key, offset)]


def spans_of(ckpt: Path, info: Any) -> List[Any]:
    manifest = parse_manifest((ckpt / CHECKSUMS_FILENAME).read_bytes(), CHECKSUMS_FILENAME)
    spans = manifest[info.relative_path].spans
    found = item_spans([s[0] for s in spans], spans, info.offset, info.length)
    assert found is not None
    return found


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_data_record_has_a_span_of_its_own(tmp_path: Path) -> None:
    ckpt = save(tmp_path / "c")
    big = item_of(ckpt, "big", (0,))
    spans = spans_of(ckpt, big)
    data = (ckpt / big.relative_path).read_bytes()
    records = [(o, n) for o, n, _ in spans if n == BIG * 4]
    assert len(spans) == 3 and len(records) == 1
    start, n = records[0]
    assert data[start : start + n] == torch.arange(BIG, dtype=torch.float32).numpy().tobytes()
    assert len(spans_of(ckpt, item_of(ckpt, "small", (0,)))) == 1  # small items: one span, as before
    assert all(crc32c(data[o : o + n]) == c for o, n, c in spans)


class _Raw(io.RawIOBase):
    def __init__(self) -> None:
        self.data = bytearray()
        self.writes: List[int] = []

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        self.data += view
        self.writes.append(view.nbytes)
        return view.nbytes


def test_small_writes_pass_on_as_one_and_large_ones_have_their_own_span() -> None:
    raw = _Raw()
    reported: Dict[str, FileSpans] = {}
    stream = RecordingStream(raw, "f", reported.__setitem__)  # type: ignore[arg-type]
    assert stream.tell() == 0
    for i in range(10):
        stream.write(bytes([i]) * 3)
    stream.write(memoryview(torch.arange(4, dtype=torch.int32).numpy()))  # not a byte format
    large = bytes(range(256)) * (OWN_SPAN_BYTES // 256)
    stream.write(large)
    stream.write(b"tail")
    assert stream.tell() == 46 + len(large) + 4
    stream.close()
    data = bytes(raw.data)
    assert raw.writes == [46, len(large), 4]
    assert reported["f"] == FileSpans(
        len(data), ((0, 46, crc32c(data[:46])), (46, len(large), crc32c(large)), (46 + len(large), 4, crc32c(b"tail")))
    )


def test_fileno_passes_pending_bytes_on_first(tmp_path: Path) -> None:
    with open(tmp_path / "f", "wb") as raw:
        stream = RecordingStream(raw, "f", lambda *_: None)
        stream.write(b"abc")
        os.fsync(stream.fileno())
        assert (tmp_path / "f").read_bytes() == b"abc"
        stream.close()


def test_the_data_record_is_checked_as_it_is_read_not_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = save(tmp_path / "c")
    read_again: List[int] = []
    pread = os.pread

    def counting(fd: int, n: int, offset: int) -> bytes:
        read_again.append(n)
        return pread(fd, n, offset)

    monkeypatch.setattr(verified_read.os, "pread", counting)
    loaded = dc.load(request(), ckpt)
    assert torch.equal(loaded["big"], torch.arange(BIG, dtype=torch.float32)) and loaded["obj"] == {"seed": 3}
    assert read_again and max(read_again) < OWN_SPAN_BYTES  # headers only, never the data record


@pytest.mark.parametrize("part", ["header", "data", "trailer"])
def test_a_damaged_byte_anywhere_in_an_item_fails_the_load_and_verify(tmp_path: Path, part: str) -> None:
    ckpt = save(tmp_path / "c")
    big = item_of(ckpt, "big", (0,))
    header, record, _ = spans_of(ckpt, big)
    at = {"header": big.offset + 10, "data": record[0] + 1000, "trailer": big.offset + big.length - 30}[part]
    flip(ckpt / big.relative_path, at)
    with pytest.raises(ChecksumMismatchError) as error:
        dc.load(request(), ckpt)
    assert str(ckpt / big.relative_path) in str(error.value)
    report = verify_checkpoint(ckpt)
    assert [(p.path, p.key) for p in report.problems] == [(big.relative_path, "big")]


def test_a_damaged_object_is_caught_before_it_is_unpickled(tmp_path: Path) -> None:
    ckpt = save(tmp_path / "c")
    obj = item_of(ckpt, "obj/shard_0_1")
    flip(ckpt / obj.relative_path, obj.offset + obj.length // 2)
    with pytest.raises(ChecksumMismatchError):
        dc.load({"obj": dc.ShardedObject("obj", None, (1,), (0,))}, ckpt)


def test_a_file_truncated_inside_a_data_record_is_corrupt(tmp_path: Path) -> None:
    ckpt = save(tmp_path / "c")
    big = item_of(ckpt, "big", (0,))
    _, record, _ = spans_of(ckpt, big)
    path = ckpt / big.relative_path
    path.write_bytes(path.read_bytes()[: record[0] + 100])
    with pytest.raises(CorruptCheckpointError) as error:
        dc.load(request(), ckpt)
    assert str(path) in str(error.value)


def test_checkpoints_with_one_span_per_item_still_load_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifests written before data records had spans of their own: the item is read again."""
    with monkeypatch.context() as patch:
        patch.setattr(checksums_module, "OWN_SPAN_BYTES", 1 << 40)
        ckpt = save(tmp_path / "c")
    big = item_of(ckpt, "big", (0,))
    assert spans_of(ckpt, big) == [spans_of(ckpt, big)[0]] and spans_of(ckpt, big)[0][1] == big.length
    assert torch.equal(dc.load(request(), ckpt)["big"], torch.arange(BIG, dtype=torch.float32))
    flip(ckpt / big.relative_path, big.offset + big.length // 2)
    with pytest.raises(ChecksumMismatchError):
        dc.load(request(), ckpt)


def test_item_check_takes_reads_in_any_order_and_reads_the_rest(tmp_path: Path) -> None:
    data = bytes(range(200))
    (tmp_path / "f").write_bytes(b"xx" + data)
    spans = [(2, 50, crc32c(data[:50])), (52, 150, crc32c(data[50:]))]
    check = ItemCheck(spans, "f", "item")
    check.feed(60, data[58:100])  # not where span 2 continues: ignored
    check.feed(52, data[50:60])
    check.feed(60, data[58:100])  # continues span 2
    check.feed(2, data[:10])
    with open(tmp_path / "f", "rb") as f:
        check.finish(f.fileno())
    bad = ItemCheck([(2, 50, crc32c(data[:50]) ^ 1)], "f", "item")
    with open(tmp_path / "f", "rb") as f, pytest.raises(ChecksumMismatchError, match="bytes 2:52 of f"):
        bad.finish(f.fileno())


def test_checked_view_reads_like_the_view_it_wraps() -> None:
    payload = io.BytesIO()
    torch.save(torch.arange(10), payload)
    raw = payload.getvalue()
    check = ItemCheck([(0, len(raw), crc32c(raw))], "f", "item")
    view = CheckedView(io.BytesIO(raw), 0, check)
    assert torch.equal(torch.load(view, weights_only=True), torch.arange(10))
    assert view.seek(5) == 5 and view.read(3) == raw[5:8] and view.tell() == 8
