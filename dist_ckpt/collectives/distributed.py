"""The only module of dist_ckpt that calls ``torch.distributed``.

Everything else asks here for the rank, the world size, and for collectives that carry small
JSON documents (never pickles). With no process group initialized, the world is a single rank
and every collective is a local no-op, so single-process users need no process group.

Errors must never leave the other ranks hanging: `raise_if_any_rank_failed()` exchanges a
success flag after each step that could fail on some ranks only, and raises the same
[`CheckpointingException`][dist_ckpt.errors.CheckpointingException] on every rank, naming the rank that failed.

A rank that dies (killed, out of memory, a crashed host) cannot report anything: the transport
of the next collective fails instead (gloo: "Connection closed by peer", NCCL: a
``DistBackendError``, either: a timeout). Every collective here turns that into
[`RankFailedError`][dist_ckpt.errors.RankFailedError] on each survivor, naming the step it was in and the
ranks that did not answer a short roll call over the process group's store
(how, and the roll call, are [`peer_failures`][dist_ckpt.collectives.peer_failures]'s job); the process
group is unusable afterwards, so no further exchange is attempted.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist

from dist_ckpt import errors
from dist_ckpt.collectives.peer_failures import (
    is_transport_error,
    is_transport_failure,
    publish_identity,
    roll_call,
    transport_failure,
)
from dist_ckpt.errors import CheckpointingException, KeyMismatchError, RankFailedError, format_problems
from dist_ckpt.storage import errors as storage_errors

logger = logging.getLogger(__name__)

T = TypeVar("T")
ProcessGroup = Any  # torch.distributed.ProcessGroup, kept loose for older torch versions


# How deep the calling thread is in local_only() blocks (see there).
_local_only = threading.local()


def is_distributed() -> bool:
    """True when a torch.distributed process group is initialized (and this thread is not in a
    `local_only()` block)."""
    return dist.is_available() and dist.is_initialized() and not getattr(_local_only, "depth", 0)


@contextmanager
def local_only() -> Iterator[None]:
    """Within the block, the calling thread acts as a world of one: rank 0 of 1, every
    collective of this module a local no-op, whether or not a process group is initialized.

    For functions that one rank may call on its own (reading a checkpoint's metadata or its
    whole tensors, as Megatron-Core's do), so that nothing they call waits for other ranks
    that never come. Messages written inside say rank 0.

    Example:

    ```python
    with local_only():
        tensors = strategy.load(metadata, location)   # no collective, on any one rank
    ```
    """
    _local_only.depth = getattr(_local_only, "depth", 0) + 1
    try:
        yield
    finally:
        _local_only.depth -= 1


def get_rank(group: Optional[ProcessGroup] = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: Optional[ProcessGroup] = None) -> int:
    """Number of ranks in ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if is_distributed() else 1


def global_rank_of(group: Optional[ProcessGroup], group_rank: int) -> int:
    """Global rank of ``group_rank`` within ``group``."""
    if group is None or not is_distributed():
        return group_rank
    return int(dist.get_global_rank(group, group_rank))


def group_ranks(group: Optional[ProcessGroup] = None) -> List[int]:
    """Global ranks of the members of ``group``, in group-rank order."""
    if not is_distributed():
        return [0]
    if group is None:
        return list(range(dist.get_world_size()))
    return [int(r) for r in dist.get_process_group_ranks(group)]


def init_gloo_process_group(rank: int, world_size: int, init_method: str, timeout_s: float = 120.0) -> None:
    """Initialize a CPU (gloo) process group; for launchers, tests and the demo."""
    dist.init_process_group(
        backend="gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def destroy_process_group() -> None:
    """Tear down the default process group, if any."""
    if is_distributed():
        dist.destroy_process_group()


def group_backend(group: Optional[ProcessGroup] = None) -> str:
    """Name of ``group``'s torch.distributed backend (``"gloo"``, ``"nccl"``); ``"none"`` without
    a process group."""
    return str(dist.get_backend(group)) if is_distributed() else "none"


def new_group(ranks: Sequence[int], backend: Optional[str] = None) -> ProcessGroup:
    """Create a process group of the global ``ranks`` (collective over the default group: every
    rank must call it with the same arguments, in the same order)."""
    return dist.new_group(ranks=list(ranks), backend=backend)


def barrier(group: Optional[ProcessGroup] = None) -> None:
    """Wait for every rank of ``group``."""
    if get_world_size(group) > 1:
        _collective("a barrier", group, lambda: dist.barrier(group=group))


def time_collectively(fn: Callable[[], Any], group: Optional[ProcessGroup] = None) -> float:
    """Seconds ``fn`` takes on the slowest rank of ``group``: wall time between a barrier before
    and one after (what demos and benchmarks report for a collective save or load)."""
    barrier(group)
    start = time.perf_counter()
    fn()
    barrier(group)
    return time.perf_counter() - start


def comm_device(group: Optional[ProcessGroup] = None) -> torch.device:
    """Device for collective buffers: the current CUDA device for NCCL, else the CPU."""
    if is_distributed() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any) -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _decode(buf: torch.Tensor, length: int) -> Any:
    return json.loads(bytes(buf[:length].cpu().numpy().tobytes()).decode("utf-8"))


def _padded_payload(obj: Any, group: Optional[ProcessGroup]) -> tuple[torch.Tensor, List[int]]:
    return _padded_bytes(_encode(obj), group)


def _padded_bytes(payload: torch.Tensor, group: Optional[ProcessGroup]) -> tuple[torch.Tensor, List[int]]:
    device = comm_device(group)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(get_world_size(group))]
    _collective(
        "an all_gather of message sizes", group, lambda: dist.all_gather(sizes, size, group=group), [size, *sizes]
    )
    lengths = [int(s.item()) for s in sizes]
    padded = torch.zeros(max(max(lengths), 1), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload.to(device)
    return padded, lengths


def all_gather_json(obj: Any, group: Optional[ProcessGroup] = None) -> List[Any]:
    """Every rank's JSON-serializable ``obj``, in group-rank order, on every rank."""
    if get_world_size(group) == 1:
        return [json.loads(json.dumps(obj))]
    padded, lengths = _padded_payload(obj, group)
    out = [torch.empty_like(padded) for _ in lengths]
    _collective("an all_gather of JSON", group, lambda: dist.all_gather(out, padded, group=group), [padded, *out])
    return [_decode(buf, n) for buf, n in zip(out, lengths)]


def gather_json(obj: Any, dst: int = 0, group: Optional[ProcessGroup] = None) -> Optional[List[Any]]:
    """Every rank's ``obj`` on group rank ``dst`` (None elsewhere): O(world) memory on one rank only."""
    if get_world_size(group) == 1:
        return [json.loads(json.dumps(obj))]
    padded, lengths = _padded_payload(obj, group)
    is_dst = get_rank(group) == dst
    out = [torch.empty_like(padded) for _ in lengths] if is_dst else None
    _collective(
        "a gather of JSON",
        group,
        lambda: dist.gather(padded, out, dst=global_rank_of(group, dst), group=group),
        [padded, *(out or [])],
    )
    if out is None:
        return None
    return [_decode(buf, n) for buf, n in zip(out, lengths)]


def _as_uint8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def gather_bytes(data: bytes, dst: int = 0, group: Optional[ProcessGroup] = None) -> Optional[List[bytes]]:
    """Every rank's ``data`` on group rank ``dst`` (None elsewhere), in group-rank order.

    For compact binary metadata (see `dist_ckpt.model.columns`): two collectives, the sizes
    and the payloads padded to the largest; only rank ``dst`` holds ``world * largest`` bytes.

    Example:

    ```python
    blobs = gather_bytes(encode_table(local_table))   # list of bytes on rank 0, None elsewhere
    ```
    """
    if get_world_size(group) == 1:
        return [bytes(data)]
    padded, lengths = _padded_bytes(_as_uint8(data), group)
    is_dst = get_rank(group) == dst
    out = [torch.empty_like(padded) for _ in lengths] if is_dst else None
    _collective(
        "a gather of bytes",
        group,
        lambda: dist.gather(padded, out, dst=global_rank_of(group, dst), group=group),
        [padded, *(out or [])],
    )
    if out is None:
        return None
    return [buf[:n].cpu().numpy().tobytes() for buf, n in zip(out, lengths)]


def all_gather_bytes(data: bytes, group: Optional[ProcessGroup] = None) -> List[bytes]:
    """Every rank's ``data`` on every rank, in group-rank order (O(world) memory on every rank)."""
    if get_world_size(group) == 1:
        return [bytes(data)]
    padded, lengths = _padded_bytes(_as_uint8(data), group)
    out = [torch.empty_like(padded) for _ in lengths]
    _collective("an all_gather of bytes", group, lambda: dist.all_gather(out, padded, group=group), [padded, *out])
    return [buf[:n].cpu().numpy().tobytes() for buf, n in zip(out, lengths)]


def exchange_bytes(outgoing: Dict[int, bytes], group: Optional[ProcessGroup] = None) -> Dict[int, bytes]:
    """Collective: send ``outgoing[dst]`` to each group rank ``dst``; return what each rank sent here.

    Point to point (each payload crosses the network once, unlike `all_gather_bytes()`): one
    all-gather of the sizes, then a send and a receive per pair. For bulk data between chosen
    peers, e.g. a rank's checkpoint files to its replica ranks (`dist_ckpt.tiers`).

    Example:

    ```python
    got = exchange_bytes({(rank + 1) % world: payload})   # {(rank - 1) % world: their payload}
    ```
    """
    me = get_rank(group)
    if get_world_size(group) == 1:
        return {me: bytes(outgoing[me])} if me in outgoing else {}
    sizes = all_gather_json({str(dst): len(data) for dst, data in outgoing.items()}, group)
    received: Dict[int, bytes] = {}
    local = outgoing.get(me)
    sends = [(dst, _as_uint8(data)) for dst, data in sorted(outgoing.items()) if dst != me]
    recvs = [
        (src, torch.empty(table[str(me)], dtype=torch.uint8))
        for src, table in enumerate(sizes)
        if src != me and str(me) in table
    ]
    ops = [dist.P2POp(dist.isend, buf, global_rank_of(group, dst), group) for dst, buf in sends]
    ops += [dist.P2POp(dist.irecv, buf, global_rank_of(group, src), group) for src, buf in recvs]

    def run() -> None:
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    _collective("an exchange of bytes between peers", group, run, [buf for _, buf in sends + recvs])
    for src, buf in recvs:
        received[src] = buf.numpy().tobytes()
    if local is not None:
        received[me] = bytes(local)
    return received


def all_reduce_max(values: Sequence[int], group: Optional[ProcessGroup] = None) -> List[int]:
    """Collective: the element-wise maximum of every rank's ``values`` (int64; one all-reduce).

    Example:

    ```python
    changed_anywhere, = all_reduce_max([1 if changed else 0])
    ```
    """
    if get_world_size(group) == 1:
        return [int(v) for v in values]
    t = torch.tensor(list(values), dtype=torch.int64, device=comm_device(group))
    _collective("an all_reduce of maxima", group, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group), [t])
    return [int(v) for v in t.cpu().tolist()]


