"""zarr-python data types for bfloat16 and float8, which zarr-python 3 does not ship, to read
checkpoints that stored them under their zarr-extensions names.

dist_ckpt now writes these tensors as raw bits in ``uint16`` / ``uint8`` arrays, which every zarr
v3 reader opens (`dist_ckpt.backends.zarr.nodes.stored_numpy_dtype()`); checkpoints written
before that name them ``"bfloat16"``, ``"float8_e4m3fn"``, ... (the zarr-extensions registry, which
TensorStore reads natively). The zarr-python load strategy registers the names on first use,
never at import of dist_ckpt, and leaves alone any name zarr-python already knows (a later zarr
release may ship its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Tuple

import ml_dtypes
import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.npy.float import BaseFloat

_EXTENSION_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
_registered = False


def _make_float_dtype(name: str, np_dtype: np.dtype) -> type:
    @dataclass(frozen=True, kw_only=True)
    class ExtensionFloat(BaseFloat):  # type: ignore[type-arg]
        dtype_cls = type(np_dtype)
        _zarr_v3_name = name
        _zarr_v2_names: ClassVar[Tuple[str, ...]] = ()

        @property
        def item_size(self) -> int:
            return int(np_dtype.itemsize)

    ExtensionFloat.__name__ = ExtensionFloat.__qualname__ = f"ZarrExtension_{name}"
    return ExtensionFloat


def register_extension_dtypes() -> None:
    """Teach zarr-python the ml_dtypes floats dist_ckpt stores (idempotent)."""
    global _registered
    if _registered:
        return
    known: Any = getattr(data_type_registry, "contents", {})
    for name in _EXTENSION_FLOATS:
        if name in known or not hasattr(ml_dtypes, name):
            continue
        data_type_registry.register(name, _make_float_dtype(name, np.dtype(getattr(ml_dtypes, name))))
    _registered = True
