"""Where things are in a zarr-format checkpoint: directory and file names, chunk keys, the root.

Both engines -- zarr-python ([`zarr_python`][dist_ckpt.backends.zarr.zarr_python]) and TensorStore
([`tensorstore_engine`][dist_ckpt.backends.zarr.tensorstore_engine]) -- and the modules that read the metadata
(`metadata`), plan reads (`read_plan`) and write nodes (`nodes`) share these names; this module imports neither library.

Layout:

```text
zarr/zarr.json                              root group (a local save: every zarr.json's text, see `metadata_index`)
zarr/checksums.json                         checksum manifest (see `checksums`)
zarr/<encoded key>/zarr.json                array, chunk shape = saved shard shape
zarr/<encoded key>/c.<i>.<j>...             one chunk per main-replica shard
zarr/<encoded key>/zarr.json                group (tensor saved as flattened ranges)
zarr/<encoded key>/<chunk idx>_<start>/     one 1-D fragment array per flattened shard
.partial-zarr/                              zarr/ while a save writes it (local disks)
```

Chunk keys: the zarr v3 ``default`` chunk key encoding with the separator ``.``
(`CHUNK_SEPARATOR`): a chunk file ``c.<i>.<j>`` beside its array's ``zarr.json``, so an array is
one directory. Checkpoints saved before used the separator ``/`` (``c/<i>/<j>``: a directory per
grid level, two or three directories per array); readers take the separator from each array's
``zarr.json``, as every zarr v3 reader does, so both load.

Attributes under ``"dist_ckpt"``: ``key``, ``dtype`` and ``layout`` on each tensor; for the
flattened layout also ``global_shape`` and ``chunk_shape``, and on each fragment its
``dtype``, ``global_offset`` and ``flat_range``.

Data types: an array's ``data_type`` is the tensor's dtype, except for the dtypes zarr-python 3
has no data type for (bfloat16 and the float8 types), which are stored as the unsigned integers
of their width holding the raw bits (``uint16``, ``uint8``) so that any zarr v3 reader opens
them; the ``dtype`` attribute names the tensor's dtype
(`stored_numpy_dtype()`). Readers take the dtype from the
attribute and view the bits, so checkpoints written with the zarr-extensions names
(``"data_type": "bfloat16"``) load as well.

Locations: every node is an `ObjectPath` under the
checkpoint's storage (`checkpoint_node()`), so one layout serves local directories and
``s3://`` checkpoints. The engines open arrays by local path where the storage has
``local_paths``, and through their own S3 clients where it is ``s3_compatible``.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, List, Sequence, Tuple, cast

from dist_ckpt.errors import IncompatibleStrategyError
from dist_ckpt.model.geometry import Box
from dist_ckpt.model.sharded import ShardedTensor
from dist_ckpt.storage import Storage, encode_key
from dist_ckpt.storage.location import LocationLike, resolve_location
from dist_ckpt.storage.object_path import ObjectPath

if TYPE_CHECKING:  # pragma: no cover
    from dist_ckpt.storage.s3 import S3Storage

__all__ = [
    "ATTR",
    "CHECKSUMS_FILENAME",
    "CHUNK_SEPARATOR",
    "FRAGMENT_CHUNK_ELEMENTS",
    "LAYOUT_CHUNKED",
    "LAYOUT_FLATTENED",
    "PARTIAL_ZARR_DIR",
    "ZARR_DIR",
    "checkpoint_node",
    "chunk_coords",
    "chunk_key",
    "fragment_chunk_elements",
    "fragment_name",
    "s3_storage",
    "tensor_dir",
    "tensor_dir_name",
]

ZARR_DIR = "zarr"
ATTR = "dist_ckpt"
LAYOUT_CHUNKED = "chunked"
LAYOUT_FLATTENED = "flattened"
#: fragments of flattened tensors are split into zarr chunks of at most this many elements, so a
#: load that needs part of a fragment reads a bounded amount more than it needs
FRAGMENT_CHUNK_ELEMENTS = 1 << 22
#: the chunk key separator of the arrays a save writes (zarr v3 ``default`` chunk key encoding):
#: chunk files ``c.<i>.<j>`` in the array's directory. With ``/`` (checkpoints saved before,
#: and zarr's default) every grid level is a directory, and a save created two or three
#: directories per array besides the array's own, at 0.25-0.6 ms of kernel time each on ext4
#: (issue 17: about 1,370 directories per save of 585 tensors)
CHUNK_SEPARATOR = "."
#: the checksum manifest of the zarr backend (see :mod:`.checksums`), beside the root group
CHECKSUMS_FILENAME = "checksums.json"
#: where a save writes ``zarr/`` on a local disk until every rank is done, renamed to ``zarr``
#: then (:func:`~dist_ckpt.backends.zarr.nodes.publish_written`): a save that fails or is killed
#: leaves no data under the names a checkpoint uses
PARTIAL_ZARR_DIR = ".partial-zarr"

Shape = Tuple[int, ...]


def checkpoint_node(location: LocationLike, engine: str) -> ObjectPath:
    """The checkpoint directory as a node: the root of its storage. The zarr engines reach a
    local directory by path (``local_paths``) and an object store through their own S3 clients
    (zarr-python through obstore, TensorStore through its ``s3`` driver), so the storage must have
    one or the other (``s3_compatible``).

    Raises:
        IncompatibleStrategyError: an object store the engines' clients cannot reach.

    Example:

    ```python
    root = checkpoint_node("s3://bucket/ckpt", "the zarr backend") / ZARR_DIR
    ```
    """
    storage = resolve_location(location)
    if not storage.local_paths and not storage.s3_compatible:
        raise IncompatibleStrategyError(
            f"{engine} reaches object stores through its own S3 client and cannot use {storage!r} "
            f"({storage.url}); use an s3:// location or a local path"
        )
    return ObjectPath(storage)


def s3_storage(node: ObjectPath) -> "S3Storage":
    """The S3 storage of a node on an object store (`checkpoint_node()` made sure it is one),
    whose ``obstore_store()`` and ``tensorstore_kvstore()`` hand the location to the engines."""
    storage: Storage = node.storage
    assert storage.s3_compatible, f"{storage!r} is not reachable by S3 clients"
    return cast("S3Storage", storage)


def fragment_chunk_elements(length: int) -> int:
    """Zarr chunk length of a fragment array of ``length`` elements."""
    return min(length, FRAGMENT_CHUNK_ELEMENTS)


def fragment_name(sh: ShardedTensor) -> str:
    """Directory name of a flattened shard's fragment array: ``<chunk index>_<flat start>``."""
    assert sh.flattened_range is not None
    chunk = ".".join(map(str, sh.local_chunk_offset_in_global()))
    return f"{chunk}_{sh.flattened_range.start}"