def group_identity(group: Optional[ProcessGroup] = None) -> Tuple[int, ...]:
    """Who takes part in collectives over ``group``: the global world size, then the global ranks
    of its members in group-rank order (``(1, 0)`` without a process group).

    Equal on every member, and different for groups of other members or another world size:
    a key for state kept per process group (e.g. the verdict of the last sharding check).
    """
    return (get_world_size(), *group_ranks(group))


def broadcast_json(obj: Any, src: int = 0, group: Optional[ProcessGroup] = None) -> Any:
    """Group rank ``src``'s ``obj`` on every rank."""
    if get_world_size(group) == 1:
        return obj
    device = comm_device(group)
    payload = _encode(obj) if get_rank(group) == src else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    src_global = global_rank_of(group, src)
    _collective(
        "a broadcast of a message size", group, lambda: dist.broadcast(size, src=src_global, group=group), [size]
    )
    buf = (
        payload.to(device)
        if get_rank(group) == src
        else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    _collective("a broadcast of JSON", group, lambda: dist.broadcast(buf, src=src_global, group=group), [buf])
    return _decode(buf, int(size.item()))


def broadcast_tensor(
    tensor: torch.Tensor, src: int, group: Optional[ProcessGroup] = None, what: str = "a tensor"
) -> None:
    """Broadcast ``tensor`` in place from group rank ``src`` to every rank of ``group``.

    ``tensor`` must be contiguous, live on `comm_device()` and have the same shape and dtype
    on every rank. Only call it once every rank knows the source succeeded (exchange a success
    flag first): a broadcast cannot report a failure of its source. A failure of the transport
    itself (a peer rank exited, a timeout) raises [`RankFailedError`][dist_ckpt.errors.RankFailedError] naming ``what``,
    the source and this rank; the other ranks see the same transport failure.
    """
    if get_world_size(group) == 1:
        return
    source = global_rank_of(group, src)
    _collective(
        f"a broadcast of {what} from group rank {src} (global rank {source})",
        group,
        lambda: dist.broadcast(tensor, src=source, group=group),
        [tensor],
    )


def _any_rank_true(flag: bool, group: Optional[ProcessGroup]) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=comm_device(group))
    _collective(
        "an all_reduce of success flags", group, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group), [t]
    )
    return bool(t.item())


