"""One table of the tensor dtypes dist_ckpt stores, zero-copy torch <-> numpy views, and the
alignment (`TENSOR_ALIGN`) at which tensor data can be viewed in place.

Every backend names dtypes with the stable strings of this table (``"bfloat16"``,
``"float8_e4m3fn"``), so a checkpoint never depends on ``repr(torch.dtype)``. numpy has no
bfloat16 or float8 types; ``ml_dtypes`` provides them with the same bit layout, which lets a CPU
tensor of any stored dtype be viewed as a numpy array without copying. ``ml_dtypes`` takes about a
second to import, so it is imported when such a dtype's numpy type is first needed, not with
dist_ckpt.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import torch

from dist_ckpt.errors import CheckpointingException


@dataclass(frozen=True)
class DTypeInfo:
    """How one torch dtype is named and viewed by the storage formats."""

    name: str  # stable name, used in metadata and as the zarr v3 data_type
    torch_dtype: torch.dtype
    # numpy's name of the type (``"float32"``), or ``"ml_dtypes.<name>"`` for one numpy lacks
    numpy_type: str
    safetensors_name: str
    # integer torch dtype of the same width, used to view dtypes numpy cannot hold
    bits_dtype: Optional[torch.dtype] = None

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy (or ml_dtypes) dtype with the same bits, importing ml_dtypes on first use."""
        return _numpy_dtype(self.numpy_type)


@functools.lru_cache(maxsize=None)
def _numpy_dtype(numpy_type: str) -> np.dtype:
    module, _, name = numpy_type.rpartition(".")
    if not module:
        return np.dtype(name)
    # an ml_dtypes release without this type (float8_e8m0fnu is recent): its bytes as uint8
    return np.dtype(getattr(importlib.import_module(module), name, np.uint8))


def _info(name: str, numpy_type: str, st_name: str, bits: Optional[torch.dtype] = None) -> Optional[DTypeInfo]:
    torch_dtype = getattr(torch, name, None)
    if not isinstance(torch_dtype, torch.dtype):
        return None  # this torch build does not have the dtype
    return DTypeInfo(name, torch_dtype, numpy_type, st_name, bits)


_CANDIDATES = [
    _info("float64", "float64", "F64"),
    _info("float32", "float32", "F32"),
    _info("float16", "float16", "F16"),
    _info("bfloat16", "ml_dtypes.bfloat16", "BF16", torch.int16),
    _info("float8_e4m3fn", "ml_dtypes.float8_e4m3fn", "F8_E4M3", torch.uint8),
    _info("float8_e5m2", "ml_dtypes.float8_e5m2", "F8_E5M2", torch.uint8),
    _info("float8_e4m3fnuz", "ml_dtypes.float8_e4m3fnuz", "F8_E4M3FNUZ", torch.uint8),
    _info("float8_e5m2fnuz", "ml_dtypes.float8_e5m2fnuz", "F8_E5M2FNUZ", torch.uint8),
    _info("float8_e8m0fnu", "ml_dtypes.float8_e8m0fnu", "F8_E8M0", torch.uint8),
    _info("complex128", "complex128", "C128"),
    _info("complex64", "complex64", "C64"),
    _info("int64", "int64", "I64"),
    _info("int32", "int32", "I32"),
    _info("int16", "int16", "I16"),
    _info("int8", "int8", "I8"),
    _info("uint64", "uint64", "U64"),
    _info("uint32", "uint32", "U32"),
    _info("uint16", "uint16", "U16"),
    _info("uint8", "uint8", "U8"),
    _info("bool", "bool", "BOOL"),
]

_BY_NAME: Dict[str, DTypeInfo] = {i.name: i for i in _CANDIDATES if i is not None}
_BY_TORCH: Dict[torch.dtype, DTypeInfo] = {i.torch_dtype: i for i in _BY_NAME.values()}
_BY_SAFETENSORS: Dict[str, DTypeInfo] = {i.safetensors_name: i for i in _BY_NAME.values()}

#: The names of every dtype this installation can store.
SUPPORTED_DTYPE_NAMES = tuple(_BY_NAME)

#: bytes: tensor data that starts at a multiple of this (in a buffer, or in a file's data
#: section) can be viewed in place as any dtype and starts on a cache line (on the test VM,
#: copies to offsets 40 bytes past a cache line ran 30% slower)
TENSOR_ALIGN = 64


def align_up(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of `TENSOR_ALIGN`: where the next tensor's data may
    start after ``nbytes`` bytes."""
    return -(-nbytes // TENSOR_ALIGN) * TENSOR_ALIGN


def dtype_info(dtype: torch.dtype) -> DTypeInfo:
    """Return the table entry of a torch dtype, or raise naming the supported ones."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise CheckpointingException(
            f"dtype {dtype} cannot be stored; supported dtypes: {', '.join(SUPPORTED_DTYPE_NAMES)}"
        ) from None


def dtype_to_name(dtype: torch.dtype) -> str:
    """Stable storage name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return dtype_info(dtype).name


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of `dtype_to_name()`; raises for names this torch build does not know."""
    try:
        return _BY_NAME[name].torch_dtype
    except KeyError:
        raise CheckpointingException(
            f"unknown stored dtype {name!r}; this installation reads: {', '.join(SUPPORTED_DTYPE_NAMES)}"
        ) from None


def dtype_from_safetensors_name(name: str) -> torch.dtype:
    """Torch dtype of a safetensors header dtype string (``"BF16"`` -> ``torch.bfloat16``)."""
    try:
        return _BY_SAFETENSORS[name].torch_dtype
    except KeyError:
        raise CheckpointingException(f"unknown safetensors dtype {name!r}") from None


def tensor_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """View a CPU tensor as a numpy array of the same bits, without copying.

    The tensor must live on the CPU; it may be non-contiguous (the view keeps its strides).
    """
    info = dtype_info(tensor.dtype)
    tensor = tensor.detach()
    if info.bits_dtype is None:
        return tensor.numpy()
    return tensor.view(info.bits_dtype).numpy().view(info.numpy_dtype)


def numpy_to_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """View a numpy array holding ``dtype``'s bits as a torch tensor, without copying."""
    info = dtype_info(dtype)
    if not array.flags.writeable:
        array = array.copy()  # torch.from_numpy does not support read-only memory
    if info.bits_dtype is None:
        return torch.from_numpy(array.view(info.numpy_dtype))
    bits_np = np.dtype(np.int16) if info.bits_dtype == torch.int16 else np.dtype(np.uint8)
    return torch.from_numpy(array.view(bits_np)).view(dtype)


def numpy_dtype_of(dtype: torch.dtype) -> np.dtype:
    """numpy (or ml_dtypes) dtype with the same bits as ``dtype``."""
    return dtype_info(dtype).numpy_dtype
