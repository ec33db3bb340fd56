"""Load ShardedTensors from safetensors files described by a `TensorIndex`.

Both the ``safetensors`` backend (whose index is its ``index.json``) and HuggingFace checkpoints
(whose index is built from the files' headers) describe where each stored shard lives: file,
byte range, and which box (or flattened range of a box) of the global tensor it holds. Given that
description, `load_from_index()` loads any sharding of the tensors:

1. check every requested key, dtype and global shape against the index (one error listing
   every problem, before anything is opened);
2. plan: intersect each requested piece with the stored pieces it overlaps (looked up on the
   stored chunk grid, not by scanning every shard), check that the stored data covers it;
3. open each file the plan touches once and validate its header (size, dtype, shape and byte
   range of every stored shard in it) -- still before any tensor byte is read;
4. zero the parts outside the stored tensor (``allow_shape_mismatch``), then read, tensor by
   tensor in the order their bytes lie in each file, about one stream per two files (each file
   read sequentially, which the kernel's readahead serves at the disk's speed, a few streams at
   once; in the order of the state dict the reads of a 2-rank load jumped between files and
   offsets), in place where the destination allows it
   (see `safetensors_io`), on a few threads (`read_threads`); a request
   in another dtype than the stored one is read through the bounce buffers and converted
   (``ReadOptions.allow_dtype_cast``; see `dist_ckpt.model.dtype_cast`);
5. when the index records checksums (and ``ReadOptions.verify_checksums``), check the crc32c of
   each file's header when it is opened and of every block as the reads complete (reads are
   widened to whole blocks; see `safetensors_blocks`).

The files are read through readers of ``TensorIndex.storage`` (each file opened once): with
``positional_reads`` (a local disk) ``os.preadv`` straight into the destination; otherwise (an
object store) ranged GETs into the same buffers, on ``ReadOptions.object_store_threads`` threads,
with the files' headers fetched concurrently.

No collective is called: the loader works in a single process without a process group.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from dist_ckpt.backends.base import load_destination
from dist_ckpt.backends.request_checks import check_requested_tensors
from dist_ckpt.backends.safetensors.blocks import ShardCheck
from dist_ckpt.backends.safetensors.format import SafetensorsHeader, read_header, storage_layout
from dist_ckpt.backends.safetensors.io import ReadOp, ReadOptions, byte_view, plan_copy
from dist_ckpt.backends.safetensors.read_threads import execute
from dist_ckpt.backends.safetensors.tensor_index import StoredShard, StoredTensor, TensorIndex
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import ChecksumMismatchError, CorruptCheckpointError, format_keys
from dist_ckpt.integrity.checksums import crc_to_hex
from dist_ckpt.model.dict_utils import dict_list_map_inplace, nested_values
from dist_ckpt.model.geometry import Box, ShardPiece, piece_view, shard_pieces, sub_view
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor, StateDict
from dist_ckpt.storage import ObjectReader
from dist_ckpt.storage.host_memory import piece_bytes

__all__ = ["FileCheck", "PlannedReads", "default_file_check", "load_from_index", "plan_reads"]


#: checks an opened file against the index before any read; raises CorruptCheckpointError
FileCheck = Callable[[SafetensorsHeader, Sequence[Tuple[str, StoredShard]]], None]


# --------------------------------------------------------------------------- checks


def _check_requests(requested: Sequence[ShardedTensor], index: TensorIndex, allow_dtype_cast: bool) -> None:
    def lookup(key: str) -> Optional[Tuple[torch.dtype, Tuple[int, ...]]]:
        info = index.lookup(key)
        return None if info is None else (info.dtype, tuple(info.global_shape))

    check_requested_tensors(requested, lookup, index.description, allow_dtype_cast)


def default_file_check(index: TensorIndex) -> FileCheck:
    """The check of a file against what the index says is in it (dtype, shape, byte range, size)."""

    def check(header: SafetensorsHeader, shards: Sequence[Tuple[str, StoredShard]]) -> None:
        expected_size = index.file_sizes.get(PurePosixPath(str(header.path)).name)
        if expected_size is not None and expected_size != header.file_size:
            raise CorruptCheckpointError(
                f"[rank {get_rank()}] safetensors file {str(header.path)!r} (tensors "
                f"{format_keys(sorted({k for k, _ in shards}))}) has {header.file_size} bytes, the "
                f"index of {index.description} says {expected_size} (truncated or replaced)"
            )
        for key, shard in shards:
            entry = header.entries.get(shard.name)
            info = index.lookup(key)
            assert info is not None
            st_name, shape = storage_layout(info.dtype, shard.stored_shape)
            found = None if entry is None else (entry.dtype, entry.shape, (entry.begin, entry.end))
            wanted_dtype = torch.float64 if info.dtype == torch.complex128 else info.dtype
            if found != (wanted_dtype, shape, shard.byte_range):
                raise CorruptCheckpointError(
                    f"[rank {get_rank()}] tensor {key!r}: safetensors file {str(header.path)!r} "
                    + (
                        f"has no tensor named {shard.name!r}"
                        if entry is None
                        else f"stores {shard.name!r} as {entry.dtype} {list(entry.shape)} at bytes "
                        f"{entry.begin}:{entry.end}, the index says {st_name} {list(shape)} at "
                        f"{shard.byte_range[0]}:{shard.byte_range[1]}"
                    )
                )

    return check


# --------------------------------------------------------------------------- planning


@dataclass
class _Planned:
    """One requested piece's overlap with one stored piece."""

    shard: StoredShard
    key: str
    src_box: Box
    src_offset: int
    inter: Box
    dst_piece: ShardPiece


