"""DCP's file system writer split for asynchronous saves: Megatron-Core's ``FileSystemWriterAsync``.

DCP's ``FileSystemWriter.write_data`` plans and writes in one call. Megatron-Core's asynchronous
``torch_dist`` save splits it in three, and so does `FileSystemWriterAsync`:

1. ``prepare_write_data(plan, planner)`` (on the training process): the plan's items are binned by
   size into at most ``thread_count`` files per rank (``separation_hint``: the items whose key
   starts with it go to files of their own), each item's data resolved -- a CPU tensor that is
   part of a larger storage is narrowed to its own bytes, a non-contiguous one copied; GPU
   tensors stay where they are until the ``preload_fn``;
2. ``get_save_function_and_args()`` returns ``(save_fn, preload_fn, args)``: ``preload_fn()``
   copies the GPU tensors to the host (the new ``args[1]``), then ``save_fn(*args)`` writes every
   file on a thread of its own -- through the checkpoint's `Storage` (each file complete under its
   name or absent, durable when ``sync_files``), calling no collective, so it may run in a
   background process ([`AsyncCallsQueue`][dist_ckpt.asynchronous.queue.AsyncCallsQueue]) -- and
   leaves this rank's DCP write results for step 3 (a small ``.write_results.<rank>.json``
   beside the files: the background process may be another process);
3. ``retrieve_write_results()`` (at finalization) reads them back (and deletes the file), for
   `state_dict_saver.save_state_dict_async_finalize()` to gather and ``finish`` (``.metadata``).

``write_data`` runs the three steps at once, so the writer is also an ordinary DCP writer.
The files are DCP's: ``__<rank>_<n>.distcp``, one ``torch.save`` archive per tensor item, bytes
entries as they are. Local directories only (``use_msc``, Megatron-Core's Multi-Storage Client,
is not supported).

Example:

```python
writer = FileSystemWriterAsync(path, thread_count=2)
ret, *_ = save_state_dict_async_plan(dcp_state, writer, planner=MCoreSavePlanner(flatten_state_dict=False))
save_fn, preload_fn, save_args = writer.get_save_function_and_args()
request = AsyncRequest(save_fn, save_args, [lambda: save_state_dict_async_finalize(*ret)], preload_fn=preload_fn)
request.execute_sync()        # or AsyncCallsQueue().schedule_async_request(request)
```
"""

from __future__ import annotations

import dataclasses
import heapq
import io
import json
import os
import queue
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import IO, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union, cast

import torch
from torch.distributed.checkpoint.api import WRAPPED_EXCEPTION, _wrap_exception
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystemWriter, _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from dist_ckpt.backends.torch_dist.tensor_bytes import exact_storage
from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import ArgumentTypeError, CheckpointingException
from dist_ckpt.integrity.safe_json import loads
from dist_ckpt.storage import LocalStorageOptions, ObjectWriter, Storage, open_storage
from dist_ckpt.storage.errors import ObjectNotFoundError

__all__ = ["FileSystemWriterAsync", "WriteBucket", "WriteResultsQueue", "split_by_size_and_type", "write_bucket_files"]

#: one file's writes: its path, its name in the checkpoint, and its (bytes items, tensor items)
WriteBucket = Tuple[str, str, Tuple[List[Tuple[WriteItem, Any]], List[Tuple[WriteItem, torch.Tensor]]]]


def _result_json(result: WriteResult) -> Dict[str, Any]:
    info = result.storage_data
    index = result.index
    return {
        "fqn": index.fqn,
        "offset": None if index.offset is None else list(index.offset),
        "index": index.index,
        "size": result.size_in_bytes,
        "file": info.relative_path,
        "at": info.offset,
        "length": info.length,
    }


def _result(doc: Dict[str, Any]) -> WriteResult:
    offset = doc["offset"]
    index = MetadataIndex(doc["fqn"], None if offset is None else torch.Size(offset), doc["index"])
    return WriteResult(index, doc["size"], _StorageInfo(doc["file"], doc["at"], doc["length"]))