def all_ranks_true(flag: bool, group: Optional[ProcessGroup] = None) -> bool:
    """Collective: whether ``flag`` is True on every rank of ``group`` (one small all-reduce).

    Example:

    ```python
    if all_ranks_true(my_write_finished):   # every rank agrees on the answer
        finalize()
    ```
    """
    if get_world_size(group) == 1:
        return flag
    return not _any_rank_true(not flag, group)


_SYNCED = "_dist_ckpt_synced"
_roll_calls = 0
_roll_calls_lock = threading.Lock()
_published: List[Any] = []  # a weak reference to the default group the identity was published for


def _default_store() -> Any:
    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    return None if get_store is None else get_store()


def _publish_identity() -> None:
    """Once per default process group: put this process's identity in the group's store (see
    [`peer_failures`][dist_ckpt.collectives.peer_failures]). One small store write per process."""
    default = dist.distributed_c10d._get_default_group()
    if _published and _published[0]() is default:
        return
    try:
        _published[:] = [weakref.ref(default)]
        publish_identity(_default_store(), dist.get_rank())
    except Exception as e:  # noqa: BLE001 -- only diagnostics depend on it
        logger.debug("could not publish this process's identity in the store: %s", e)


def _failed_ranks(group: Optional[ProcessGroup]) -> Optional[List[int]]:
    """After a transport failure: the ranks of ``group`` that are gone (`roll_call()` over the
    default store), or None when the store cannot be used."""
    global _roll_calls
    with _roll_calls_lock:
        call = _roll_calls
        _roll_calls += 1
    me = dist.get_rank()
    try:
        store = _default_store()
    except Exception:  # noqa: BLE001 -- the store went down with its host, rank 0
        return [0] if me != 0 else None
    return None if store is None else roll_call(store, me, [r for r in group_ranks(group) if r != me], call)


