"""Unit tests of dist_ckpt.collectives.distributed without a process group (a world of one rank)."""

from __future__ import annotations

import threading
import time
from typing import List

import pytest
import torch
import torch.distributed as dist

from dist_ckpt.collectives import distributed
from dist_ckpt.collectives.distributed import (
    all_gather_json,
    barrier,
    broadcast_json,
    broadcast_tensor,
    gather_json,
    get_rank,
    get_world_size,
    group_backend,
    group_ranks,
    is_distributed,
    raise_if_any_rank_failed,
    run_collectively,
)
from dist_ckpt.errors import LoadMismatchError


@pytest.fixture(autouse=True)
def no_process_group():
    assert not (dist.is_available() and dist.is_initialized())


def test_world_of_one():
    assert is_distributed() is False
    assert get_rank() == 0 and get_world_size() == 1
    assert group_ranks() == [0]
    barrier()


def test_json_collectives():
    obj = {"a": [1, 2.5, None, "x"], "b": {"c": True}}
    assert all_gather_json(obj) == [obj]
    assert gather_json(obj) == [obj]
    assert broadcast_json(obj) == obj
    gathered = all_gather_json(obj)[0]
    gathered["a"].append(3)
    assert obj["a"] == [1, 2.5, None, "x"]  # a copy, as if it came over the wire
    with pytest.raises(TypeError):
        all_gather_json({"not json": object()})


def test_run_collectively():
    assert run_collectively("step", lambda: 42) == 42
    original = LoadMismatchError("'k' differs")
    with pytest.raises(LoadMismatchError) as info:
        run_collectively("step", lambda: (_ for _ in ()).throw(original))
    assert info.value is original  # re-raised unchanged without a process group
    with pytest.raises(OSError, match="disk"):
        run_collectively("step", lambda: (_ for _ in ()).throw(OSError("disk")))


def test_raise_if_any_rank_failed():
    raise_if_any_rank_failed(None, "step")
    with pytest.raises(KeyError):
        raise_if_any_rank_failed(KeyError("x"), "step")


def test_tensor_broadcast_and_backend_without_process_group():
    t = torch.arange(4)
    broadcast_tensor(t, 0, what="'w'")  # a world of one: nothing to send, tensor unchanged
    assert torch.equal(t, torch.arange(4))
    assert group_backend() == "none"


def test_storage_errors_keep_their_type_on_every_rank() -> None:
    """What another rank receives: the storage layer's errors are rebuilt with their own type
    (callers catch BucketNotFoundError or StorageAuthError, not a generic RankFailedError)."""
    from dist_ckpt.collectives.distributed import _describe, _rebuild
    from dist_ckpt.errors import RankFailedError
    from dist_ckpt.storage import BucketNotFoundError, RetriesExhaustedError, StorageAuthError

    for error in (
        BucketNotFoundError("bucket 'b' does not exist"),
        StorageAuthError("refused"),
        RetriesExhaustedError("gave up", attempts=3),
    ):
        rebuilt = _rebuild(_describe(error, 1, "saving"), [1, 0])
        assert type(rebuilt) is type(error) and "[rank 1]" in str(rebuilt) and "ranks [0] failed too" in str(rebuilt)
    assert type(_rebuild(_describe(OSError("disk"), 0, "saving"), [0])) is RankFailedError


def test_key_mismatches_of_several_ranks_are_named_together() -> None:
    """What every rank raises when several ranks lack keys: each rank's keys (ranks with the same
    message listed once), the union as attributes, and the ranks that failed otherwise."""
    from dist_ckpt.collectives.distributed import _describe, _rebuild
    from dist_ckpt.errors import KeyMismatchError

    def mismatch(rank: int, keys: list) -> dict:
        error = KeyMismatchError(f"[rank {rank}] Unexpected keys (absent): {keys}", unexpected_keys=keys)
        return _describe(error, rank, "loading")

    failures = [mismatch(0, ["a"]), mismatch(1, ["a", "b"]), mismatch(2, ["a"]), _describe(OSError("disk"), 3, "x")]
    rebuilt = _rebuild(failures[0], [0, 1, 2, 3], failures)
    assert type(rebuilt) is KeyMismatchError
    assert str(rebuilt) == (
        "[ranks 0, 2] Unexpected keys (absent): ['a']; [rank 1] Unexpected keys (absent): ['a', 'b'] "
        "(ranks [3] failed too)"
    )
    assert rebuilt.unexpected_keys == ["a", "b"] and rebuilt.missing_keys == []
    # one rank alone: its own message, as before
    assert str(_rebuild(failures[1], [1], [failures[1]])) == "[rank 1] Unexpected keys (absent): ['a', 'b']"


def test_exchanged_key_lists_are_bounded() -> None:
    from dist_ckpt.collectives.distributed import _describe
    from dist_ckpt.errors import KeyMismatchError

    info = _describe(KeyMismatchError("m", unexpected_keys=[f"k{i:04d}" for i in range(5000)]), 0, "loading")
    assert len(info["unexpected_keys"]) == 20 and len(info["message"]) < 400


# -- collectives leave nothing for the process group's threads to release at exit --------------


def _held_by_another_thread(tensor: torch.Tensor, for_s: float) -> threading.Thread:
    """A thread that holds a C++ reference to ``tensor`` (a view of it) for ``for_s`` seconds,
    as gloo's worker thread holds a finished collective's tensors for a moment."""
    views = [tensor.view(-1)]

    def hold() -> None:
        time.sleep(for_s)
        views.clear()

    thread = threading.Thread(target=hold)
    thread.start()
    return thread


def test_wait_released_returns_once_the_other_references_are_gone():
    t = torch.zeros(4)
    before = [t._use_count()]
    thread = _held_by_another_thread(t, 0.05)
    start = time.monotonic()
    assert distributed.wait_released([t], before)
    assert time.monotonic() - start >= 0.04
    assert t._use_count() == before[0]
    thread.join()


def test_wait_released_gives_up_after_its_timeout():
    t = torch.zeros(4)
    before = [t._use_count()]
    thread = _held_by_another_thread(t, 0.5)
    assert not distributed.wait_released([t], before, timeout_s=0.02)  # bounded: never hangs a collective
    thread.join()
    assert distributed.wait_released([t], before, timeout_s=0.02)


def test_a_collective_returns_after_its_tensors_are_released(monkeypatch):
    monkeypatch.setattr(distributed, "_publish_identity", lambda: None)  # needs a process group
    t = torch.zeros(4)
    threads: List[threading.Thread] = []
    distributed._collective("a test collective", None, lambda: threads.append(_held_by_another_thread(t, 0.05)), [t])
    assert t._use_count() == 1  # the "worker thread" let go before the collective returned
    threads[0].join()


def test_only_cpu_tensors_are_waited_for():
    """NCCL's watchdog lets go of a collective's tensors only at its next poll (100 ms or more):
    collectives on other devices than the CPU do not wait (a meta tensor stands in for CUDA)."""
    assert distributed._use_counts([torch.zeros(2), torch.empty(2, device="meta")]) == []
    assert distributed._use_counts([torch.zeros(2)]) == [1]
