"""Whether the common (non-sharded) state agrees across ranks: rank 0 saves it for everyone."""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
from typing import Any, Dict, Iterable, List, Sequence, Tuple

import numpy as np
import torch

from dist_ckpt.engine.distributed import all_reduce_max, gather_json, get_world_size
from dist_ckpt.errors import format_problems

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


def common_state_fingerprints(common_state_dict: Any, prefix: str = "") -> Dict[str, str]:
    """``{"a/b/0": fingerprint}`` for every leaf of the common state (compact, comparable)."""
    out: Dict[str, str] = {}
    items: Iterable[Tuple[Any, Any]]
    if isinstance(common_state_dict, dict):
        items = common_state_dict.items()
    elif isinstance(common_state_dict, list):
        items = enumerate(common_state_dict)
    else:
        return {prefix or "<root>": _fingerprint(common_state_dict)}
    for k, v in items:
        path = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, (dict, list)) and v:
            out.update(common_state_fingerprints(v, path))
        else:
            out[path] = _fingerprint(v)
    return out


def find_common_state_differences(
    fingerprints: Sequence[Dict[str, str]],
) -> Dict[int, Tuple[List[str], List[str], List[str]]]:
    """Per rank r > 0: (paths only on rank 0, paths only on rank r, paths whose values differ)."""
    ref = fingerprints[0]
    out = {}
    for rank, fp in enumerate(fingerprints[1:], start=1):
        only_0 = sorted(ref.keys() - fp.keys())
        only_r = sorted(fp.keys() - ref.keys())
        differ = sorted(k for k in ref.keys() & fp.keys() if ref[k] != fp[k])
        if only_0 or only_r or differ:
            out[rank] = (only_0, only_r, differ)
    return out


def validate_common_state_dict(common_state_dict: Dict[str, Any]) -> None:
    """Collective: log at WARNING (on rank 0) how the ranks' common states differ.

    Only rank 0's common state is saved, so a difference usually means a bug (or rank-specific
    state that belongs in a ShardedObject). Fingerprints, not the objects, are gathered -- and
    only when they differ: one all-reduce of a digest of them tells every rank whether all ranks
    hold the same, the usual case at every save.
    """
    fingerprints = common_state_fingerprints(common_state_dict)
    if get_world_size() > 1:
        text = json.dumps(fingerprints, sort_keys=True).encode("utf-8")
        digest = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1  # fits an int64
        newest, minus_oldest = all_reduce_max([digest, -digest])
        if newest == -minus_oldest:
            return
    gathered = gather_json(fingerprints)
    if gathered is None:
        return
    differences = find_common_state_differences(gathered)
    if differences:
        lines = [
            f"rank {rank}: only on rank 0: {only_0[:5]}, only on rank {rank}: {only_r[:5]}, different values: "
            f"{differ[:5]}"
            for rank, (only_0, only_r, differ) in sorted(differences.items())
        ]
        logger.warning(
            "the common (non-sharded) state differs between ranks; only rank 0's copy is saved. %s",
            format_problems(lines),
        )


__all__ = ["common_state_fingerprints", "find_common_state_differences", "validate_common_state_dict"]
