"""early_writes: the training process writes an async save's snapshot into its files while the
snapshot is taken, in block-aligned pieces, and says on a pipe whether every byte was written;
the background process waits for that word before it fsyncs, and a failure, or a training
process that ended first, fails the save instead of committing a half-written file."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, List, Tuple

import pytest
import torch

from dist_ckpt.asynchronous.channel import PassedFd
from dist_ckpt.asynchronous.progress import progress_count
from dist_ckpt.asynchronous.snapshot import SnapshotPool, file_order_layout
from dist_ckpt.backends.safetensors import early_writes
from dist_ckpt.backends.safetensors.early_writes import EarlyRegion, EarlyWriter, wait_for_early_writes
from dist_ckpt.errors import CheckpointingException
from dist_ckpt.storage import direct_io
from dist_ckpt.storage.direct_io import DIRECT_IO_ALIGN
from tests.deadlines import scaled

CHUNK = 3 * DIRECT_IO_ALIGN


def _tensors(seed: int) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(1000, generator=gen),
        torch.randint(-100, 100, (77,), generator=gen).to(torch.int8),
        torch.randn(5000, generator=gen).double(),
        torch.randn(3, 3, generator=gen),
    ]


def _setup(tmp_path: Path, offsets: List[int], split: int) -> Tuple[List[torch.Tensor], List[EarlyRegion], Any]:
    """Tensors 0..split-1 go to file a from offsets[0], the rest to file b from offsets[1]."""
    tensors = _tensors(0)
    sizes = [t.numel() * t.element_size() for t in tensors]
    layout = file_order_layout([(offsets[0], sizes[:split]), (offsets[1], sizes[split:])])
    slots = layout[0]
    regions = []
    slot_regions = []
    for r, (name, members) in enumerate((("a", range(split)), ("b", range(split, len(tensors))))):
        path = tmp_path / name
        path.write_bytes(b"H" * offsets[r])  # the header, written before
        mine = [slots[i] for i in members]
        regions.append(EarlyRegion(path, offsets[r], mine[0][0], mine[-1][0] + mine[-1][1]))
        slot_regions += [(r, o + n) for o, n in mine]
    return tensors, regions, (layout, slot_regions)


@pytest.fixture
def recorded(monkeypatch: Any) -> List[Tuple[str, int, int]]:
    """Every write_at call: (file name, file offset, bytes)."""
    calls: List[Tuple[str, int, int]] = []
    real = direct_io.write_at

    def recording(fd: int, direct_fd: Any, data: memoryview, offset: int) -> int:
        calls.append((Path(os.readlink(f"/proc/self/fd/{fd}")).name, offset, len(data)))
        return real(fd, direct_fd, data, offset)

    monkeypatch.setattr(direct_io, "write_at", recording)
    monkeypatch.setattr(early_writes, "STREAM_CHUNK_BYTES", CHUNK)
    return calls


@pytest.mark.parametrize("offsets", [[64, 128], [4096, 8192 + 40], [100, 3]])
def test_regions_land_in_their_files_in_block_aligned_pieces(
    tmp_path: Path, recorded: List[Tuple[str, int, int]], offsets: List[int]
) -> None:
    tensors, regions, (layout, slot_regions) = _setup(tmp_path, offsets, split=2)
    writer = EarlyWriter(regions, slot_regions)
    snapshot = SnapshotPool().take(tensors, in_use=lambda: writer.busy, layout=layout, on_copied=writer.copied)
    writer.finish()
    wait_for_early_writes(writer.status, str(tmp_path))
    writer._thread.join(scaled(5))
    assert not writer.busy
    for r, members in ((0, range(2)), (1, range(2, 4))):
        expected = b"H" * offsets[r] + b"".join(bytes(snapshot.view(i).numpy()) for i in members)
        assert regions[r].path.read_bytes() == expected
        assert expected[offsets[r] :] == b"".join(
            bytes(t.contiguous().view(torch.uint8).numpy()) for t in (tensors[i] for i in members)
        )
    # every piece but a region's last ends on a block of its file; pieces cover the region once
    for r, region in enumerate(regions):
        pieces = [(o, n) for name, o, n in recorded if name == region.path.name]
        assert pieces[0][0] == region.file_offset
        assert sum(n for _, n in pieces) == region.end - region.begin
        for (o, n), (next_o, _) in zip(pieces, pieces[1:]):
            assert o + n == next_o and next_o % DIRECT_IO_ALIGN == 0
    assert len(recorded) > 2  # the double tensor (40 KB) spans several pieces of 12 KiB


def test_a_failed_write_is_reported_and_nothing_more_is_written(tmp_path: Path, monkeypatch: Any) -> None:
    tensors, regions, (layout, slot_regions) = _setup(tmp_path, [64, 64], split=2)
    calls: List[int] = []

    def failing(fd: int, direct_fd: Any, data: memoryview, offset: int) -> int:
        calls.append(offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_io, "write_at", failing)
    before = len(os.listdir("/proc/self/fd"))
    writer = EarlyWriter(regions, slot_regions)
    SnapshotPool().take(tensors, in_use=lambda: writer.busy, layout=layout, on_copied=writer.copied)
    writer.finish()
    with pytest.raises(CheckpointingException) as raised:
        wait_for_early_writes(writer.status, "ckpt/safetensors")
    message = str(raised.value)
    assert "ckpt/safetensors" in message and "No space left" in message and str(regions[0].path) in message
    assert len(calls) == 1  # the pieces queued after the failure were not written
    writer._thread.join(scaled(5))
    writer.status.close()
    # the files were closed too (on a full disk, a deleted file held open keeps its space)
    assert len(os.listdir("/proc/self/fd")) == before


def test_files_missing_at_the_start_fail_the_save_at_once(tmp_path: Path) -> None:
    _, regions, (_, slot_regions) = _setup(tmp_path, [64, 64], split=2)
    regions[1].path.unlink()
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(FileNotFoundError):
        EarlyWriter(regions, slot_regions)
    assert len(os.listdir("/proc/self/fd")) == before  # file a's descriptors were closed


def test_an_aborted_snapshot_writes_nothing_more_and_says_why(
    tmp_path: Path, recorded: List[Tuple[str, int, int]]
) -> None:
    tensors, regions, (layout, slot_regions) = _setup(tmp_path, [64, 64], split=2)
    writer = EarlyWriter(regions, slot_regions)
    writer.copied(SnapshotPool().take(tensors[:1], in_use=lambda: False).buffer, 0)  # a piece at most
    writer.abort("the snapshot failed: RuntimeError: CUDA error")
    with pytest.raises(CheckpointingException, match="CUDA error"):
        wait_for_early_writes(writer.status, "ckpt/safetensors")
    assert not recorded


def test_the_report_is_read_without_waiting_for_end_of_file() -> None:
    """A child forked while the thread ran may hold the pipe's write end: the report line, not
    end-of-file, ends the wait; each piece mark before it is noted as progress."""
    read_end, write_end = os.pipe()
    before = progress_count()
    os.write(write_end, b"\x06\x06\x06ok\n")  # the write end stays open
    try:
        wait_for_early_writes(PassedFd(read_end), "ckpt/safetensors")
    finally:
        os.close(write_end)
    assert progress_count() - before == 3


def test_a_forked_child_does_not_keep_the_report_pipe(tmp_path: Path) -> None:
    tensors, regions, (layout, slot_regions) = _setup(tmp_path, [64, 64], split=2)
    writer = EarlyWriter(regions, slot_regions)
    pid = os.fork()
    if pid == 0:  # the child: its copy of the pipe's write end must be closed
        try:
            os.fstat(writer._report_fd if writer._report_fd >= 0 else -1)
            os._exit(1)
        except OSError:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    SnapshotPool().take(tensors, in_use=lambda: writer.busy, layout=layout, on_copied=writer.copied)
    writer.finish()
    wait_for_early_writes(writer.status, "ckpt/safetensors")
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_training_process_that_ended_first_fails_the_wait() -> None:
    read_end, write_end = os.pipe()
    os.close(write_end)  # as when the process holding it ends
    with pytest.raises(CheckpointingException, match="ended before its writes finished"):
        wait_for_early_writes(PassedFd(read_end), "ckpt/safetensors")


def test_a_dropped_request_does_not_stop_the_thread(tmp_path: Path) -> None:
    """Nobody waits any more (the status was closed): the thread still ends cleanly."""
    tensors, regions, (layout, slot_regions) = _setup(tmp_path, [64, 64], split=2)
    writer = EarlyWriter(regions, slot_regions)
    writer.status.close()
    SnapshotPool().take(tensors, in_use=lambda: writer.busy, layout=layout, on_copied=writer.copied)
    writer.finish()
    writer._thread.join(scaled(5))
    assert not writer.busy


def test_importing_registers_no_fork_handler() -> None:
    """The fork handler is registered by the first EarlyWriter, not by importing dist_ckpt."""
    probe = (
        "import dist_ckpt\n"
        "from dist_ckpt.backends.safetensors import early_writes\n"
        "print(early_writes._close_pipes_in_forked_children.cache_info().currsize)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "0"
