"""Megatron-Core's integrity manifest (``integrity.json``, megatron-core 0.18+): the SHA-256 of every
file of a committed checkpoint, written by ``save(..., verify_integrity=True)`` and checked by
``load(..., verify_integrity=True)``.

```python
{"algorithm": "sha256", "files": {"metadata.json": "64 hex digits", "common.pt": "...", "__0_0.distcp": "..."}}
```

Names are paths relative to the checkpoint directory (a torch_dist checkpoint has top-level files
only, as Megatron-Core's; other backends' subdirectories are listed by their relative paths). It
is written once the checkpoint is committed, so it covers ``metadata.json`` too; a checkpoint saved
without it loads as before, and ``load(..., verify_integrity=True)`` refuses it.

Megatron-Core hashes every file on rank 0. Here the files are spread over the ranks by size (the
largest first, each to the rank with the fewest bytes so far) and every rank hashes its share, in
parallel; rank 0 gathers the digests and writes the manifest. Verifying is spread the same way,
and every rank raises the same [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError]
naming each file that is missing or differs.

Example:

```python
write_integrity_manifest(storage)       # collective, after the commit
verify_integrity_manifest(storage)      # collective, before a load
```
"""

from __future__ import annotations

import hashlib
import heapq
import json
import re
from typing import Dict, List, Optional, Sequence, Tuple

from dist_ckpt.collectives.distributed import (
    ProcessGroup,
    all_gather_json,
    broadcast_json,
    gather_json,
    get_rank,
    get_world_size,
    run_collectively,
)
from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError
from dist_ckpt.integrity.safe_json import loads, want_object
from dist_ckpt.storage import ObjectNotFoundError, Storage

__all__ = [
    "INTEGRITY_MANIFEST_FILENAME",
    "assign_files",
    "manifest_json",
    "parse_manifest",
    "sha256_of",
    "verify_integrity_manifest",
    "write_integrity_manifest",
]

#: Megatron-Core's name of the manifest, beside ``metadata.json``
INTEGRITY_MANIFEST_FILENAME = "integrity.json"
_ALGORITHM = "sha256"
_HEX = re.compile(r"^[0-9a-f]{64}$")
#: bytes read per call while hashing (the digest is computed as the bytes arrive)
_READ_BYTES = 8 << 20
#: files a save never leaves behind (the claim is removed at the commit)
_TRANSIENT = frozenset({INTEGRITY_MANIFEST_FILENAME, "save_in_progress.json"})


def sha256_of(storage: Storage, name: str) -> str:
    """The SHA-256 (hex) of object ``name``, read in pieces of `_READ_BYTES`.

    Raises:
        ObjectNotFoundError: no such object.
    """
    digest = hashlib.sha256()
    buf = bytearray(_READ_BYTES)
    with storage.open_reader(name) as reader:
        size, offset = reader.size(), 0
        while offset < size:
            view = memoryview(buf)[: min(_READ_BYTES, size - offset)]
            got = reader.read_into([view], offset)
            if got <= 0:
                raise CorruptCheckpointError(f"{storage.url_of(name)} ended at byte {offset} of {size} while hashed")
            digest.update(view[:got])
            offset += got
    return digest.hexdigest()


def manifest_json(digests: Dict[str, str]) -> bytes:
    """The manifest of ``digests`` (name -> hex SHA-256)."""
    return json.dumps({"algorithm": _ALGORITHM, "files": dict(sorted(digests.items()))}, indent=1).encode()


def parse_manifest(raw: bytes, where: str) -> Dict[str, str]:
    """The files and digests of a manifest read from ``where``.

    Raises:
        CorruptCheckpointError: not such a manifest, another algorithm, or a malformed digest.
    """
    doc = want_object(loads(raw, where), where)
    if doc.get("algorithm") != _ALGORITHM:
        raise CorruptCheckpointError(f"{where}: algorithm {doc.get('algorithm')!r}, only {_ALGORITHM!r} is known")
    files = doc.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and _HEX.match(v) for k, v in files.items()
    ):
        raise CorruptCheckpointError(f"{where}: 'files' must map file names to 64 hex digits")
    return dict(files)


