"""The dist_ckpt exception family.

Every error raised on purpose by dist_ckpt is a [`CheckpointingException`][dist_ckpt.errors.CheckpointingException].
Subclasses exist where a caller needs to tell cases apart, and each also inherits the matching builtin so that
``except KeyError`` / ``except FileNotFoundError`` style handlers keep working.

Messages name the key, the rank, the checkpoint path and what was expected vs found, and say how
to fix the problem when there is an obvious fix.
"""

from __future__ import annotations

import difflib
from typing import Iterable, Optional, Sequence, Tuple


class CheckpointingException(Exception):
    """Base class of every checkpointing error raised by dist_ckpt."""


class ShardingIntegrityError(CheckpointingException, ValueError):
    """The shards of a tensor or object do not form a valid sharding.

    Raised for overlapping main replicas, gaps in coverage, and metadata (global shape, dtype,
    local shape) that disagrees between ranks.
    """


class InvalidShardedTensorError(CheckpointingException, ValueError):
    """A ``ShardedTensor`` / ``ShardedObject`` was built from inconsistent arguments."""


class StateDictStructureError(CheckpointingException, ValueError):
    """Two nested state dicts that must have the same structure do not."""


class KeyMismatchError(CheckpointingException, KeyError):
    """Keys requested by ``load`` and keys stored in the checkpoint do not match.

    The message always contains Megatron-Core's words, which callers match on: ``Unexpected
    keys`` followed by the unexpected keys and ``Missing keys`` followed by the missing ones
    (each only when there are such keys). A message that does not already say them gets them
    appended.

    Attributes:
        missing_keys: keys stored in the checkpoint but requested by no rank (Megatron-Core's
            "missing" keys).
        unexpected_keys: keys requested by ``load`` but absent from the checkpoint (Megatron-Core's
            "unexpected" keys).
    """

    def __init__(self, message: str, missing_keys: Iterable[str] = (), unexpected_keys: Iterable[str] = ()) -> None:
        self.missing_keys = sorted(missing_keys)
        self.unexpected_keys = sorted(unexpected_keys)
        tail = [
            f"{words}: {format_keys(keys)}"
            for words, keys in ((UNEXPECTED_KEYS, self.unexpected_keys), (MISSING_KEYS, self.missing_keys))
            if keys and words not in message
        ]
        self.message = message + (f" ({'; '.join(tail)})" if tail else "")
        super().__init__(self.message)

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return self.message


class LoadMismatchError(CheckpointingException, ValueError):
    """A stored tensor does not match what ``load`` asked for (dtype or global shape)."""


class ShardedObjectLayoutError(LoadMismatchError):
    """``load`` asked for a shard of a ``ShardedObject`` in a grid other than the one it was saved
    in (e.g. an RNG state saved per tensor-parallel rank, loaded at another TP size).

    The checkpoint is not corrupt: ShardedObjects are opaque and never resharded, so only the
    saved layout can load them. The message lists the stored shards and says what to do: drop the
    key from the load, or key the object by its layout so that a new layout asks for new keys.
    """


class NotACheckpointError(CheckpointingException, FileNotFoundError):
    """The directory is missing or holds no committed checkpoint (no valid ``metadata.json``)."""


class CheckpointExistsError(CheckpointingException, FileExistsError):
    """``save`` was pointed at a directory that already holds a committed checkpoint."""


class SaveConflictError(CheckpointExistsError):
    """``save`` cannot own its target: another save is writing there (two saves never share a
    location), or the target holds entries this save would write that no record shows dist_ckpt
    wrote (they are left alone). Raised on every rank of the refused save, which writes and
    deletes nothing."""


class CorruptCheckpointError(CheckpointingException, ValueError):
    """A committed checkpoint has missing, truncated or unreadable files."""


class UnsafeLinkError(CorruptCheckpointError):
    """A file of a checkpoint is reached through a symbolic link that leads outside the
    checkpoint directory; it is not read. Links that stay inside the checkpoint, and a
    checkpoint directory that is itself a link, are fine."""


class ChecksumMismatchError(CorruptCheckpointError):
    """Stored bytes do not match the crc32c recorded for them at save time (bit rot, a torn or
    overwritten file). The message names the file, the byte range, the key and both checksums."""


class AsyncSaveError(CheckpointingException):
    """The background part of an asynchronous save failed (the writer raised, or its process
    died); raised on every rank when the save is finalized, naming the rank and the cause."""


class CheckpointManagementError(CheckpointingException, ValueError):
    """A request to [`dist_ckpt.training.checkpoints`][dist_ckpt.training.checkpoints] cannot be carried out as asked.

    For example a checkpoint name that carries no step, ``max_checkpoints < 1``, metrics that
    are not finite numbers, or symlinks asked for a checkpoint that has no HuggingFace weights.
    """


class SymlinkConflictError(CheckpointingException, FileExistsError):
    """A symlink would replace a regular file (or a directory) that is not ours to replace."""


class ArgumentTypeError(CheckpointingException, TypeError):
    """An argument of a public function has the wrong type, e.g. the state dict and the
    directory passed in the other order; the message names the argument, what it takes and what
    it got."""


