"""Telling a dead peer from a working one, after a collective's transport failed.

A rank that dies (killed, out of memory, a crashed host) cannot report anything: the transport
of the next collective fails instead (gloo: "Connection closed by peer", NCCL: a
``DistBackendError``, either: a timeout). [`distributed`][dist_ckpt.collectives.distributed] runs every
collective through one guard that, on such a failure, asks this module:

* whether the error is a transport failure at all (`is_transport_error()`), as opposed to a
  misuse that leaves the group working;
* which ranks are gone (`roll_call()`): a rank on this machine is checked directly, from the
  identity it published in the process group's store (`publish_identity()`); the others answer
  a roll call in the store or are reported;
* the error every survivor raises (`transport_failure()`): a
  [`RankFailedError`][dist_ckpt.errors.RankFailedError] naming the step and the ranks, marked so that
  no further exchange is attempted over the broken group (`is_transport_failure()`).

Nothing here calls ``torch.distributed``: the store and the ranks are handed in.
"""

from __future__ import annotations

import json
import time
from typing import Any, List, Optional, Sequence

from dist_ckpt.collectives.process_identity import ProcessIdentity
from dist_ckpt.errors import RankFailedError

__all__ = [
    "ROLL_CALL_S",
    "is_transport_error",
    "is_transport_failure",
    "publish_identity",
    "roll_call",
    "transport_failure",
]

#: how long each survivor of a transport failure waits for ranks on other machines to answer
#: the roll call (ranks on its own machine are checked directly)
ROLL_CALL_S = 5.0
_IDENTITY_PREFIX = "dist_ckpt/process/"
#: set on a RankFailedError raised for a failed transport: the process group is unusable
_TRANSPORT_FAILED = "_dist_ckpt_transport_failed"

#: words of the messages of gloo, NCCL and the c10d store when a peer is gone or silent
_TRANSPORT_HINTS = (
    "connection",
    "closed by peer",
    "reset by peer",
    "read error",
    "write error",
    "broken pipe",
    "timed out",
    "timeout",
    "socket",
    "remote worker",
    "nccl error",
    "aborted",
)


def publish_identity(store: Any, rank: int) -> None:
    """Put this process's identity in ``store`` under ``rank``, so that after a transport failure
    the survivors on its machine can tell whether it still runs (one small store write)."""
    store.set(f"{_IDENTITY_PREFIX}{rank}", ProcessIdentity.current().to_bytes())


def _identity_of(store: Any, rank: int) -> Optional[ProcessIdentity]:
    key = f"{_IDENTITY_PREFIX}{rank}"
    if not store.check([key]):
        return None
    try:
        return ProcessIdentity.from_json(json.loads(store.get(key)))
    except ValueError:
        return None


def roll_call(store: Any, me: int, others: Sequence[int], call: int) -> Optional[List[int]]:
    """The ranks of ``others`` that are gone, after the ``call``-th transport failure of this process.

    A rank on this machine (same kernel boot and PID namespace, from the identity it published)
    is checked directly: its process exists or not. The others get a roll call: each survivor
    sets ``dist_ckpt/alive/<call>/<rank>`` in the store (every survivor hits the failure, so each
    calls this for the same ``call``) and waits up to `ROLL_CALL_S` for theirs; a rank that never
    answers is reported (dead, or blocked in a collective). The store lives on rank 0
    (TCPStore): when it is unreachable, rank 0 is reported (None on rank 0 itself).
    """
    prefix = f"dist_ckpt/alive/{call}/"
    try:
        store.set(f"{prefix}{me}", "1")

        def silent(ranks: Sequence[int]) -> List[int]:
            return [r for r in ranks if not store.check([f"{prefix}{r}"])]

        running = {
            r: (i.running() if i is not None else None) for r in silent(others) for i in [_identity_of(store, r)]
        }
        dead = [r for r, up in running.items() if up is False]  # (a survivor may answer, then exit)
        remote = [r for r, up in running.items() if up is None]
        deadline = time.monotonic() + ROLL_CALL_S
        while remote:
            remote = silent(remote)
            if not remote or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return sorted(silent(dead) + remote)
    except Exception:  # noqa: BLE001 -- the store went down with its host, rank 0
        return [0] if me != 0 else None


def is_transport_error(error: RuntimeError, dist_error: Optional[type] = None) -> bool:
    """Whether a collective's ``RuntimeError`` means its transport failed (a peer died or stopped
    responding), as opposed to a misuse that leaves the group working. ``dist_error``:
    ``torch.distributed.DistError`` where torch has it (always a transport failure)."""
    if dist_error is not None and isinstance(error, dist_error):
        return True
    text = str(error).lower()
    return any(hint in text for hint in _TRANSPORT_HINTS)


def transport_failure(
    me: int, failed: Optional[Sequence[int]], step: str, what: str, error: BaseException
) -> RankFailedError:
    """The [`RankFailedError`][dist_ckpt.errors.RankFailedError] rank ``me`` raises when ``what`` could
    not complete during ``step`` because ranks ``failed`` (None or empty: unknown) are gone."""
    who = "a peer rank" if not failed else f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}"
    exc = RankFailedError(
        f"[rank {me}] {who} failed (exited, was killed, or stopped responding) during step {step!r}: "
        f"{what} could not complete ({type(error).__name__}: {error}); the process group is unusable, restart the job "
        "(no checkpoint was committed by this step)"
    )
    exc.failed_ranks = tuple(failed or ())
    exc.step = step
    setattr(exc, _TRANSPORT_FAILED, True)
    return exc


def is_transport_failure(error: BaseException) -> bool:
    """Whether ``error`` is the [`RankFailedError`][dist_ckpt.errors.RankFailedError] of a failed collective transport
    (a peer rank died or stopped responding): the process group cannot be used any more.

    Example:

    ```text
    except RankFailedError as e:
        if is_transport_failure(e): print("ranks", e.failed_ranks, "died during", e.step)
    ```
    """
    return bool(getattr(error, _TRANSPORT_FAILED, False))
