"""The rules for keys: checkpoint keys, the names they become, and storage object keys.

Two kinds of key, each checked by one function here:

* a *checkpoint key* (``ShardedTensor.key``) is a name, not a path (`validate_key()`): one
  whose ``/``-separated parts include ``..`` or ``.``, that starts with ``/`` or holds control
  characters is rejected; every other key maps to a single file-name component
  (`encode_key()`): characters outside ``[A-Za-z0-9_.-]`` (and a leading ``.``) are
  percent-encoded, and very long results are shortened with a hash, so distinct keys get
  distinct names;
* an *object key* (what a [`Storage`][dist_ckpt.storage.base.Storage] stores under, e.g.
  ``"safetensors/index.json"``) is a relative ``/``-separated path that is safe both as a file
  under a directory and as an S3 key under a prefix (`validate_object_key()`, which applies
  the checkpoint-key rules and the limits of file systems and S3).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path
from typing import Optional, Union

from dist_ckpt.errors import InvalidKeyError, UnsafeLinkError, with_rank

__all__ = [
    "confined",
    "decode_key",
    "encode_key",
    "is_shortened",
    "safe_join",
    "validate_key",
    "validate_object_key",
    "validate_prefix",
]

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # one C-level scan instead of a Python loop per character
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
_MAX_NAME = 200  # well below the 255-byte limit of common file systems
_MAX_KEY_BYTES = 1024  # the S3 limit on a whole key (prefix included)
_MAX_COMPONENT_BYTES = 255  # the usual limit on a file name


def validate_key(key: str, rank: Optional[int] = None) -> None:
    """Raise [`InvalidKeyError`][dist_ckpt.errors.InvalidKeyError] if ``key`` could not be stored safely."""
    problem = None
    if not isinstance(key, str) or not key:
        problem = "keys must be non-empty strings"
    elif key.startswith("/"):
        problem = "keys must not start with '/'"
    elif any(part in (".", "..") for part in key.replace("\\", "/").split("/")):
        problem = "keys must not contain '.' or '..' path components"
    elif _CONTROL.search(key):
        problem = "keys must not contain control characters"
    if problem:
        raise InvalidKeyError(
            with_rank(
                f"invalid checkpoint key {key!r}: {problem} (it would not stay inside the checkpoint directory)", rank
            )
        )


def validate_object_key(key: str) -> str:
    """Return ``key`` if it is a valid relative object key, else raise
    [`InvalidKeyError`][dist_ckpt.errors.InvalidKeyError].

    A key is ``/``-separated; no component is empty, ``.`` or ``..``; it does not start with
    ``/``; it has no backslash or control character; components fit in 255 bytes and the key in
    1024 bytes (UTF-8). The same key is then safe as a file path under a directory and as an S3
    key under a prefix.

    Example:

    ```python
    validate_object_key("safetensors/index.json")   # ok
    validate_object_key("../etc/passwd")            # raises InvalidKeyError
    ```
    """
    validate_key(key)
    problem = None
    if "\\" in key:
        problem = "keys use '/' as the only separator (no backslash)"
    elif any(part == "" for part in key.split("/")):
        problem = "keys must not have empty components (leading, trailing or doubled '/')"
    elif len(key.encode("utf-8")) > _MAX_KEY_BYTES:
        problem = f"keys must fit in {_MAX_KEY_BYTES} bytes (UTF-8)"
    elif any(len(part.encode("utf-8")) > _MAX_COMPONENT_BYTES for part in key.split("/")):
        problem = f"each '/'-separated component must fit in {_MAX_COMPONENT_BYTES} bytes (UTF-8)"
    if problem:
        raise InvalidKeyError(f"invalid object key {key!r}: {problem}")
    return key


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` for listings and deletions: "" (everything) or a valid object key.

    Example:

    ```python
    validate_prefix("")             # everything under the root
    validate_prefix("safetensors")  # everything under safetensors/
    ```
    """
    return prefix if prefix == "" else validate_object_key(prefix)


@functools.lru_cache(maxsize=1 << 16)  # a pure function, called for every key of every save and load
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
    """Inverse of `encode_key()`, or None for a name shortened with a hash."""
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
    """Whether `encode_key()` shortened this name (the key must be recorded elsewhere)."""
    return "~" in name


def safe_join(root: Union[str, Path], *parts: str) -> Path:
    """Join ``parts`` under ``root``, refusing any result outside ``root`` (see `confined()`).

    Raises:
        InvalidKeyError: ``parts`` name a place outside ``root`` (``..``, an absolute path).
        UnsafeLinkError: they name a place inside, reached through a link that leads outside.
    """
    base = Path(root).resolve()
    lexical = Path(os.path.normpath(base.joinpath(*parts)))
    if lexical != base and base not in lexical.parents:
        raise InvalidKeyError(f"path {'/'.join(parts)!r} escapes the checkpoint directory {str(base)!r}")
    return confined(lexical, base)


def confined(path: Union[str, Path], *roots: Union[str, Path]) -> Path:
    """The real path of ``path``, which must lie inside one of ``roots`` (the checkpoint
    directory, and for a HuggingFace cache snapshot its repository's ``blobs``): the one symlink
    policy of every local read. A root may itself be a link; links inside the checkpoint are
    followed; a link (of the file or of any directory on its way) that leads outside is refused.
    A path that does not exist is returned resolved as far as it goes (opening it then fails).

    Example:

    ```python
    fd = os.open(confined(ckpt / "safetensors" / name, ckpt), os.O_RDONLY)
    ```

    Raises:
        UnsafeLinkError: naming the path, where its links lead, and the checkpoint directory.
    """
    real = Path(path).resolve()
    bases = [Path(r).resolve() for r in roots]
    if any(real == b or b in real.parents for b in bases):
        return real
    raise UnsafeLinkError(
        f"{str(path)!r} leads to {str(real)!r}, outside the checkpoint directory {str(Path(roots[0]))!r}, through a "
        "symbolic link: it is not read (a checkpoint may link within itself only; the checkpoint directory itself "
        "may be a link)"
    )
