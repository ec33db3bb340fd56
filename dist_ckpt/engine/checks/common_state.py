"""Whether the common (non-sharded) state agrees across ranks: rank 0 saves it for everyone.

Each rank fingerprints its common state (`fingerprint_common_state()`: local); the ranks compare
a digest of the fingerprints in one all-reduce, and only when the digests differ gather the
fingerprints to rank 0, which warns how they differ (`report_common_state_differences()`).
`validate_common_state_dict()` does all three; a save folds the all-reduce into the one of its
validation step (`dist_ckpt.engine.checks.save_checks`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch

from dist_ckpt.collectives.distributed import all_reduce_max, gather_json, get_world_size
from dist_ckpt.errors import MAX_REPORTED_PROBLEMS

logger = logging.getLogger(__name__)


def _fingerprint(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h = hashlib.sha1(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
        return "tensor:" + h.hexdigest()
    if isinstance(value, np.ndarray):
        h = hashlib.sha1(f"{value.dtype}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).data)
        return "ndarray:" + h.hexdigest()
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, (set, frozenset)):
        return "set:" + repr(sorted(_fingerprint(v) for v in value))
    if isinstance(value, tuple):
        return "tuple:" + repr([_fingerprint(v) for v in value])
    try:
        return f"{type(value).__qualname__}:" + hashlib.sha1(pickle.dumps(value)).hexdigest()
    except Exception:  # noqa: BLE001 -- unpicklable values are compared by type only
        return f"{type(value).__qualname__}:<unhashable>"


#: where a value sits in the common state: its dict keys and list indices from the root, as
#: Megatron-Core's ``dict_utils.diff`` names it (``("optimizer", "param_groups", 1, "step")``)
Path = Tuple[Any, ...]

#: ``{path: (type, fingerprint)}`` of every dict, list and leaf of one rank's common state;
#: containers' fingerprints are their kind only, so a changed leaf is reported once, at the leaf
Fingerprints = Dict[Path, Tuple[str, str]]

#: how many keys of each kind, per rank, the common-state warning lists
_KEYS_PER_RANK = 20


class _Shown:
    """Prints as the given text, unquoted (a type as ``<class 'int'>``, as Megatron-Core prints it)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Shown) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


def common_state_fingerprints(common_state_dict: Any) -> Fingerprints:
    """``{path: (type, fingerprint)}`` for every node of the common state (compact, comparable).

    Example:

    ```python
    common_state_fingerprints({"a": [1]})
    # {("a",): ("<class 'list'>", "list"), ("a", 0): ("<class 'int'>", "1")}
    ```
    """
    out: Fingerprints = {}

    def visit(path: Path, value: Any) -> None:
        if isinstance(value, dict):
            out[path] = (repr(dict), "dict")
            for k, v in value.items():
                visit(path + (k if isinstance(k, (str, int)) and not isinstance(k, bool) else _Shown(repr(k)),), v)
        elif isinstance(value, list):
            out[path] = (repr(list), "list")
            for i, v in enumerate(value):
                visit(path + (i,), v)
        else:
            out[path] = (repr(type(value)), _fingerprint(value))

    visit((), common_state_dict)
    return out


def _encode_key(key: Any) -> Any:
    return {"repr": key.text} if isinstance(key, _Shown) else key


def _decode_key(key: Any) -> Any:
    return _Shown(key["repr"]) if isinstance(key, dict) else key


def _to_json(fingerprints: Fingerprints) -> List[Any]:
    return [[[_encode_key(k) for k in path], kind, fp] for path, (kind, fp) in fingerprints.items()]


def _from_json(doc: List[Any]) -> Fingerprints:
    return {tuple(_decode_key(k) for k in path): (kind, fp) for path, kind, fp in doc}


def _only_in(a: Fingerprints, b: Fingerprints) -> List[Path]:
    """Paths of ``a`` absent from ``b`` whose parent is in ``b`` as the same container (the
    topmost absent keys, as Megatron-Core's ``diff`` reports them), in ``a``'s order."""
    return [p for p in a if p and p not in b and a[p[:-1]] == b.get(p[:-1])]


