"""The benchmark suite's state: a GPT-like model in fp32 with Adam moments, tensor-parallel.

Torch-only on purpose: the same module builds the state in dist_ckpt's environment and in
Megatron-Core's virtualenv (``/opt/mcore-venv``), so every system saves and loads the same
tensors. Every parameter is one tensor per layer (as Megatron-Core's non-stacked state dicts and
training jobs hold them), split over TP ranks Megatron-style (column-parallel linears on axis 0,
row-parallel on axis 1, norms and row-parallel biases replicated); the Adam moments
(``optimizer.state.exp_avg.<key>``, ``...exp_avg_sq.<key>``) have their parameter's shape and
sharding.

Values are a pure function of (key, global row, global column) -- a per-row fp32 value plus a
per-column one, each drawn once per key from a seeded generator -- so any layout computes the
expected content of any slice in one broadcast add, and a loaded tensor is checked bit-exactly.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

DTYPE = torch.float32
MOMENTS = ("exp_avg", "exp_avg_sq")
SEED = 1234


@dataclass(frozen=True)
class Spec:
    """One checkpoint tensor: its global shape, and the axis TP splits (None: replicated)."""

    key: str
    shape: Tuple[int, ...]
    tp_axis: Optional[int]


@dataclass(frozen=True)
class Shard:
    """One rank's piece of a tensor: its global offset, local shape, the rank's coordinate on the
    split axis, and whether this rank holds the main replica (writes it)."""

    spec: Spec
    offset: Tuple[int, ...]
    local_shape: Tuple[int, ...]
    tp_rank: int
    tp: int
    main: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.local_shape) * DTYPE.itemsize


@dataclass(frozen=True)
class Model:
    """Sizes of the GPT-like model."""

    hidden: int
    layers: int
    vocab: int

    @classmethod
    def for_size(cls, target_bytes: int, layers: int = 16, vocab: int = 32000, multiple: int = 4) -> "Model":
        """The model whose parameters and two Adam moments (fp32) come closest to ``target_bytes``;
        ``hidden`` and ``vocab`` are multiples of ``multiple`` (every TP size used divides them)."""
        per_param = DTYPE.itemsize * (1 + len(MOMENTS))
        vocab = -(-vocab // multiple) * multiple
        a, b = 12 * layers, vocab + 13 * layers + 2  # params(h) = 12 L h^2 + (vocab + 13 L + 2) h
        h = (-b + math.sqrt(b * b + 4 * a * target_bytes / per_param)) / (2 * a)
        return cls(max(multiple, int(round(h / multiple)) * multiple), layers, vocab)

    def specs(self) -> List[Spec]:
        """Every checkpoint tensor (parameters, then their moments)."""
        h, f = self.hidden, 4 * self.hidden
        params = [Spec("embedding.word_embeddings.weight", (self.vocab, h), 0)]
        for i in range(self.layers):
            p = f"decoder.layers.{i}."
            params += [
                Spec(p + "input_layernorm.weight", (h,), None),
                Spec(p + "input_layernorm.bias", (h,), None),
                Spec(p + "self_attention.linear_qkv.weight", (3 * h, h), 0),
                Spec(p + "self_attention.linear_qkv.bias", (3 * h,), 0),
                Spec(p + "self_attention.linear_proj.weight", (h, h), 1),
                Spec(p + "self_attention.linear_proj.bias", (h,), None),
                Spec(p + "pre_mlp_layernorm.weight", (h,), None),
                Spec(p + "pre_mlp_layernorm.bias", (h,), None),
                Spec(p + "mlp.linear_fc1.weight", (f, h), 0),
                Spec(p + "mlp.linear_fc1.bias", (f,), 0),
                Spec(p + "mlp.linear_fc2.weight", (h, f), 1),
                Spec(p + "mlp.linear_fc2.bias", (h,), None),
            ]
        params += [Spec("decoder.final_layernorm.weight", (h,), None), Spec("decoder.final_layernorm.bias", (h,), None)]
        moments = [Spec(f"optimizer.state.{m}.{s.key}", s.shape, s.tp_axis) for m in MOMENTS for s in params]
        return params + moments

    def nbytes(self) -> int:
        """Bytes of the whole state, each tensor once."""
        return sum(math.prod(s.shape) for s in self.specs()) * DTYPE.itemsize


def shards(model: Model, tp: int, rank: int) -> List[Shard]:
    """Rank ``rank``'s pieces in a TP=``tp`` layout (one piece per tensor)."""
    out = []
    for spec in model.specs():
        shape, offset = list(spec.shape), [0] * len(spec.shape)
        if spec.tp_axis is not None:
            shape[spec.tp_axis] //= tp
            offset[spec.tp_axis] = rank * shape[spec.tp_axis]
        main = spec.tp_axis is not None or rank == 0
        out.append(Shard(spec, tuple(offset), tuple(shape), rank if spec.tp_axis is not None else 0, tp, main))
    return out


def _pattern(key: str, n: int, salt: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed((zlib.crc32(key.encode()) * 2654435761 + SEED + salt) & 0xFFFFFFFF)
    return torch.rand(n, generator=gen, dtype=torch.float32)


def expected(shard: Shard) -> torch.Tensor:
    """The values ``shard`` holds: row value + column value of its global slice."""
    shape = shard.spec.shape
    if len(shape) == 1:
        rows, cols = torch.zeros(1), _pattern(shard.spec.key, shape[0], 1)
        r0, c0 = 0, shard.offset[0]
        nr, nc = 1, shard.local_shape[0]
    else:
        rows, cols = _pattern(shard.spec.key, shape[0], 0), _pattern(shard.spec.key, shape[1], 1)
        r0, c0 = shard.offset
        nr, nc = shard.local_shape
    out = rows[r0 : r0 + nr, None] + cols[None, c0 : c0 + nc]
    return out.reshape(shard.local_shape).to(DTYPE)


def fill(pieces: Sequence[Shard]) -> Dict[str, torch.Tensor]:
    """Tensors holding the expected values of ``pieces``, by key."""
    return {p.spec.key: expected(p) for p in pieces}


def zeros(pieces: Sequence[Shard]) -> Dict[str, torch.Tensor]:
    """Allocated and touched tensors (a live model's parameters) to load into, by key."""
    return {p.spec.key: torch.zeros(p.local_shape, dtype=DTYPE) for p in pieces}


def mismatches(pieces: Sequence[Shard], tensors: Dict[str, torch.Tensor]) -> List[str]:
    """Keys whose tensor differs bit-wise from its expected values."""
    bad = []
    for p in pieces:
        got = tensors[p.spec.key]
        if not torch.equal(got.contiguous().view(torch.int32), expected(p).view(torch.int32)):
            bad.append(p.spec.key)
    return bad