class _OpenFiles:
    """Readers of the files a load touches, each opened and validated once."""

    def __init__(self, index: TensorIndex, check: FileCheck, verify_header_crcs: bool) -> None:
        self.index = index
        self.check = check
        self.verify_header_crcs = verify_header_crcs
        self.fds: Dict[str, ObjectReader] = {}

    def _open(self, name: str) -> ObjectReader:
        reader = self.index.storage.open_reader(name)
        if self.index.from_headers:  # no header read below to find a missing object
            try:
                reader.size()
            except BaseException:
                reader.close()
                raise
        return reader

    def open_all(self, by_file: Dict[str, List[Tuple[str, StoredShard]]]) -> None:
        names = sorted(by_file)
        if self.index.storage.positional_reads or len(names) <= 1:
            for name in names:
                self._open_checked(name, by_file[name])
            return
        # an object store: each header costs a few round trips, so fetch them concurrently
        with ThreadPoolExecutor(min(len(names), 16), thread_name_prefix="dist_ckpt_headers") as pool:
            for future in [pool.submit(self._open_checked, name, by_file[name]) for name in names]:
                future.result()

    def _open_checked(self, name: str, shards: List[Tuple[str, StoredShard]]) -> None:
        path = self.index.file_location(name)
        keys = format_keys(sorted({k for k, _ in shards}))
        try:
            fd = self._open(name)
            self.fds[name] = fd
            header = None if self.index.from_headers else read_header(fd, path)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"[rank {get_rank()}] safetensors file {str(path)!r}, which holds tensors {keys} "
                f"of {self.index.description}, is missing"
            ) from None
        except CorruptCheckpointError as exc:  # the header names the file, not what it holds
            raise type(exc)(f"[rank {get_rank()}] tensors {keys}: {exc}") from None
        if header is not None:
            expected = self.index.header_crcs.get(name)
            if self.verify_header_crcs and expected is not None and header.prefix_crc != expected:
                raise ChecksumMismatchError(
                    f"[rank {get_rank()}] the header of safetensors file {str(path)!r} (tensors "
                    f"{keys}) has crc32c {crc_to_hex(header.prefix_crc)}, "
                    f"the index of {self.index.description} recorded {crc_to_hex(expected)}: the file is corrupt"
                )
            self.check(header, shards)

    def close(self) -> None:
        for reader in self.fds.values():
            reader.close()
        self.fds.clear()


