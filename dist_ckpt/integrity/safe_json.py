"""The one JSON reader for checkpoint metadata: bounded, and failing only with our error.

Every metadata file of a checkpoint (``metadata.json``, the safetensors ``index.json`` and file
headers, zarr's ``zarr.json``, checksum manifests, HuggingFace indexes) is untrusted input: a
damaged or hostile file must end in a [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError] that
names the file, never in a ``RecursionError``, a ``UnicodeDecodeError``, a ``KeyError`` from a
parser that trusted a field, or an allocation sized by a number read from the file.

`loads()` and `read_json()` parse with a size cap (checked before reading a local file
whole), a nesting-depth cap (checked on the raw bytes before parsing, in C-speed passes, so
``json`` never recurses deeply), strict UTF-8 and no ``NaN``/``Infinity``. The ``want_*``
helpers check the type of one field and name it in the error; `check_tensor_bytes()`
refuses shapes whose byte size overflows before anything is allocated from them; `shown()`
renders a value for a message with bounded length and depth.

Example:

```python
doc = want_object(loads(raw, "ckpt/safetensors/index.json"), "ckpt/safetensors/index.json")
shape = want_ints(doc.get("global_shape"), "index.json, tensor 'w', field 'global_shape'")
check_tensor_bytes(shape, 4, "index.json, tensor 'w'")
```
"""

from __future__ import annotations

import json
import math
import os
import re
import reprlib
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from dist_ckpt.errors import CorruptCheckpointError

__all__ = [
    "MAX_DEPTH",
    "MAX_JSON_BYTES",
    "MAX_SMALL_JSON_BYTES",
    "MAX_TENSOR_BYTES",
    "check_tensor_bytes",
    "json_depth",
    "loads",
    "read_json",
    "shown",
    "want_int",
    "want_ints",
    "want_list",
    "want_object",
    "want_str",
    "want_str_map",
]

#: deepest nesting any metadata document of dist_ckpt (or of a HuggingFace folder) needs is
#: about 6 levels; 64 leaves room for extensions and stays far below Python's recursion limit
MAX_DEPTH = 64
#: cap on large metadata (a safetensors index or a checksum manifest of a huge checkpoint)
MAX_JSON_BYTES = 1 << 30
#: cap on small metadata (metadata.json, zarr.json, a HuggingFace config)
MAX_SMALL_JSON_BYTES = 16 << 20
#: no tensor holds more bytes than an int64 counts (torch's own limit: "Storage size
#: calculation overflowed")
MAX_TENSOR_BYTES = (1 << 63) - 1

_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPENING = np.frombuffer(b"[{", dtype=np.uint8)
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel = 3
_SHOWN.maxstring = 60
_SHOWN.maxother = 60
_SHOWN.maxlist = _SHOWN.maxdict = _SHOWN.maxtuple = 6
_SHOWN.maxlong = 40


def shown(value: Any) -> str:
    """``repr(value)`` cut to a bounded length and depth, for error messages.

    Example:

    ```python
    shown(list(range(1000)))   # "[0, 1, 2, 3, 4, 5, ...]"
    ```
    """
    return _SHOWN.repr(value)