def _abort(group: Optional[ProcessGroup]) -> None:
    """Close this rank's connections of ``group`` after its transport failed: a survivor still
    blocked in the collective on this rank (waiting for a message it will never get) then fails
    at once instead of at the timeout, and joins the roll call. The group cannot be used after a
    peer's death anyway; it stays registered, so ``destroy_process_group`` still works."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    abort = getattr(pg, "abort", None)
    if abort is None:
        return
    try:
        abort()
    except Exception as e:  # noqa: BLE001 -- best effort: the roll call still names the ranks
        logger.debug("could not abort the process group after a transport failure: %s", e)


#: how long a collective waits for the process group's threads to let go of its tensors (seconds)
RELEASE_WAIT_S = 0.5


def _use_counts(tensors: Sequence[torch.Tensor]) -> List[int]:
    """The C++ use counts of CPU ``tensors`` ([] for others: NCCL's watchdog thread lets go of a
    finished collective's tensors only when it next polls, up to 100 ms or more later, too long
    to wait at every collective)."""
    count = getattr(torch.Tensor, "_use_count", None)  # private, so looked up: a torch without it skips the wait
    if count is None or any(t.device.type != "cpu" for t in tensors):
        return []
    return [int(count(t)) for t in tensors]


def wait_released(tensors: Sequence[torch.Tensor], counts: Sequence[int], timeout_s: float = RELEASE_WAIT_S) -> bool:
    """Wait until no other thread holds more references to ``tensors`` than ``counts`` (their
    C++ use counts before a collective), releasing the GIL meanwhile; give up after
    ``timeout_s``. Returns whether they were released.

    Why: a collective returns once its result is there, but the process group's worker thread
    (gloo's ``runLoop``) drops its references to the tensors a moment later, and dropping the
    last C++ reference to a tensor made in Python takes the GIL. If the interpreter is exiting by
    then (a script whose last dist_ckpt call is a load, say), that thread cannot take it, and the
    process aborts with ``terminate called without an active exception`` after its work is done
    (seen on the docs' async example about one run in twenty on the 2-core VM; torch's own bug).
    Waiting here, a few microseconds in the usual case, makes every dist_ckpt collective leave
    nothing behind for those threads.
    """
    if not counts:
        return True
    deadline = time.monotonic() + timeout_s
    while any(now > before for now, before in zip(_use_counts(tensors), counts)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0001)  # releases the GIL to the thread that drops them
    return True


def _collective(
    what: str, group: Optional[ProcessGroup], fn: Callable[[], Any], tensors: Sequence[torch.Tensor] = ()
) -> Any:
    """Run the collective ``fn`` over ``tensors``; a failure of its transport (a peer rank died or
    stopped responding: gloo and NCCL raise ``RuntimeError`` subclasses) becomes
    [`RankFailedError`][dist_ckpt.errors.RankFailedError] naming the step this thread is in and the ranks that did not
    answer the roll call. Returns once the process group's threads let go of ``tensors``
    (`wait_released()`)."""
    _publish_identity()
    counts = _use_counts(tensors)
    try:
        result = fn()
        wait_released(tensors, counts)
        return result
    except RuntimeError as e:
        if not is_transport_error(e, getattr(torch.distributed, "DistError", None)):
            raise  # a bug (a wrong tensor, a wrong group): the group still works
        step = " > ".join(active_steps()) or "no dist_ckpt step"
        _abort(group)
        raise transport_failure(get_rank(), _failed_ranks(group), step, what, e) from e


#: how many keys of each kind one rank sends with a KeyMismatchError (its message names them too)
_EXCHANGED_KEYS = 20


def _describe(error: BaseException, rank: int, step: str) -> dict[str, Any]:
    info: dict[str, Any] = {"rank": rank, "type": type(error).__name__, "message": str(error), "step": step}
    if isinstance(error, KeyMismatchError):
        info["missing_keys"] = list(error.missing_keys)[:_EXCHANGED_KEYS]
        info["unexpected_keys"] = list(error.unexpected_keys)[:_EXCHANGED_KEYS]
    return info


def _with_rank(info: dict[str, Any]) -> str:
    message: str = info["message"]
    return message if message.startswith(f"[rank {info['rank']}]") else f"[rank {info['rank']}] {message}"


def _key_mismatch(failures: List[dict[str, Any]], failed_ranks: List[int]) -> KeyMismatchError:
    """One KeyMismatchError naming the keys of every rank that had one: each rank may request
    keys of its own, and the error every rank raises must name them all. Ranks whose messages
    differ only in the rank are listed once; at most `MAX_REPORTED_PROBLEMS`
    different messages are shown. The key attributes are the union of what the ranks sent."""
    mismatches = [i for i in failures if i["type"] == KeyMismatchError.__name__]
    by_text: Dict[str, List[int]] = {}
    for info in mismatches:
        text = _with_rank(info)[len(f"[rank {info['rank']}] ") :]
        by_text.setdefault(text, []).append(info["rank"])
    parts = [
        f"[rank {ranks[0]}] {text}" if len(ranks) == 1 else f"[ranks {', '.join(map(str, ranks))}] {text}"
        for text, ranks in by_text.items()
    ]
    message = format_problems(parts)
    others = [r for r in failed_ranks if r not in {i["rank"] for i in mismatches}]
    if others:
        message += f" (ranks {others} failed too)"
    missing = {k for i in mismatches for k in i.get("missing_keys", ())}
    unexpected = {k for i in mismatches for k in i.get("unexpected_keys", ())}
    return KeyMismatchError(message, missing, unexpected)


def _rebuild(
    info: dict[str, Any], failed_ranks: List[int], failures: Sequence[dict[str, Any]] = ()
) -> CheckpointingException:
    """The error every rank raises: that of the lowest failing rank ``info``, with its type
    (a key mismatch names every rank's keys, from ``failures``)."""
    rank = info["rank"]
    if info["type"] == KeyMismatchError.__name__:
        return _key_mismatch(list(failures) or [info], failed_ranks)
    message = _with_rank(info)
    others = [r for r in failed_ranks if r != rank]
    if others:
        message += f" (ranks {others} failed too)"
    # the family lives in errors.py, and the storage layer's members in storage/errors.py
    cls = getattr(errors, info["type"], None) or getattr(storage_errors, info["type"], None)
    if isinstance(cls, type) and issubclass(cls, CheckpointingException):
        try:
            return cls(message)
        except TypeError:  # a subclass with a different constructor
            pass
    return RankFailedError(f"{message} [{info['type']} while {info['step']}]")


def raise_if_any_rank_failed(error: Optional[BaseException], step: str, group: Optional[ProcessGroup] = None) -> None:
    """Collective: if ``error`` is set on any rank, raise one equal error on every rank.

    Every rank of ``group`` must call this with its own outcome of ``step`` (None for success).
    Errors of the CheckpointingException family keep their type; others become
    [`RankFailedError`][dist_ckpt.errors.RankFailedError]. The error of the lowest failing rank is reported. Without a
    process group the local error is re-raised unchanged.

    Steps nest (a strategy's steps run inside ``save``'s). Every exchange has the same message
    pattern, so a rank failing in an outer step pairs with ranks inside an inner step; an error
    that has been exchanged is marked with the ranks it reached and is not exchanged again over
    the same group on its way out. An enclosing step over a larger group exchanges it again, so
    the ranks outside the inner group learn about it too.
    """
    members = frozenset(group_ranks(group))
    if error is not None and (getattr(error, _SYNCED, None) == members or is_transport_failure(error)):
        raise error  # already exchanged, or the process group is broken: no exchange is possible
    if get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    if not _any_rank_true(error is not None, group):
        return
    rank = get_rank(group)
    infos = all_gather_json(None if error is None else _describe(error, global_rank_of(group, rank), step), group)
    failures = [i for i in infos if i is not None]
    failed_ranks = [i["rank"] for i in failures]
    exc = _rebuild(failures[0], failed_ranks, failures)
    setattr(exc, _SYNCED, members)
    if error is not None:
        raise exc from error
    raise exc


# The steps each thread is in, outermost first, for diagnostics only: the watchdog
# (dist_ckpt.engine.watchdog), running on its own thread, reads them to say where a stuck rank is.
_active_steps: Dict[int, List[str]] = {}
_active_steps_lock = threading.Lock()


def active_steps(thread_id: Optional[int] = None) -> Tuple[str, ...]:
    """The `run_collectively()` steps that thread ``thread_id`` (default: the calling thread)
    is in right now, outermost first.

    Example:

    ```python
    active_steps()   # ('saving sharded tensors', 'writing safetensors files') inside a save
    ```
    """
    with _active_steps_lock:
        return tuple(_active_steps.get(threading.get_ident() if thread_id is None else thread_id, ()))


def _enter_step(step: str) -> None:
    with _active_steps_lock:
        _active_steps.setdefault(threading.get_ident(), []).append(step)


def _leave_step() -> None:
    thread = threading.get_ident()
    with _active_steps_lock:
        steps = _active_steps.get(thread)
        if steps:
            steps.pop()
        if not steps:
            _active_steps.pop(thread, None)


def run_collectively(
    step: str, fn: Callable[[], T], group: Optional[ProcessGroup] = None, *, exchanges_own_errors: bool = False
) -> T:
    """Run ``fn`` on every rank; if it raises on any rank, raise on every rank.

    While it runs, ``step`` is listed by `active_steps()` (for the watchdog's messages).

    Args:
        step: the step's name, for errors and the watchdog.
        fn: the step.
        group: the ranks that run it.
        exchanges_own_errors: ``fn`` raises only errors it raised on every rank of ``group``
            (exchanged by `raise_if_any_rank_failed()` or a nested `run_collectively()`), so
            nothing is exchanged after it succeeds: no collective is added. Only for a ``fn``
            whose every failure on one rank reaches an exchange that every rank makes.

    Example:

    ```python
    run_collectively("writing common.pt", lambda: strategy.save_common(common, ckpt_dir))
    ```
    """
    _enter_step(step)
    try:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 -- every failure must reach the other ranks
            raise_if_any_rank_failed(e, step, group)  # an error exchanged already is re-raised as it is
            raise  # unreachable: the call above always raises when given an error
        if not exchanges_own_errors:
            raise_if_any_rank_failed(None, step, group)
        return result
    finally:
        _leave_step()