def _plan_tensor(sh: ShardedTensor, info: StoredTensor, index: TensorIndex) -> Tuple[List[_Planned], List[ShardPiece]]:
    rng = None if sh.flattened_range is None else (sh.flattened_range.start, sh.flattened_range.stop)
    itemsize = info.dtype.itemsize  # of the stored values, whatever the requested dtype
    planned: List[_Planned] = []
    pad: List[ShardPiece] = []
    expected = covered = 0
    for piece in shard_pieces(sh.global_offset, sh.local_shape, sh.prepend_axis_num, rng):
        region = piece.box.intersect(info.bounds)
        if region != piece.box:
            pad.append(piece)
        if region is None:
            continue
        expected += region.numel
        for shard in info.overlapping(region):
            for sp in shard.pieces():
                inter = region.intersect(sp.box)
                if inter is None:
                    continue
                offset = shard.byte_range[0] + (sp.flat_offset or 0) * itemsize
                planned.append(_Planned(shard, sh.key, sp.box, offset, inter, piece))
                covered += inter.numel
    if covered != expected:
        raise CorruptCheckpointError(
            f"[rank {get_rank()}] tensor {sh.key!r} in {index.description}: the stored shards cover {covered} of "
            f"the {expected} requested elements (shards are missing from the index, or overlap)"
        )
    return planned, pad


PlannedReads = Dict[int, Tuple[List[_Planned], List[ShardPiece]]]


def plan_reads(
    requested: Sequence[ShardedTensor], index: TensorIndex, allow_dtype_cast: bool = False
) -> Tuple[PlannedReads, Dict[str, List[Tuple[str, StoredShard]]]]:
    """Steps 1 and 2 of `load_from_index()`, without any I/O: check the requests against the
    index (a request in another dtype than the stored one is refused unless ``allow_dtype_cast``),
    and intersect each with the stored shards it overlaps (checking that they cover it).

    Returns the overlaps and zero-filled pieces of each request (by ``id``), and the stored shards
    to read, by file. Only the index entries of the requested tensors are looked at, so a rank's
    planning costs O(its requests + the entries they need) whatever the size of the checkpoint.

    Example:

    ```python
    plans, by_file = plan_reads([ShardedTensor.from_rank_offsets("w", torch.empty(4))], read_index(ckpt))
    ```
    """
    _check_requests(requested, index, allow_dtype_cast)
    if index.prefetch is not None:
        index.prefetch([sh.key for sh in requested])
    plans: PlannedReads = {}
    by_file: Dict[str, List[Tuple[str, StoredShard]]] = {}
    seen: Set[Tuple[str, str]] = set()
    for sh in requested:
        info = index.lookup(sh.key)
        assert info is not None
        planned, pad = _plan_tensor(sh, info, index)
        plans[id(sh)] = (planned, pad)
        for p in planned:
            if (p.shard.file, p.shard.name) not in seen:
                seen.add((p.shard.file, p.shard.name))
                by_file.setdefault(p.shard.file, []).append((sh.key, p.shard))
    return plans, by_file


def load_from_index(
    sharded_state_dict: ShardedStateDict, index: TensorIndex, options: ReadOptions, check: Optional[FileCheck] = None
) -> StateDict:
    """Replace every ShardedTensor of ``sharded_state_dict`` by its data, read from ``index``.

    Tensors are filled in place when ``ShardedTensor.data`` is allocated with the right shape
    (any device); otherwise new CPU tensors are returned. See the module docstring for the steps.

    Args:
        sharded_state_dict: the request; other leaves are returned unchanged.
        index: where the stored tensors live.
        options: read threads and buffer sizes.
        check: validates each opened file against the index (default: `default_file_check()`).

    Example:

    ```python
    index = TensorIndex(LocalStorage(ckpt), {"w": StoredTensor("w", torch.float32, (4,), [shard])})
    loaded = load_from_index({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4))}, index, ReadOptions())
    ```
    """
    requested = [s for s in nested_values(sharded_state_dict) if isinstance(s, ShardedTensor)]
    # 1. and 2. keys, dtypes (cast or refused, per options.allow_dtype_cast), shapes; every overlap, checking coverage
    plans, by_file = plan_reads(requested, index, options.allow_dtype_cast)
    dests: Dict[int, torch.Tensor] = {}  # allocated once the files are open (see below)
    # 3. open and validate every file the plan touches
    verify = options.verify_checksums and index.block_bytes is not None
    if not index.storage.positional_reads:  # every read is a request: more in flight, fewer small ones
        options = options.for_object_store()
    # with a host-memory budget the threads' bounce buffers (GPU or strided destinations) share it
    bounce = piece_bytes(options.bounce_buffer_bytes, shares=options.thread_count)
    if bounce != options.bounce_buffer_bytes:
        options = replace(options, bounce_buffer_bytes=bounce)
    files = _OpenFiles(index, check or default_file_check(index), verify)

    def read_ops() -> Iterator[ReadOp]:
        for sh in _in_file_order(requested, plans):
            dest, (planned, pad) = dests[id(sh)], plans[id(sh)]
            holder = Box(sh.global_offset, sh.full_local_shape)
            for piece in pad:  # zero-fill the parts the checkpoint does not have, before reading
                piece_view(dest, piece, sh.prepend_axis_num, holder).zero_()
            yield from _read_ops(sh, dest, holder, planned, files, index, options, verify)

    try:
        files.open_all(by_file)
        # destinations only now: the files' real sizes back what the index says (a forged index
        # cannot make this allocate more than the files hold)
        dests.update((id(sh), load_destination(sh)) for sh in requested)
        # 4. and 5. read and check; the threads start on the first tensor while the next ones are planned
        execute(read_ops(), options)
    finally:
        files.close()

    def result(x: Any) -> Any:
        return dests[id(x)] if isinstance(x, ShardedTensor) else x

    return dict_list_map_inplace(result, sharded_state_dict)  # type: ignore[no-any-return]


