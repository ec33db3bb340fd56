"""Turning checkpoint keys into file names that cannot escape the checkpoint directory.

Keys are names, not paths. A key whose ``/``-separated parts include ``..`` or ``.``, that starts
with ``/`` or holds control characters is rejected; every other key maps to a single file-name
component: characters outside ``[A-Za-z0-9_.-]`` (and a leading ``.``) are percent-encoded, and
very long results are shortened with a hash, so distinct keys get distinct names.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional, Union

from dist_ckpt.errors import InvalidKeyError, with_rank

_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_MAX_NAME = 200  # well below the 255-byte limit of common file systems


def validate_key(key: str, rank: Optional[int] = None) -> None:
    """Raise :class:`InvalidKeyError` if ``key`` could not be stored safely."""
    problem = None
    if not isinstance(key, str) or not key:
        problem = "keys must be non-empty strings"
    elif key.startswith("/"):
        problem = "keys must not start with '/'"
    elif any(part in (".", "..") for part in key.replace("\\", "/").split("/")):
        problem = "keys must not contain '.' or '..' path components"
    elif any(ord(c) < 32 or ord(c) == 127 for c in key):
        problem = "keys must not contain control characters"
    if problem:
        raise InvalidKeyError(
            with_rank(
                f"invalid checkpoint key {key!r}: {problem} (it would not stay inside the checkpoint directory)", rank
            )
        )


def encode_key(key: str) -> str:
    """File-name component for ``key``; deterministic and injective (up to a 64-bit hash)."""
    validate_key(key)
    out = []
    for i, ch in enumerate(key):
        if ch in _SAFE and not (i == 0 and ch == "."):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    name = "".join(out)
    if len(name) > _MAX_NAME:
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
        name = f"{name[: _MAX_NAME - 17]}~{digest}"
    return name


def decode_key(name: str) -> Optional[str]:
    """Inverse of :func:`encode_key`, or None for a name shortened with a hash."""
    if "~" in name:
        return None
    raw = bytearray()
    i = 0
    while i < len(name):
        if name[i] == "%":
            raw.append(int(name[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.extend(name[i].encode("ascii"))
            i += 1
    return raw.decode("utf-8")


def is_shortened(name: str) -> bool:
    """Whether :func:`encode_key` shortened this name (the key must be recorded elsewhere)."""
    return "~" in name


def safe_join(root: Union[str, Path], *parts: str) -> Path:
    """Join ``parts`` under ``root``, refusing any result outside ``root``."""
    base = Path(root).resolve()
    path = base.joinpath(*parts).resolve()
    if path != base and base not in path.parents:
        raise InvalidKeyError(f"path {'/'.join(parts)!r} escapes the checkpoint directory {str(base)!r}")
    return path