class UnknownStrategyError(CheckpointingException, ValueError):
    """No strategy is registered for the requested (action, backend, version)."""


class StrategyRegistrationError(CheckpointingException, ValueError):
    """A strategy registration is malformed or would silently replace another one."""


class IncompatibleStrategyError(CheckpointingException, ValueError):
    """A strategy cannot handle the backend or format version recorded in a checkpoint."""


class MissingDependencyError(CheckpointingException, ImportError):
    """A backend was chosen whose optional dependency is not installed."""


class UnsafeObjectError(CheckpointingException):
    """Loading an object would need full (code-executing) pickle, which is off by default."""


class InvalidKeyError(CheckpointingException, ValueError):
    """A key cannot be stored safely (for example it would escape the checkpoint directory)."""


class ProcessGroupMismatchError(CheckpointingException, ValueError):
    """Ranks passed process groups that do not agree (e.g. rank 0 says its data-parallel group
    is ``[0, 1]`` but rank 1 says ``[1]``)."""


class RankFailedError(CheckpointingException):
    """Raised on every rank when another rank failed a collective step in a non-library way.

    Errors of the [`CheckpointingException`][dist_ckpt.errors.CheckpointingException] family are re-raised with their
    own type on every rank; anything else (an ``OSError``, a bug) arrives as this type, with the failing
    rank, the original type and its message. A rank that died (or stopped responding) during a
    collective arrives as this type too, on every survivor.

    Attributes:
        failed_ranks: the ranks found dead or unresponsive when the transport of a collective
            failed (empty when not known, or when the failure was reported by the rank itself).
        step: the step the survivors were in when the transport failed ("" otherwise).
    """

    failed_ranks: Tuple[int, ...] = ()
    step: str = ""


#: Megatron-Core's words for keys requested by ``load`` but absent from the checkpoint
UNEXPECTED_KEYS = "Unexpected keys"
#: Megatron-Core's words for keys stored in the checkpoint but requested by no rank
MISSING_KEYS = "Missing keys"

#: how many problems an error message lists before "... and N more"
MAX_REPORTED_PROBLEMS = 10


def format_problems(problems: Sequence[str], separator: str = "; ") -> str:
    """The first `MAX_REPORTED_PROBLEMS` of ``problems`` joined, and how many more there are."""
    shown = separator.join(problems[:MAX_REPORTED_PROBLEMS])
    if len(problems) > MAX_REPORTED_PROBLEMS:
        shown += f"{separator}... and {len(problems) - MAX_REPORTED_PROBLEMS} more"
    return shown


def format_keys(keys: Iterable[str], limit: int = 20) -> str:
    """Return a short, sorted, human-readable list of keys for error messages."""
    ordered: Sequence[str] = sorted(keys)
    shown = ", ".join(repr(k) for k in ordered[:limit])
    if len(ordered) > limit:
        shown += f", ... ({len(ordered) - limit} more)"
    return "[" + shown + "]"


#: how many keys `did_you_mean()` looks for a close match for
_MAX_GUESSED = 50


def did_you_mean(keys: Iterable[str], candidates: Iterable[str], limit: int = MAX_REPORTED_PROBLEMS) -> str:
    """For keys that were asked for and not found, the closest of ``candidates`` (``difflib``):
    ``" (did you mean: 'decoder.weigth' -> 'decoder.weight')"``, or "" when none is close. The
    one did-you-mean of dist_ckpt's key errors: a typo then points at its fix, not at a
    consequence of it.

    Example:

    ```python
    did_you_mean(["decoder.weigth"], ["decoder.weight", "decoder.bias"])
    # " (did you mean: 'decoder.weigth' -> 'decoder.weight')"
    ```
    """
    pool = sorted(set(candidates))
    guesses = []
    for key in sorted(set(keys))[:_MAX_GUESSED]:  # an error path, but a whole other model is no typo
        close = difflib.get_close_matches(key, pool, n=1, cutoff=0.75)
        if close and close[0] != key:
            guesses.append(f"{key!r} -> {close[0]!r}")
        if len(guesses) == limit:
            break
    return f" (did you mean: {', '.join(guesses)})" if guesses else ""


def with_rank(message: str, rank: Optional[int]) -> str:
    """Prefix ``message`` with the rank it comes from, when known."""
    return message if rank is None else f"[rank {rank}] {message}"


def counted(count: int, noun: str, plural: str = "") -> str:
    """``count`` and ``noun``, in the singular for exactly one: the one way dist_ckpt's messages,
    reports and commands count things ("1 file", "2 files", never "1 files").

    Example:

    ```python
    counted(1, "rank")                     # "1 rank"
    counted(3, "entry", "entries")         # "3 entries"
    counted(1_000_000, "byte")             # "1,000,000 bytes"
    ```
    """
    return f"{count:,} {noun if count == 1 else plural or noun + 's'}"


def with_article(word: str) -> str:
    """``word`` after "a", or "an" before a vowel: for names of types in messages ("an AdamW",
    "a dict"), which dist_ckpt cannot know in advance.

    Example:

    ```python
    with_article(type(value).__name__)   # "an AdamW"
    ```
    """
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"