#: names a tensor directory must not take: the root group's metadata, and zarr's reserved prefix
_RESERVED = ("zarr.json", CHECKSUMS_FILENAME)


def tensor_dir_name(key: str) -> str:
    """Directory name (under ``zarr/``) of the tensor stored under ``key``.

    The encoded key, with its first character percent-encoded when the name would collide with
    the root group's ``zarr.json``, the checksum manifest ``checksums.json``, or start with
    zarr's reserved ``__``.
    """
    name = encode_key(key)
    if name in _RESERVED or name.startswith("__"):
        name = f"%{ord(name[0]):02X}{name[1:]}"
    return name


def tensor_dir(root: ObjectPath, key: str) -> ObjectPath:
    """Directory of the tensor stored under ``key``."""
    return root / tensor_dir_name(key)


def chunk_key(coords: Sequence[int], separator: str) -> str:
    """Path of a chunk under its array, for the ``default`` chunk key encoding with
    ``separator``: ``c.i.j`` (`CHUNK_SEPARATOR`, what a save writes) or ``c/i/j`` (older
    checkpoints); ``c`` for a 0-d array. A reader passes the separator its array's ``zarr.json``
    records (`dist_ckpt.backends.zarr.metadata.chunk_separator()`).

    Example:

    ```python
    chunk_key((0, 1), CHUNK_SEPARATOR)   # "c.0.1"
    chunk_key((0, 1), "/")               # "c/0/1"
    ```
    """
    return separator.join(["c", *map(str, coords)])


def chunk_coords(region: Box, chunk_shape: Sequence[int]) -> List[Shape]:
    """Grid coordinates of every chunk that ``region`` overlaps."""
    ranges = [range(o // c, (o + s - 1) // c + 1) for o, s, c in zip(region.offset, region.shape, chunk_shape)]
    return [tuple(c) for c in itertools.product(*ranges)]
