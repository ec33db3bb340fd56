"""Errors of a load request that point at their cause: a mistyped key, a partial request.

A failed request is often reported by a check that only sees a consequence of it: a key
mistyped on one rank leaves a gap in the coverage of the real key, found by the sharding check
on rank 0 and reported on every rank as a gap; a process that loads only its own slice of a
tensor on purpose fails the same check; an absent key is listed without the stored key it
resembles. These functions run on the failure path only (they may read the checkpoint's
metadata) and turn such errors into ones that name the cause and the fix:

* `diagnose_integrity_error()` -- after a sharding check failed on every rank: a
  [`KeyMismatchError`][dist_ckpt.errors.KeyMismatchError] naming each rank's requested keys that the checkpoint
  lacks, with the stored keys they resemble (collective: every rank calls it); else the sharding
  error again, saying that a load of part of a tensor passes ``validate_access_integrity=False``;
* `with_key_suggestions()` -- a key mismatch with a did-you-mean for its unexpected keys.

Example:

```python
try:
    check_request()
except ShardingIntegrityError as e:          # raised on every rank
    diagnose_integrity_error(e, request, lambda: stored_keys(ckpt))
```
"""

from __future__ import annotations

import logging
from typing import Callable, NoReturn, Optional, Set

from dist_ckpt.collectives.distributed import get_rank, run_collectively
from dist_ckpt.errors import UNEXPECTED_KEYS, KeyMismatchError, ShardingIntegrityError, did_you_mean, format_keys
from dist_ckpt.model.dict_utils import nested_values
from dist_ckpt.model.sharded import ShardedBase, ShardedStateDict

__all__ = ["PARTIAL_LOAD_HINT", "diagnose_integrity_error", "with_key_suggestions"]

logger = logging.getLogger(__name__)

#: what a failed sharding check of a load request adds when no key is to blame
PARTIAL_LOAD_HINT = (
    "the check expects the ranks' requests to cover every requested tensor exactly once; to load only "
    "part of a tensor on purpose (one process reading its own shard), pass validate_access_integrity=False"
)

#: the keys a checkpoint stores (its tensors' and ShardedObjects' keys), or None if unknown
StoredKeys = Callable[[], Optional[Set[str]]]


def _requested_keys(request: ShardedStateDict) -> Set[str]:
    return {x.key for x in nested_values(request) if isinstance(x, ShardedBase)}


def diagnose_integrity_error(
    error: ShardingIntegrityError, request: ShardedStateDict, stored_keys: StoredKeys, where: str
) -> NoReturn:
    """Collective, after the sharding check of a load request raised ``error`` on every rank:
    raise a [`KeyMismatchError`][dist_ckpt.errors.KeyMismatchError] on every rank if any rank requested
    keys the checkpoint ``where`` lacks (naming that rank, its keys and the stored keys they
    resemble: the gaps follow from them), else ``error`` with `PARTIAL_LOAD_HINT`.

    ``stored_keys`` is called on every rank; when it cannot tell (None), ``error`` is raised
    with the hint.
    """
    stored = stored_keys()

    def absent_here() -> None:
        if stored is None:
            return
        absent = _requested_keys(request) - stored
        if absent:
            raise KeyMismatchError(
                f"[rank {get_rank()}] {UNEXPECTED_KEYS} (requested by load but absent from checkpoint {where}): "
                f"{format_keys(absent)}{did_you_mean(absent, stored)}; the sharding check failed because of them: "
                f"{error}",
                unexpected_keys=absent,
            )

    run_collectively("looking for mistyped keys", absent_here)
    raise ShardingIntegrityError(f"{error} ({PARTIAL_LOAD_HINT})") from error


def with_key_suggestions(error: KeyMismatchError, stored_keys: StoredKeys) -> KeyMismatchError:
    """``error`` with a did-you-mean for its unexpected keys (`did_you_mean()` over the keys
    ``stored_keys`` returns), or ``error`` itself when there is none. Not collective: every
    rank that has ``error`` (an exchanged one is the same everywhere) finds the same words."""
    if not error.unexpected_keys:
        return error
    stored = stored_keys()
    hint = did_you_mean(error.unexpected_keys, stored) if stored else ""
    if not hint or hint in error.message:
        return error
    return KeyMismatchError(error.message + hint, error.missing_keys, error.unexpected_keys)