@dataclasses.dataclass(frozen=True)
class WriteResultsQueue:
    """Hands one rank's write results (or its failure) from the process that wrote the files to
    finalization, whichever process wrote them: a JSON file ``.write_results.<rank>.json`` in the
    checkpoint directory, read and deleted by `get_nowait()` (the role of Megatron-Core's
    multiprocessing queue, which a writer started as a fresh process could not reach).

    Attributes:
        checkpoint_dir: the checkpoint directory.
        rank: the rank whose results these are.
    """

    checkpoint_dir: str
    rank: int

    @property
    def key(self) -> str:
        return f".write_results.{self.rank}.json"

    def _storage(self) -> Storage:
        return open_storage(self.checkpoint_dir)

    def put(self, results_or_error: Union[List[WriteResult], BaseException]) -> None:
        """Record the results, or the error that stopped the write."""
        if isinstance(results_or_error, BaseException):
            doc: Dict[str, Any] = {"error": f"{type(results_or_error).__name__}: {results_or_error}"}
        else:
            doc = {"results": [_result_json(r) for r in results_or_error]}
        self._storage().write(self.key, json.dumps(doc).encode())

    def get_nowait(self) -> Union[List[WriteResult], str]:
        """The results (deleting the file), or the text of the error.

        Raises:
            queue.Empty: nothing was recorded (the write never finished).
        """
        storage = self._storage()
        try:
            raw = storage.read(self.key)
        except ObjectNotFoundError:
            raise queue.Empty from None
        storage.delete(self.key)
        doc = loads(raw, storage.url_of(self.key))
        if "error" in doc:
            return str(doc["error"])
        return [_result(r) for r in doc["results"]]


class _CountingStream(io.RawIOBase):
    """What ``torch.save`` writes, passed to an object writer, its bytes counted."""

    def __init__(self, out: ObjectWriter) -> None:
        super().__init__()
        self._out = out
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = self._out.write(data)
        self.written += n
        return n


def _write_bucket(storage: Storage, bucket: WriteBucket) -> List[WriteResult]:
    """Write one file (complete under its name, or not at all) and return its items' results."""
    _, name, (bytes_data, tensor_data) = bucket
    results: List[WriteResult] = []
    with storage.open_writer(name) as out:
        stream = _CountingStream(out)
        for item, data in bytes_data:
            start = stream.written
            stream.write(data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data))
            results.append(
                WriteResult(item.index, stream.written - start, _StorageInfo(name, start, stream.written - start))
            )
        for item, tensor in tensor_data:
            if tensor.device.type != "cpu":
                raise CheckpointingException(
                    f"{item.index.fqn!r} is on {tensor.device}: call the request's preload_fn before writing"
                )
            start = stream.written
            torch.save(tensor, cast(IO[bytes], stream))
            results.append(
                WriteResult(item.index, stream.written - start, _StorageInfo(name, start, stream.written - start))
            )
    return results


def write_bucket_files(
    checkpoint_dir: str, buckets: Sequence[WriteBucket], sync_files: bool = True
) -> List[WriteResult]:
    """Write every bucket's file, each on a thread of its own; their write results, in bucket order.

    Local (no collective). Raises the first bucket's error after every thread ended.
    """
    storage = open_storage(checkpoint_dir, LocalStorageOptions(fsync=sync_files))
    if not buckets:
        return []
    with ThreadPoolExecutor(len(buckets), thread_name_prefix="dist_ckpt-dcp-writer") as pool:
        futures = [pool.submit(_write_bucket, storage, b) for b in buckets]
    return [r for f in futures for r in f.result()]


def _item_bytes(item: WriteItem) -> int:
    assert item.tensor_data is not None
    numel = 1
    for n in item.tensor_data.chunk.sizes:
        numel *= n
    return numel * torch.empty(0, dtype=item.tensor_data.properties.dtype).element_size()


def split_by_size_and_type(bins: int, items: Sequence[WriteItem]) -> List[List[WriteItem]]:
    """``items`` in ``bins`` lists of about equal bytes: bytes entries dealt round-robin, tensor
    chunks largest first, each to the lightest list (the chunk's own size, not its tensor's)."""
    if bins <= 1:
        return [list(items)]
    out: List[List[WriteItem]] = [[] for _ in range(bins)]
    raw = [i for i in items if i.type == WriteItemType.BYTE_IO]
    for n, item in enumerate(raw):
        out[n % bins].append(item)
    loads_: List[Tuple[int, int]] = [(0, b) for b in range(bins)]
    for item in sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_bytes, reverse=True):
        total, b = heapq.heappop(loads_)
        out[b].append(item)
        heapq.heappush(loads_, (total + _item_bytes(item), b))
    return out


