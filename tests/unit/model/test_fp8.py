"""FP8 tensors in a state dict (Megatron-Core's is_float8tensor, force_all_tensors_to_non_fp8)."""

from typing import Any

import pytest
import torch

from dist_ckpt.model.fp8 import dequantize_float8, force_all_tensors_to_non_fp8, is_float8tensor
from dist_ckpt.model.sharded import ShardedTensor


class Float8Tensor(torch.Tensor):
    """Stands for Transformer Engine's class: same name and module, a nominal dtype, dequantize()."""

    __module__ = "transformer_engine.pytorch.float8_tensor"

    @staticmethod
    def __new__(cls, values: torch.Tensor) -> "Float8Tensor":
        out = torch.Tensor._make_subclass(cls, values)
        out.values = values.clone()
        return out

    def dequantize(self) -> torch.Tensor:
        return self.values * 2


class Float8TensorLookalike(torch.Tensor):
    """Same name, another library: not Transformer Engine's."""


Float8TensorLookalike.__name__ = "Float8Tensor"


def test_is_float8tensor_recognises_transformer_engine_only() -> None:
    assert is_float8tensor(Float8Tensor(torch.ones(2)))
    assert not is_float8tensor(torch.ones(2))
    assert not is_float8tensor(torch.Tensor._make_subclass(Float8TensorLookalike, torch.ones(2)))
    assert not is_float8tensor("not a tensor")
    if hasattr(torch, "float8_e4m3fn"):
        assert not is_float8tensor(torch.ones(2, dtype=torch.float8_e4m3fn))


def test_force_non_fp8_dequantizes_float8tensor_leaves_and_keeps_the_rest() -> None:
    plain = torch.arange(3.0)
    st = ShardedTensor.from_rank_offsets("w", Float8Tensor(torch.ones(4)))
    other = ShardedTensor.from_rank_offsets("b", plain)
    sd: Any = {"w": st, "nested": [{"b": other}], "step": 7}
    force_all_tensors_to_non_fp8(sd)
    assert type(st.data) is torch.Tensor and torch.equal(st.data, torch.full((4,), 2.0))
    assert st.dtype == torch.float32
    assert other.data is plain and sd["step"] == 7


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8 dtypes")
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_force_non_fp8_makes_plain_float8_exact_float32(name: str) -> None:
    dtype = getattr(torch, name)
    values = torch.tensor([0.5, -2.0, 3.0, 0.0]).to(dtype)
    st = ShardedTensor.from_rank_offsets("w", values)
    force_all_tensors_to_non_fp8({"w": st})
    assert st.data.dtype == torch.float32 and st.dtype == torch.float32
    assert torch.equal(st.data, torch.tensor([0.5, -2.0, 3.0, 0.0]))
    st.validate_data()  # data and metadata agree


def test_dequantize_float8_returns_other_tensors_as_is() -> None:
    t = torch.ones(2, dtype=torch.bfloat16)
    assert dequantize_float8(t) is t