def _in_file_order(requested: Sequence[ShardedTensor], plans: PlannedReads) -> List[ShardedTensor]:
    """``requested`` in the order their first stored bytes lie in the files, in about one stream
    per two files: the files are dealt to ``ceil(files / 2)`` streams, a stream reads its files
    one after the other, each from start to end, and the streams take turns.

    Why: a cold read is fastest when each file is read sequentially (the kernel's readahead),
    and the disk wants a few streams at once, not one per file. Measured on the test VM (1.5 GB,
    2 ranks): a same-layout load, two files per rank, was fastest reading its files one after the
    other; a 4 -> 1 resharded load of eight files was 20-40% slower that way than with the files
    taken in turn. Requests that read nothing come first.
    """
    by_file: Dict[str, List[Tuple[int, int]]] = {}
    empty: List[ShardedTensor] = []
    for i, sh in enumerate(requested):
        planned = plans[id(sh)][0]
        if not planned:
            empty.append(sh)
            continue
        file, offset = min((p.shard.file, p.src_offset) for p in planned)
        by_file.setdefault(file, []).append((offset, i))
    streams: List[List[int]] = [[] for _ in range(-(-len(by_file) // 2))]
    for f, (_, entries) in enumerate(sorted(by_file.items())):
        streams[f % len(streams)].extend(i for _, i in sorted(entries))
    turns = sorted((k, s, i) for s, stream in enumerate(streams) for k, i in enumerate(stream))
    return empty + [requested[i] for _, _, i in turns]


def _read_ops(
    sh: ShardedTensor,
    dest: torch.Tensor,
    holder: Box,
    planned: Sequence[_Planned],
    files: _OpenFiles,
    index: TensorIndex,
    options: ReadOptions,
    verify: bool,
) -> List[ReadOp]:
    dest_bytes = byte_view(dest)
    info = index.lookup(sh.key)
    assert info is not None
    ops: List[ReadOp] = []
    for p in planned:
        fd, path = files.fds[p.shard.file], index.file_location(p.shard.file)
        shard_check = None
        if verify and p.shard.crcs is not None and index.block_bytes is not None:
            begin, end = p.shard.byte_range
            shard_check = ShardCheck(path, sh.key, p.shard.name, begin, end, index.block_bytes, p.shard.crcs)
        piece = p.dst_piece
        dst_base = 0 if piece.flat_offset is None else piece.flat_offset
        target = sub_view(piece_view(dest, piece, sh.prepend_axis_num, holder), piece.box, p.inter)
        ops.extend(
            plan_copy(
                fd,
                path,
                sh.key,
                p.src_box,
                p.src_offset,
                p.inter,
                piece.box,
                dst_base,
                dest_bytes,
                target,
                options,
                shard_check,
                info.dtype,
            )
        )
    return ops