def assign_files(sizes: Sequence[Tuple[str, int]], world: int) -> List[List[str]]:
    """Each rank's share of the files (``(name, size)``): largest first, each to the rank with the
    fewest bytes so far, ties to the lowest rank (the same on every rank)."""
    shares: List[List[str]] = [[] for _ in range(max(world, 1))]
    loads_ = [(0, r) for r in range(len(shares))]
    for name, size in sorted(sizes, key=lambda f: (-f[1], f[0])):
        total, rank = heapq.heappop(loads_)
        shares[rank].append(name)
        heapq.heappush(loads_, (total + size, rank))
    return shares


def _checkpoint_files(storage: Storage) -> List[Tuple[str, int]]:
    return [(o.key, o.size) for o in storage.list("") if o.key not in _TRANSIENT]


def write_integrity_manifest(storage: Storage, group: Optional[ProcessGroup] = None) -> Dict[str, str]:
    """Hash every file of the checkpoint (each rank a share) and write the manifest (rank 0 of
    ``group``); collective, an error on any rank raised on every rank. Returns the digests on
    rank 0 (an empty dict elsewhere)."""
    listed = run_collectively(
        "listing the files to hash", lambda: _checkpoint_files(storage) if get_rank(group) == 0 else None, group
    )
    files = [(str(n), int(size)) for n, size in broadcast_json(listed, 0, group)]
    mine = assign_files(files, get_world_size(group))[get_rank(group)]
    digests = run_collectively(
        "hashing the checkpoint's files", lambda: {n: sha256_of(storage, n) for n in mine}, group
    )
    gathered = gather_json(digests, 0, group)
    merged: Dict[str, str] = {}

    def write() -> None:
        if get_rank(group) == 0:
            assert gathered is not None
            for part in gathered:
                merged.update(part)
            storage.write(INTEGRITY_MANIFEST_FILENAME, manifest_json(merged))

    run_collectively(f"writing {INTEGRITY_MANIFEST_FILENAME}", write, group)
    return merged


def verify_integrity_manifest(storage: Storage, group: Optional[ProcessGroup] = None) -> None:
    """Check every file the manifest lists (each rank a share); collective.

    Raises:
        CheckpointingException: the checkpoint has no manifest (saved without ``verify_integrity``).
        CorruptCheckpointError: the manifest is malformed, or files are missing or differ (every
            one named, on every rank).
    """
    where = storage.url_of(INTEGRITY_MANIFEST_FILENAME)

    def read() -> Optional[Dict[str, str]]:
        if get_rank(group) != 0:
            return None
        try:
            raw = storage.read(INTEGRITY_MANIFEST_FILENAME)
        except ObjectNotFoundError:
            raise CheckpointingException(
                f"{storage.url!r} has no {INTEGRITY_MANIFEST_FILENAME}: it was saved without "
                f"verify_integrity=True, so its files cannot be verified (load it without verify_integrity)"
            ) from None
        return parse_manifest(raw, where)

    read_on_rank0 = run_collectively(f"reading {INTEGRITY_MANIFEST_FILENAME}", read, group)
    expected: Dict[str, str] = dict(broadcast_json(read_on_rank0, 0, group))
    sizes = []
    for name in expected:
        try:
            sizes.append((name, storage.size(name)))
        except ObjectNotFoundError:
            sizes.append((name, 0))  # reported missing by whoever checks it
    mine = assign_files(sizes, get_world_size(group))[get_rank(group)]

    def check() -> List[str]:
        problems = []
        for name in mine:
            try:
                found = sha256_of(storage, name)
            except ObjectNotFoundError:
                problems.append(f"{name} is missing")
                continue
            if found != expected[name]:
                problems.append(f"{name} differs (sha256 {found}, {expected[name]} recorded)")
        return problems

    problems = sorted(
        p for part in all_gather_json(run_collectively("verifying the files", check, group), group) for p in part
    )
    if problems:
        raise CorruptCheckpointError(
            f"[rank {get_rank(group)}] {storage.url!r} does not match its {INTEGRITY_MANIFEST_FILENAME}: "
            + "; ".join(problems)
        )
