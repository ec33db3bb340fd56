"""Choosing the tier to restore from: the newest step whose every file survives somewhere.

A local checkpoint's files are spread over the nodes' directories, each rank's files also held by
its replica ranks. After a failure some directories are gone.
[`plan_local_restore()`][dist_ckpt.tiers.restore_plan.plan_local_restore] takes what each
surviving node reports it holds (file name -> size and crc32c, as recorded at save time) and
picks, for each file, a node holding an intact copy -- its own first -- or says why the step
cannot be restored from the local tier, so that the caller falls back to the durable tier and
logs the reason. Pure: no I/O, no communication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

__all__ = ["FileRecord", "LocalRestorePlan", "Unrestorable", "plan_local_restore", "newest_restorable"]


@dataclass(frozen=True)
class FileRecord:
    """A stored file as the commit recorded it: its size and crc32c."""

    size: int
    crc32c: int


@dataclass(frozen=True)
class LocalRestorePlan:
    """For each file of the step, the node to read it from (``fetch``: those not on the reader's node)."""

    step: int
    source: Mapping[str, str]


@dataclass(frozen=True)
class Unrestorable:
    """Why a step cannot be restored from the local tier (logged when falling back)."""

    step: int
    reason: str


def plan_local_restore(
    step: int,
    expected: Mapping[str, FileRecord],
    holdings: Mapping[str, Mapping[str, FileRecord]],
    preferred: Sequence[str] = (),
) -> Union[LocalRestorePlan, Unrestorable]:
    """Pick a surviving intact copy of every expected file of ``step``.

    Args:
        step: the step (for messages).
        expected: the committed record of the step: every file name and its size and crc32c.
        holdings: per surviving node, the files it holds for the step with what it measured.
        preferred: nodes to read from first (the reader's own), in order.

    Returns:
        A plan naming a node per file, or why not: which files have no intact copy and on which
        nodes a copy was found damaged.
    """
    order = list(dict.fromkeys([*preferred, *sorted(holdings)]))
    source: Dict[str, str] = {}
    missing: List[str] = []
    damaged: Dict[str, List[str]] = {}
    for name, record in sorted(expected.items()):
        chosen: Optional[str] = None
        for node in order:
            held = holdings.get(node, {}).get(name)
            if held is None:
                continue
            if held == record:
                chosen = node
                break
            damaged.setdefault(name, []).append(node)
        if chosen is None:
            missing.append(name)
        else:
            source[name] = chosen
    if missing:
        parts = []
        for name in missing:
            bad = damaged.get(name)
            parts.append(f"{name} (damaged on {', '.join(bad)})" if bad else f"{name} (no copy)")
        return Unrestorable(
            step, f"step {step}: no intact copy of {len(missing)} file(s) on the surviving nodes: {'; '.join(parts)}"
        )
    return LocalRestorePlan(step, source)


def newest_restorable(
    candidates: Sequence[Tuple[int, Union[LocalRestorePlan, Unrestorable]]],
) -> Tuple[Optional[LocalRestorePlan], List[Unrestorable]]:
    """The newest step with a plan, and the reasons of every newer step skipped (newest first)."""
    skipped: List[Unrestorable] = []
    for _, outcome in sorted(candidates, key=lambda c: c[0], reverse=True):
        if isinstance(outcome, LocalRestorePlan):
            return outcome, skipped
        skipped.append(outcome)
    return None, skipped