def find_common_state_differences(
    fingerprints: Sequence[Fingerprints],
) -> Dict[int, Tuple[List[Path], List[Path], List[Tuple[Path, _Shown, _Shown]]]]:
    """Per rank r > 0 that differs from rank 0, as Megatron-Core's ``validate_common_state_dict``
    reports it: ``(keys only on rank 0, keys only on rank r, [(key, type on rank 0, type on
    rank r)] of the values that differ)``."""
    ref = fingerprints[0]
    out = {}
    for rank, fp in enumerate(fingerprints[1:], start=1):
        only_0 = _only_in(ref, fp)
        only_r = _only_in(fp, ref)
        differ = [(p, _Shown(ref[p][0]), _Shown(fp[p][0])) for p in ref if p in fp and ref[p] != fp[p]]
        if only_0 or only_r or differ:
            out[rank] = (only_0, only_r, differ)
    return out


#: the exchanged form of one rank's common state: ``common_state_fingerprints`` as JSON
FingerprintDoc = List[Any]


def fingerprint_common_state(common_state_dict: Any) -> Tuple[FingerprintDoc, int]:
    """This rank's fingerprints of the common state, as exchanged, and a 63-bit digest of them
    (local; equal digests on every rank mean equal common states, bar a hash collision).

    A save all-reduces ``[digest, -digest]`` (maximum): the state is the same on every rank
    when the maximum equals minus the other maximum, and only then is nothing gathered.
    """
    doc = _to_json(common_state_fingerprints(common_state_dict))
    text = json.dumps(doc, sort_keys=True).encode("utf-8")
    return doc, int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1  # fits an int64


def report_common_state_differences(doc: FingerprintDoc) -> None:
    """Collective: gather every rank's fingerprints to rank 0 and log at WARNING how they differ.

    Called by every rank once the digests showed a difference (see
    `validate_common_state_dict()` for the message).
    """
    gathered = gather_json(doc)
    if gathered is None:
        return
    differences = find_common_state_differences([_from_json(d) for d in gathered])
    if differences:
        shown = {
            rank: tuple(keys[:_KEYS_PER_RANK] for keys in diff)
            for rank, diff in sorted(differences.items())[:MAX_REPORTED_PROBLEMS]
        }
        more = len(differences) - len(shown)
        logger.warning(
            "There is difference in the common state dict in different ranks. The differences are %s. "
            "The common (non-sharded) state differs between ranks%s; only rank 0's copy is saved: keep rank-specific "
            "state in a ShardedObject, or drop expected differences with preprocess_common_before_consistancy_check",
            shown,
            f" (and {more} more ranks differ)" if more else "",
        )


def validate_common_state_dict(common_state_dict: Dict[str, Any]) -> None:
    """Collective: log at WARNING (on rank 0) how the ranks' common states differ.

    Only rank 0's common state is saved, so a difference usually means a bug (or rank-specific
    state that belongs in a ShardedObject). Fingerprints, not the objects, are gathered -- and
    only when they differ: one all-reduce of a digest of them tells every rank whether all ranks
    hold the same, the usual case at every save. The message starts as Megatron-Core's does
    (callers match on it): "There is difference in the common state dict in different ranks. The
    differences are {rank: (only on rank 0, only on that rank, differing values)}", listing at
    most 10 ranks and 20 keys of each kind per rank.
    """
    doc, digest = fingerprint_common_state(common_state_dict)
    if get_world_size() > 1:
        newest, minus_oldest = all_reduce_max([digest, -digest])
        if newest == -minus_oldest:
            return
    report_common_state_differences(doc)


__all__ = [
    "FingerprintDoc",
    "common_state_fingerprints",
    "find_common_state_differences",
    "fingerprint_common_state",
    "report_common_state_differences",
    "validate_common_state_dict",
]