def _own_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over exactly its bytes (``torch.save`` and pickling write whole storages);
    a device tensor as it is (copied by the preload function)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        return tensor
    if not tensor.is_contiguous():
        return tensor.contiguous()
    return exact_storage(tensor)


class FileSystemWriterAsync(FileSystemWriter):
    """DCP's ``FileSystemWriter`` whose writing can run later, elsewhere (see the module docstring).

    Args:
        path: the checkpoint directory.
        *args: DCP's ``FileSystemWriter`` arguments.
        **kwargs: DCP's ``FileSystemWriter`` keyword arguments (``single_file_per_rank`` must stay
            True; ``thread_count`` is the number of files per rank; ``sync_files`` makes every file
            durable before the write returns).
        separation_hint: items whose key starts with this prefix are written to files of their own
            (named with the prefix first); needs ``thread_count >= 2``.
        use_msc: Megatron-Core's Multi-Storage Client (not supported: must be False).

    Raises:
        ArgumentTypeError: ``single_file_per_rank=False``, ``use_msc=True``, a separation hint with
            fewer than two threads, or DCP stream extensions (this writer serializes items itself).

    A writer serves one save: it holds that save's buckets between the steps.
    """

    def __init__(
        self,
        path: Union[str, "os.PathLike[str]"],
        *args: Any,
        separation_hint: Optional[str] = None,
        use_msc: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(path, *args, **kwargs)
        self.checkpoint_dir = path
        self.use_msc = use_msc
        problem = None
        if use_msc:
            problem = "use_msc=True (Megatron-Core's Multi-Storage Client) is not supported; write a local directory"
        elif not self.single_file_per_rank:
            problem = "single_file_per_rank=False is not supported"
        elif separation_hint is not None and self.thread_count < 2:
            problem = f"a separation_hint needs thread_count >= 2 (got {self.thread_count})"
        elif getattr(self.transforms, "extensions", None):
            problem = "DCP stream extensions are not supported (items are written as torch.save archives)"
        if problem is not None:
            raise ArgumentTypeError(f"FileSystemWriterAsync({str(path)!r}): {problem}")
        self.can_run_decentralized_global_plan: bool = True
        self.separation_hint = separation_hint
        self.write_buckets: Optional[List[WriteBucket]] = None
        self.results_queue: Optional[WriteResultsQueue] = None

    # ------------------------------------------------------------------ step 1: plan the files

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Bin this rank's items into files and resolve their data (stored in ``write_buckets``)."""
        prefix = plan.storage_data.prefix if isinstance(plan.storage_data, _StoragePrefix) else f"__{get_rank()}_"
        hint = self.separation_hint
        bins = self.thread_count // 2 if hint is not None else self.thread_count
        groups: Dict[str, List[List[WriteItem]]] = {"": split_by_size_and_type(bins, plan.items)}
        if hint is not None:
            groups = {
                "": [[i for i in b if not i.index.fqn.startswith(hint)] for b in groups[""]],
                hint: [[i for i in b if i.index.fqn.startswith(hint)] for b in groups[""]],
            }
        buckets: List[WriteBucket] = []
        for group, group_bins in groups.items():
            for items in group_bins:
                raw = [(i, planner.resolve_data(i)) for i in items if i.type == WriteItemType.BYTE_IO]
                tensors = [
                    (i, _own_bytes(cast(torch.Tensor, planner.resolve_data(i))))
                    for i in items
                    if i.type != WriteItemType.BYTE_IO
                ]
                if raw or tensors:
                    name = f"{group}{prefix}{len(buckets)}{DEFAULT_SUFFIX}"
                    buckets.append((os.path.join(str(self.checkpoint_dir), name), name, (raw, tensors)))
        self.write_buckets = buckets
        self.results_queue = WriteResultsQueue(str(self.checkpoint_dir), get_rank()) if buckets else None

    # ------------------------------------------------------------------ step 2: the write itself

    def get_save_function_and_args(
        self,
    ) -> Tuple[Optional[Callable[..., None]], Optional[Callable[[], Any]], List[Any]]:
        """``(save_fn, preload_fn, args)``, or ``(None, None, [])`` when this rank writes nothing.

        ``args`` is ``[rank, write_buckets, results_queue]``; ``preload_fn()`` returns the buckets
        with every tensor on the host, to be passed as ``args[1]``.
        """
        if not self.write_buckets:
            return None, None, []
        save_fn = partial(
            FileSystemWriterAsync.write_preloaded_data_multiproc, [], self.use_msc, sync_files=self.sync_files
        )
        preload_fn = partial(FileSystemWriterAsync.preload_tensors, self.write_buckets, True)
        return save_fn, preload_fn, [get_rank(), self.write_buckets, self.results_queue]

    @staticmethod
    def preload_tensors(write_buckets: List[WriteBucket], non_blocking: bool = True) -> List[WriteBucket]:
        """The buckets with every tensor on the host (device tensors copied, host ones as they are)."""
        out: List[WriteBucket] = []
        copied = False
        for path, name, (raw, tensors) in write_buckets:
            staged = []
            for item, t in tensors:
                if t.device.type != "cpu":
                    t, copied = t.to("cpu", non_blocking=non_blocking), True
                staged.append((item, t))
            out.append((path, name, (raw, staged)))
        if copied and non_blocking and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies must have landed before the write
        return out

    @staticmethod
    def write_preloaded_data_multiproc(
        transform_list: List[Any],
        use_msc: bool,
        rank: int,
        write_buckets: List[WriteBucket],
        global_results_queue: WriteResultsQueue,
        sync_files: bool = True,
    ) -> None:
        """Write every bucket (a thread each) and put the results, or the error, in the queue.

        Raises the error too, so that an [`AsyncCallsQueue`][dist_ckpt.asynchronous.queue.AsyncCallsQueue]
        fails the request on every rank before finalization.
        """
        if transform_list or use_msc:
            raise ArgumentTypeError(
                "FileSystemWriterAsync writes without stream transforms or the Multi-Storage Client"
            )
        checkpoint_dir = global_results_queue.checkpoint_dir
        try:
            results = write_bucket_files(checkpoint_dir, write_buckets, sync_files)
        except BaseException as e:
            global_results_queue.put(e)
            raise CheckpointingException(
                f"[rank {rank}] writing the DCP files in {checkpoint_dir!r} failed: {e}"
            ) from e
        global_results_queue.put(results)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[List[WriteResult]]":
        """DCP's synchronous write: the three steps at once, in this process."""
        self.prepare_write_data(plan, planner)
        assert self.write_buckets is not None
        results = write_bucket_files(
            str(self.checkpoint_dir), FileSystemWriterAsync.preload_tensors(self.write_buckets), self.sync_files
        )
        self.results_queue = None
        future: Future[List[WriteResult]] = Future()
        future.set_result(results)
        return future

    # ------------------------------------------------------------------ step 3: the results

    def retrieve_write_results(self) -> Union[List[WriteResult], WRAPPED_EXCEPTION]:
        """This rank's write results, or DCP's wrapped exception when its write failed or never
        finished (the form ``save_state_dict_async_finalize`` gathers)."""
        if self.write_buckets is None:
            return _wrap_exception(CheckpointingException("retrieve_write_results before prepare_write_data"))
        if self.results_queue is None:
            return []
        try:
            got = self.results_queue.get_nowait()
        except queue.Empty:
            return _wrap_exception(
                CheckpointingException(
                    f"[rank {get_rank()}] no write results in {str(self.checkpoint_dir)!r}: the write did not finish"
                )
            )
        if isinstance(got, str):
            return _wrap_exception(CheckpointingException(f"[rank {get_rank()}] the write failed: {got}"))
        return got

    # ------------------------------------------------------------------ planning without the coordinator

    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """The global plan of this rank without the others: its files prefixed ``__<rank>_`` (what
        the coordinator would assign)."""
        return dataclasses.replace(local_plan, storage_data=_StoragePrefix(f"__{get_rank()}_"))

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """Write ``.metadata`` (coordinator only), DCP's way."""
        super().finish(metadata, results)

    @property
    def checkpoint_id(self) -> Union[str, "os.PathLike[str]"]:
        """The checkpoint directory, as a string."""
        return str(self.checkpoint_dir)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, "os.PathLike[str]"]) -> bool:
        """Whether ``checkpoint_id`` is a directory this writer can write (a local path)."""
        return bool(FileSystemWriter.validate_checkpoint_id(checkpoint_id))