def json_depth(raw: bytes) -> int:
    """Deepest nesting of arrays and objects in the JSON text ``raw`` (an upper bound for
    malformed text); brackets inside strings do not count.

    Example:

    ```python
    json_depth(b'{"a": [[1], "]]"]}')   # 3
    ```
    """
    brackets = np.frombuffer(_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    if not brackets.size:
        return 0
    steps = np.where(np.isin(brackets, _OPENING), 1, -1)
    return max(0, int(np.cumsum(steps).max()))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads(raw: Union[bytes, bytearray, memoryview], where: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse the JSON document ``raw`` read from ``where`` (a path or URL, named in errors).

    Raises:
        CorruptCheckpointError: larger than ``max_bytes``, nested deeper than `MAX_DEPTH`,
            not UTF-8, or not JSON (``NaN`` and ``Infinity`` included).

    Example:

    ```python
    loads(b'{"version": 2}', "ckpt/safetensors/index.json")   # {"version": 2}
    ```
    """
    data = bytes(raw)
    if len(data) > max_bytes:
        raise CorruptCheckpointError(
            f"{where} has {len(data)} bytes, more than the {max_bytes} a metadata file of this kind may have "
            "(damaged, or not a dist_ckpt file)"
        )
    # a document cannot be deeper than its number of opening brackets: most need no scan
    depth = 0 if data.count(b"[") + data.count(b"{") <= MAX_DEPTH else json_depth(data)
    if depth > MAX_DEPTH:
        raise CorruptCheckpointError(f"{where} nests {depth} levels deep, more than {MAX_DEPTH}: it is damaged")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptCheckpointError(f"{where} is not valid JSON: not UTF-8 text ({e}); it is damaged") from e
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; so are huge ints
        raise CorruptCheckpointError(f"{where} is not valid JSON ({e}): it is damaged") from e


def read_json(path: Union[str, "os.PathLike[str]"], max_bytes: int = MAX_JSON_BYTES) -> Optional[Any]:
    """The parsed JSON file at ``path``, or None if there is no such file; the size is checked
    (``os.stat``) before the file is read.

    Raises:
        CorruptCheckpointError: as `loads()`, or the path is not a regular file.

    Example:

    ```python
    doc = read_json("ckpt/zarr/w/zarr.json", MAX_SMALL_JSON_BYTES)
    ```
    """
    where = str(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise CorruptCheckpointError(
                    f"{where} has {size} bytes, more than the {max_bytes} a metadata file of this kind may have "
                    "(damaged, or not a dist_ckpt file)"
                )
            raw = f.read(max_bytes + 1)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError:
        raise CorruptCheckpointError(
            f"{where} is a directory, expected a JSON file: the checkpoint is damaged"
        ) from None
    return loads(raw, where, max_bytes)


def want_object(value: Any, where: str) -> Dict[str, Any]:
    """``value`` if it is a JSON object, else [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError] naming
    ``where``."""
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{where} must be a JSON object, found {shown(value)}")
    return value


def want_list(value: Any, where: str) -> List[Any]:
    """``value`` if it is a JSON array, else [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError] naming
    ``where``."""
    if not isinstance(value, list):
        raise CorruptCheckpointError(f"{where} must be a JSON array, found {shown(value)}")
    return value


def want_str(value: Any, where: str) -> str:
    """``value`` if it is a string, else [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError] naming
    ``where``."""
    if not isinstance(value, str):
        raise CorruptCheckpointError(f"{where} must be a string, found {shown(value)}")
    return value


def want_int(value: Any, where: str, minimum: int = 0, maximum: int = MAX_TENSOR_BYTES) -> int:
    """``value`` if it is an int (not a bool) in ``[minimum, maximum]``, else
    [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError] naming ``where``."""
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise CorruptCheckpointError(f"{where} must be an int in [{minimum}, {maximum}], found {shown(value)}")
    return value


def want_ints(value: Any, where: str, length: Optional[int] = None, minimum: int = 0) -> Tuple[int, ...]:
    """``value`` as a tuple if it is a list (of ``length`` items, when given) of ints in
    ``[minimum, MAX_TENSOR_BYTES]``, else [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError] naming
    ``where``."""
    if (
        not isinstance(value, list)
        or (length is not None and len(value) != length)
        or not all(isinstance(v, int) and not isinstance(v, bool) and minimum <= v <= MAX_TENSOR_BYTES for v in value)
    ):
        size = "" if length is None else f" of length {length}"
        raise CorruptCheckpointError(f"{where} must be a list{size} of ints >= {minimum}, found {shown(value)}")
    return tuple(value)


def want_str_map(value: Any, where: str) -> Dict[str, str]:
    """``value`` if it is a JSON object of strings, else
    [`CorruptCheckpointError`][dist_ckpt.errors.CorruptCheckpointError]."""
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise CorruptCheckpointError(f"{where} must map strings to strings, found {shown(value)}")
    return value


def check_tensor_bytes(shape: Sequence[int], itemsize: int, where: str) -> int:
    """The byte size of a tensor of ``shape`` and ``itemsize``; refuses sizes no tensor can have.

    Call it on shapes read from a checkpoint before allocating (even on the meta device: torch
    raises "Storage size calculation overflowed" for them).

    Example:

    ```python
    check_tensor_bytes((1024, 512), 2, "index.json, tensor 'w'")   # 1048576
    ```
    """
    nbytes = math.prod(shape) * itemsize
    if nbytes > MAX_TENSOR_BYTES:
        raise CorruptCheckpointError(
            f"{where}: shape {shown(list(shape))} of {itemsize}-byte elements would need {nbytes} bytes, more than "
            "any tensor can hold: the metadata is damaged"
        )
    return nbytes
