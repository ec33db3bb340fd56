"""Unit tests of dist_ckpt.model.dtypes: the stored-dtype table and zero-copy torch <-> numpy views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dist_ckpt.errors import CheckpointingException
from dist_ckpt.model.dtypes import (
    SUPPORTED_DTYPE_NAMES,
    TENSOR_ALIGN,
    align_up,
    dtype_from_name,
    dtype_from_safetensors_name,
    dtype_info,
    dtype_to_name,
    numpy_dtype_of,
    numpy_to_tensor,
    tensor_to_numpy,
)
from dist_ckpt.testing.layouts import bits
from dist_ckpt.testing.layouts import random_bits_tensor as random_tensor

ALL = [getattr(torch, n) for n in SUPPORTED_DTYPE_NAMES]


def test_table_is_consistent():
    assert len(set(SUPPORTED_DTYPE_NAMES)) == len(SUPPORTED_DTYPE_NAMES)
    for name in ("float32", "bfloat16", "float16", "int64", "bool", "float8_e4m3fn", "float8_e5m2"):
        assert name in SUPPORTED_DTYPE_NAMES


@pytest.mark.parametrize("dtype", ALL, ids=SUPPORTED_DTYPE_NAMES)
class TestEveryDtype:
    def test_name_round_trip(self, dtype):
        name = dtype_to_name(dtype)
        assert name == str(dtype).rsplit(".", 1)[-1]
        assert dtype_from_name(name) == dtype

    def test_info(self, dtype):
        info = dtype_info(dtype)
        assert info.torch_dtype == dtype
        assert numpy_dtype_of(dtype).itemsize == torch.empty(0, dtype=dtype).element_size()
        assert dtype_from_safetensors_name(info.safetensors_name) == dtype

    def test_numpy_round_trip_is_bit_exact(self, dtype):
        t = random_tensor(dtype, (3, 5))
        arr = tensor_to_numpy(t)
        assert arr.shape == (3, 5)
        assert arr.dtype == numpy_dtype_of(dtype)
        back = numpy_to_tensor(arr, dtype)
        assert back.dtype == dtype and back.shape == t.shape
        assert torch.equal(bits(back), bits(t))

    def test_tensor_to_numpy_is_a_view(self, dtype):
        t = random_tensor(dtype, (4,))
        arr = tensor_to_numpy(t)
        arr.view(np.uint8)[:] = 1  # write through the numpy view
        assert torch.equal(bits(t), torch.ones(t.numel() * t.element_size(), dtype=torch.uint8))

    def test_numpy_to_tensor_is_a_view(self, dtype):
        arr = np.zeros(6, dtype=numpy_dtype_of(dtype))
        t = numpy_to_tensor(arr, dtype)
        arr.view(np.uint8)[:] = 1
        assert torch.equal(bits(t), torch.ones(arr.nbytes, dtype=torch.uint8))

    def test_non_contiguous(self, dtype):
        t = random_tensor(dtype, (4, 6))[:, ::2]
        arr = tensor_to_numpy(t)
        assert torch.equal(bits(numpy_to_tensor(np.ascontiguousarray(arr), dtype)), bits(t))

    def test_zero_d(self, dtype):
        t = random_tensor(dtype, ())
        back = numpy_to_tensor(tensor_to_numpy(t), dtype)
        assert back.shape == () and torch.equal(bits(back), bits(t))


def test_read_only_array_is_copied():
    arr = np.arange(4, dtype=np.float32)
    arr.flags.writeable = False
    t = numpy_to_tensor(arr, torch.float32)
    assert torch.equal(t, torch.arange(4, dtype=torch.float32))
    t[0] = 7  # must not fail and must not touch the read-only array
    assert arr[0] == 0


def test_bfloat16_values_survive():
    t = torch.tensor([1.5, -2.25, 3e38, float("inf")], dtype=torch.bfloat16)
    arr = tensor_to_numpy(t)
    np.testing.assert_array_equal(arr.astype(np.float32), t.float().numpy())


@pytest.mark.parametrize("dtype", [torch.complex32, torch.quint8, torch.qint8])
def test_unsupported_dtype_is_named(dtype):
    if not isinstance(dtype, torch.dtype):
        pytest.skip("dtype missing in this torch build")
    with pytest.raises(CheckpointingException, match=str(dtype).replace(".", r"\.")):
        dtype_to_name(dtype)
    with pytest.raises(CheckpointingException, match="float32"):  # lists the supported ones
        dtype_info(dtype)


def test_unknown_names():
    with pytest.raises(CheckpointingException, match="'float128'"):
        dtype_from_name("float128")
    with pytest.raises(CheckpointingException, match="'Q8'"):
        dtype_from_safetensors_name("Q8")


def test_safetensors_names():
    assert dtype_from_safetensors_name("BF16") == torch.bfloat16
    assert dtype_from_safetensors_name("F32") == torch.float32
    assert dtype_from_safetensors_name("F8_E4M3") == torch.float8_e4m3fn
    assert dtype_from_safetensors_name("BOOL") == torch.bool


def test_align_up_gives_offsets_every_dtype_can_be_viewed_at():
    sizes = (0, 1, TENSOR_ALIGN, TENSOR_ALIGN + 1)
    assert [align_up(n) for n in sizes] == [0, TENSOR_ALIGN, TENSOR_ALIGN, 2 * TENSOR_ALIGN]
    buffer = torch.zeros(4 * TENSOR_ALIGN, dtype=torch.uint8)
    offset = align_up(3)
    for dtype in (torch.float64, torch.int64, torch.bfloat16, torch.float32):
        assert buffer[offset : offset + 8].view(dtype).numel() == 8 // dtype.itemsize
