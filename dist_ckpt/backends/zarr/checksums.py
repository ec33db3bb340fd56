"""crc32c checksums of zarr-format checkpoints, shared by both engines (zarr-python, TensorStore).

At save time every rank digests the files it wrote (chunk files and ``zarr.json`` nodes), from
the bytes as they were written where it wrote them itself or through a recording store, else by
reading them back once (the files TensorStore's library wrote: the bytes on disk are what it encoded),
the digests are gathered to rank 0, and rank 0 writes ``zarr/checksums.json`` -- a checksum
manifest (see [`dist_ckpt.integrity.checksums`][dist_ckpt.integrity.checksums]) of every file under ``zarr/``, by path
relative to it.

At load time:

* the zarr-python engine sees the raw bytes of every file it reads: its store is a
  `VerifyingStore`, which checks each whole file it returns against the manifest, with
  no extra I/O;
* TensorStore decodes chunks in its own threads and never shows their bytes, so its loader reads
  every chunk file a load touches once more, before TensorStore does (`check_files()`; the
  page cache then serves TensorStore's read): a second pass over the bytes, which
  ``TensorStoreLoadShardedStrategy(verify_checksums=False)`` skips.

A checkpoint without the manifest (saved before checksums existed) loads without verification.
`verify_zarr()` checks a whole checkpoint for ``dist-ckpt verify``.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from dist_ckpt.backends.zarr.layout import CHECKSUMS_FILENAME, LAYOUT_CHUNKED, ZARR_DIR, chunk_coords, chunk_key
from dist_ckpt.backends.zarr.metadata import (
    JsonCheck,
    StoredTensorInfo,
    chunk_separator,
    damaged_chunks,
    list_tensor_names,
    open_tensor_info,
    read_zarr_json,
)
from dist_ckpt.backends.zarr.metadata_index import index_part, merged_documents, write_root
from dist_ckpt.backends.zarr.nodes import in_threads
from dist_ckpt.collectives.distributed import gather_json, get_rank, get_world_size, run_collectively
from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError
from dist_ckpt.integrity.checksums import (
    FileDigest,
    IntegrityReport,
    check_file,
    file_digest,
    file_problem,
    parse_manifest_bytes,
    write_manifest,
)
from dist_ckpt.model.dtypes import dtype_from_name, dtype_info
from dist_ckpt.model.geometry import Box
from dist_ckpt.record.records import location_of_node, read_recorded, refresh_record
from dist_ckpt.storage import check_regular
from dist_ckpt.storage.object_path import ObjectPath, node_files

__all__ = [
    "CHECKSUMS_FILENAME",
    "MANIFEST_KEY",
    "VerifyingStore",
    "check_files",
    "chunk_files",
    "commit_checksums",
    "drop_from_checksums",
    "manifest_check",
    "read_checksums",
    "verify_zarr",
]

logger = logging.getLogger(__name__)


def commit_checksums(
    root: ObjectPath,
    written: Sequence[ObjectPath],
    known: Optional[Mapping[ObjectPath, FileDigest]] = None,
    documents: Optional[Mapping[str, str]] = None,
) -> None:
    """Collective: digest the files this rank wrote under ``root`` (``zarr/``); rank 0 writes the
    manifest of every rank's files. Files in ``known`` (digested as they were written) are not
    read again. With ``documents`` (a local save: the text of each ``zarr.json`` this rank
    wrote, by name under ``root``), rank 0 first writes the root group indexing every rank's
    documents (`dist_ckpt.backends.zarr.metadata_index`); without, the root group exists already.

    Example:

    ```python
    commit_checksums(ckpt / "zarr", files_this_rank_wrote)   # every rank, after the writes
    ```
    """

    def digest_all() -> Dict[str, Any]:
        paths = sorted(set(written), key=str)
        # the files read back (TensorStore's, or written without a recording store) several at a time
        digests = in_threads(lambda p: _digest(p, known), paths)
        files = {p.relative_to(root): d.to_json() for p, d in zip(paths, digests)}
        part = index_part(documents, get_world_size()) if documents is not None else None
        return {"files": files, "documents": part}

    local = run_collectively("digesting zarr files", digest_all)
    gathered = gather_json(local)

    def write() -> None:
        if get_rank() != 0:
            return
        assert gathered is not None
        files: Dict[str, FileDigest] = {}
        for part in gathered:
            for name, entry in part["files"].items():
                files[name] = FileDigest(entry["size"], int(entry["crc32c"], 16))
        if documents is not None:
            files["zarr.json"] = write_root(root, merged_documents([part["documents"] for part in gathered]))
        write_manifest(root / CHECKSUMS_FILENAME, files)

    run_collectively("writing zarr/checksums.json", write)


def _digest(path: ObjectPath, known: Optional[Mapping[ObjectPath, FileDigest]]) -> FileDigest:
    found = known.get(path) if known else None
    return found if found is not None else file_digest(path)


#: the manifest's key relative to the checkpoint (its integrity record in ``metadata.json``)
MANIFEST_KEY = f"{ZARR_DIR}/{CHECKSUMS_FILENAME}"


def read_checksums(checkpoint_dir: ObjectPath) -> Optional[Dict[str, FileDigest]]:
    """The manifest of a zarr checkpoint, or None if it was saved without checksums.

    Read through `read_recorded()`: a manifest that
    ``metadata.json`` records but that is missing or changed raises (fails closed).

    Example:

    ```python
    manifest = read_checksums(checkpoint_node("ckpt/iter_1000", "verify")) or {}
    ```
    """
    raw = read_recorded(checkpoint_dir, MANIFEST_KEY)
    return None if raw is None else parse_manifest_bytes(raw, str(checkpoint_dir / MANIFEST_KEY))


def manifest_check(root: ObjectPath, manifest: Optional[Mapping[str, FileDigest]]) -> JsonCheck:
    """A check of each ``zarr.json`` read under ``root`` (``zarr/``) against ``manifest``, or None
    without one: a node the manifest does not list was not written by the save.

    Example:

    ```python
    plan_request(requested, ckpt, manifest_check(ckpt / "zarr", read_checksums(ckpt)))
    ```
    """
    if manifest is None:
        return None
    listed = manifest

    def check(path: ObjectPath, data: bytes) -> None:
        name = path.relative_to(root)
        expected = listed.get(name)
        if expected is None:
            raise CorruptCheckpointError(
                f"{str(path)!r} is not listed in {MANIFEST_KEY}: the save did not write it; the checkpoint is damaged"
            )
        check_file(path, expected, f"[rank {get_rank()}] zarr metadata", data)

    return check


def drop_from_checksums(root: ObjectPath, tensor_dir_name: str) -> None:
    """Remove a deleted tensor's files from the manifest (if there is one), and update the
    manifest's integrity record in ``metadata.json``; one process calls it.

    Example:

    ```python
    drop_from_checksums(ckpt / "zarr", tensor_dir_name("old.w"))
    ```
    """
    manifest = read_checksums(root.parent)
    if manifest is not None:
        kept = {name: d for name, d in manifest.items() if not name.startswith(f"{tensor_dir_name}/")}
        write_manifest(root / CHECKSUMS_FILENAME, kept)
        refresh_record(location_of_node(root.parent), MANIFEST_KEY)


def chunk_files(array_path: ObjectPath, region: Box) -> List[ObjectPath]:
    """The chunk files of the array at ``array_path`` that hold ``region``.

    Example:

    ```python
    chunk_files(ckpt / "zarr" / "w", Box((0, 0), (4, 8)))   # [.../w/c.0.0, ...]
    ```
    """
    doc = read_zarr_json(array_path)
    if doc is None:
        return []
    try:
        chunk_shape = [int(c) for c in doc["chunk_grid"]["configuration"]["chunk_shape"]]
    except (KeyError, TypeError, ValueError):
        return []  # the engine reports the damaged metadata when it opens the array
    separator = chunk_separator(doc)
    return [array_path / chunk_key(coords, separator) for coords in chunk_coords(region, chunk_shape)]


def check_files(root: ObjectPath, paths: Sequence[ObjectPath], manifest: Mapping[str, FileDigest], key: str) -> None:
    """Check each file under ``root`` that the manifest lists against it (read once each).

    Example:

    ```python
    check_files(ckpt / "zarr", chunk_files(array_path, region), manifest, "w")
    ```

    Raises:
        CorruptCheckpointError: a missing or resized file; ChecksumMismatchError: other bytes.
    """
    for path in paths:
        expected = manifest.get(path.relative_to(root))
        if expected is not None:
            check_file(path, expected, f"[rank {get_rank()}] tensor {key!r}")


class VerifyingStore:
    """Builds zarr-python stores that check every whole file they return against the manifest.

    A factory instead of a class at import time: zarr is an optional dependency, imported only
    by the zarr engine that calls `open()`.
    """

    def __init__(self, root: ObjectPath, manifest: Mapping[str, FileDigest]) -> None:
        self.root = root
        self.manifest = manifest
        self._cls: Any = None

    def open(self, array_path: ObjectPath) -> Any:
        """A read-only ``LocalStore`` subclass rooted at ``array_path`` (a storage with
        ``local_paths``; `open_objects()` serves object stores)."""
        if self._cls is None:
            self._cls = _store_class()
        return self._cls(array_path, array_path.relative_to(self.root), self.manifest)

    def open_objects(self, obstore_store: Any, url: str) -> Any:
        """A read-only ``zarr.storage.ObjectStore`` subclass over ``obstore_store``, which must be
        rooted at ``zarr/`` (an S3 checkpoint's ``self.root``; ``url`` names it in errors):
        arrays are opened by their path under it, and every key is one the manifest lists."""
        from zarr.storage import ObjectStore

        manifest = self.manifest

        class _Objects(ObjectStore):  # type: ignore[type-arg]
            async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
                buf = await super().get(key, prototype, byte_range)
                expected = manifest.get(key)
                if buf is not None and byte_range is None and expected is not None:
                    check_file(f"{url}/{key}", expected, f"[rank {get_rank()}] zarr object", buf.as_numpy_array())
                return buf

        return _Objects(obstore_store, read_only=True)


def _store_class() -> Any:
    from zarr.storage import LocalStore

    class _Store(LocalStore):
        def __init__(self, node: ObjectPath, prefix: str, manifest: Mapping[str, FileDigest]) -> None:
            super().__init__(str(node.local_path()), read_only=True)
            self._node = node
            self._prefix = prefix
            self._manifest = manifest

        async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
            # zarr-python opens the file by path: the storage checks where it leads, and that it is
            # a regular file (a FIFO would block the read forever)
            check_regular((self._node / key).local_path(), str(self._node / key))
            buf = await super().get(key, prototype, byte_range)
            expected = self._manifest.get(f"{self._prefix}/{key}")
            if buf is not None and byte_range is None and expected is not None:
                check_file(Path(str(self.root)) / key, expected, f"[rank {get_rank()}] zarr file", buf.as_numpy_array())
            return buf

    return _Store


def verify_zarr(checkpoint_dir: ObjectPath) -> IntegrityReport:
    """Check every file of a zarr-format checkpoint; never raises for a damaged one.

    With a manifest: every listed file must exist with its size and crc. Without (older
    checkpoints): every chunk file must exist with the size its array implies. Either way every
    tensor's metadata must pass the checks a load makes (`_verify_metadata()`).

    Example:

    ```python
    for problem in verify_zarr(checkpoint_node("ckpt/iter_1000", "verify")).problems: print(problem)
    ```
    """
    root = checkpoint_dir / ZARR_DIR
    report = IntegrityReport()
    manifest_rel = f"{ZARR_DIR}/{CHECKSUMS_FILENAME}"
    try:
        manifest = read_checksums(checkpoint_dir)
    except CheckpointingException as e:
        report.add(manifest_rel, str(e))
        return report
    if manifest is None:
        report.notes.append(f"{manifest_rel} is absent (saved without checksums): only the structure was checked")
        _verify_structure(root, checkpoint_dir, report)
        return report
    report.files_checked += 1
    try:
        listed = [p.relative_to(root) for p in node_files(root)]
    except CheckpointingException as e:  # a link out of the checkpoint: listing refuses to follow it
        report.add(ZARR_DIR, str(e))
        listed = []
    present = {name for name in listed if not any(part.startswith(".") for part in name.split("/"))}
    for name in sorted(present - set(manifest) - {CHECKSUMS_FILENAME}):
        report.add(
            f"{ZARR_DIR}/{name}",
            f"not listed in {manifest_rel} (written after the save, or left by another one)",
            _key_of(root, name),
        )
    for name, expected in sorted(manifest.items()):
        try:
            found = file_problem(root / name, expected)
        except CheckpointingException as e:  # a link out of the checkpoint (the storage refuses it)
            found = (str(e), False)
        if found is not None:
            report.add(f"{ZARR_DIR}/{name}", found[0], _key_of(root, name))
        report.files_checked += 1
        report.bytes_checked += expected.size
    _verify_metadata(root, checkpoint_dir, report)
    return report


def _key_of(root: ObjectPath, name: str) -> Optional[str]:
    """The key of the tensor whose directory holds the file ``name`` (None if unknown)."""
    tensor_dir, sep, _ = name.partition("/")
    if not sep:
        return None
    try:
        info = open_tensor_info(root, tensor_dir)
    except CheckpointingException:
        return None
    return None if info is None else info.key


def _verify_metadata(root: ObjectPath, checkpoint_dir: ObjectPath, report: IntegrityReport) -> List[StoredTensorInfo]:
    """Every tensor's metadata, parsed and checked as loads do (`open_tensor_info()`: size and
    depth of each ``zarr.json``, its key, shapes, the coverage of a flattened tensor's
    fragments): files whose checksums agree can still hold what every loader refuses. Each
    tensor that fails is one problem; returns the others."""
    try:
        names = list_tensor_names(root)
    except CheckpointingException as e:
        report.add(ZARR_DIR, str(e))
        return []
    infos = []
    for name in names:
        try:
            info = open_tensor_info(root, name)
        except CheckpointingException as e:
            report.add((root / name / "zarr.json").relative_to(checkpoint_dir), str(e))
            continue
        if info is not None:
            infos.append(info)
    return infos


def _verify_structure(root: ObjectPath, checkpoint_dir: ObjectPath, report: IntegrityReport) -> None:
    """Without a manifest: every tensor's metadata (`_verify_metadata()`) and chunk files."""
    for info in _verify_metadata(root, checkpoint_dir, report):
        report.files_checked += 1
        arrays = (
            [(info.path, info.bounds)]
            if info.layout == LAYOUT_CHUNKED
            else [(f.path, Box((0,), (f.flat_range[1] - f.flat_range[0],))) for f in info.fragments]
        )
        for path, region in arrays:
            if region.numel == 0:
                continue
            expected = _chunk_bytes(path)
            if expected is None:
                for problem in damaged_chunks(path, region):  # names the damaged metadata
                    report.add((path / "zarr.json").relative_to(checkpoint_dir), problem, info.key)
                continue
            for chunk in chunk_files(path, region):
                report.files_checked += 1
                try:
                    size = chunk.stat().st_size
                except FileNotFoundError:
                    report.add(chunk.relative_to(checkpoint_dir), "missing", info.key)
                    continue
                if size != expected:
                    report.add(
                        chunk.relative_to(checkpoint_dir),
                        f"has {size} bytes, its array's chunks have {expected}",
                        info.key,
                    )


def _chunk_bytes(array_path: ObjectPath) -> Optional[int]:
    """Size of every chunk file of an uncompressed array (None if its metadata is unusable)."""
    doc = read_zarr_json(array_path)
    try:
        chunk_shape = [int(c) for c in _field(doc, "chunk_grid", "configuration", "chunk_shape")]
        itemsize = dtype_info(dtype_from_name(str(_field(doc, "data_type")))).numpy_dtype.itemsize
    except (CheckpointingException, TypeError, ValueError):
        return None
    return math.prod(chunk_shape) * itemsize


def _field(doc: Any, *names: str) -> Any:
    for name in names:
        if not isinstance(doc, dict):
            raise TypeError(f"no field {name!r}")
        doc = doc.get(name)
    return doc
