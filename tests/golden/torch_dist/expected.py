"""What the torch_dist golden checkpoints hold: a pure description, importable without mcore.

The directories beside this module were written by megatron-core's own
``dist_checkpointing.save`` (see ``make_fixtures.py`` and ``README.md``), so that dist_ckpt's
torch_dist backend is tested against what Megatron-Core really writes rather than against our
reading of its code. This module is the single source of truth for their content:
``make_fixtures.py`` builds every ShardedTensor, ShardedObject and common entry from it, and the
tests compare what they load with it, bit for bit, with no megatron-core installed.

Every tensor value comes from :func:`full_tensor`, an arange-based pure function of the key, the
global shape and the dtype whose values are exact in bfloat16 and float32. Every object value
comes from :func:`object_value`. Sharding is described in Megatron-Core's own terms
(:class:`Piece`: the ``rank_offsets`` that ``ShardedTensor.from_rank_offsets`` takes,
``prepend_axis_num``, ``replica_id``, ``flattened_range``), and the geometry that follows from it
(global offset, local shape, the DCP chunk that lands in ``.metadata``) is computed here by plain
functions, which ``make_fixtures.py`` checks against the ShardedTensors megatron-core builds.

Fixtures (each saved by ``world`` gloo ranks on CPU; all tensors listed are stored in full, so
``expected_tensors(name)`` is the whole content):

``tp2`` (megatron-core 0.16.1, world 2; TP=2, PP=1, DP=1; rank = tp_rank)
    One transformer layer with Megatron-Core GPT key names, H=8, FFN=16, vocab=16:

    - ``embedding.word_embeddings.weight`` bf16 [16, 8], vocab-split on axis 0, replica (0, 0, 0)
    - ``decoder.layers.0.input_layernorm.weight`` fp32 [8], replicated, replica (0, tp, 0)
    - ``decoder.layers.0.self_attention.linear_qkv.weight`` bf16 [24, 8], column-parallel (axis 0)
    - ``decoder.layers.0.self_attention.linear_qkv.bias`` bf16 [24], axis 0
    - ``decoder.layers.0.self_attention.linear_proj.weight`` bf16 [8, 8], row-parallel (axis 1)
    - ``decoder.layers.0.self_attention.linear_proj.bias`` bf16 [8], replicated, replica (0, tp, 0)
    - ``decoder.layers.0.mlp.linear_fc1.weight`` bf16 [16, 8], column-parallel (axis 0)
    - ``decoder.layers.0.mlp.linear_fc2.weight`` bf16 [8, 16], row-parallel (axis 1)
    - ``decoder.final_layernorm.weight`` fp32 [8], replicated, replica (0, tp, 0)
    - ``output_layer.weight`` fp32 [16, 8], vocab-split on axis 0

    ShardedObjects: ``rng_state`` global shape (1, 2), offset (0, tp), one per rank
    (DCP keys ``rng_state/shard_0.0_1.2`` and ``rng_state/shard_0.1_1.2``);
    ``decoder.layers.0.self_attention.linear_proj._extra_state`` (1,)/(0,), an ``io.BytesIO`` as
    Transformer Engine's extra state is, replica (0, tp, 0) so only rank 0 stores it.
    Common state: iteration 10, checkpoint_version 3.0, an ``args`` dict, and
    ``content_metadata`` (passed as ``save(..., content_metadata=...)``).

``pp2`` (megatron-core 0.16.1, world 2; PP=2, TP=1, DP=1; rank = pp_rank)
    Four layers stacked the way Megatron-Core stacks them: one global tensor per parameter with a
    leading layer axis, each local layer a ShardedTensor with ``prepend_axis_num=1`` and rank
    offsets ``(0, global_layer, 4)``; stage 0 holds layers 0-1 and the embedding, stage 1 layers
    2-3, the final layernorm and the output layer. All replica ids (0, 0, 0).

    - ``embedding.word_embeddings.weight`` bf16 [16, 8] (rank 0, whole)
    - ``decoder.layers.input_layernorm.weight`` fp32 [4, 8] (stacked)
    - ``decoder.layers.self_attention.linear_qkv.weight`` bf16 [4, 24, 8] (stacked)
    - ``decoder.layers.mlp.linear_fc1.weight`` bf16 [4, 16, 8] (stacked)
    - ``decoder.layers.mlp.linear_fc2.weight`` bf16 [4, 8, 16] (stacked)
    - ``decoder.final_layernorm.weight`` fp32 [8] (rank 1, whole)
    - ``output_layer.weight`` bf16 [16, 8] (rank 1, whole)

    ShardedObjects: ``rng_state`` (2, 1)/(pp, 0); the stacked
    ``decoder.layers.self_attention.linear_proj._extra_state`` (4,)/(layer,), one BytesIO per
    layer. Common: iteration 20, checkpoint_version 3.0, ``args`` dict.

``tp2pp2`` (megatron-core 0.16.1, world 4; TP=2 x PP=2; rank = pp_rank * 2 + tp_rank)
    Stacked layers that are also TP-split, so chunks are split on two axes:

    - ``embedding.word_embeddings.weight`` bf16 [16, 8], stage 0, vocab-split axis 0
    - ``decoder.layers.input_layernorm.weight`` fp32 [4, 8], stacked, replica (0, tp, 0)
    - ``decoder.layers.self_attention.linear_qkv.weight`` bf16 [4, 24, 8], stacked, TP axis 1
    - ``decoder.layers.self_attention.linear_proj.weight`` bf16 [4, 8, 8], stacked, TP axis 2
    - ``decoder.final_layernorm.weight`` fp32 [8], stage 1, replica (0, tp, 0)
    - ``output_layer.weight`` fp32 [16, 8], stage 1, vocab-split axis 0

    ShardedObjects: ``rng_state`` (2, 2)/(pp, tp), one per rank; stacked ``_extra_state``
    (4,)/(layer,), replica (0, tp, 0). Common: iteration 30 and ``args`` as an
    ``argparse.Namespace``, the way Megatron-LM's training loop stores it (``torch.load`` with
    ``weights_only=True`` refuses it unless ``argparse.Namespace`` is an allowed global).

``dist_opt`` (megatron-core 0.16.1, world 2; DP=2, TP=PP=1; rank = dp_rank)
    The distributed optimizer's ``dp_reshardable`` format, Megatron-Core 0.16's replacement for
    flattened ranges: each optimizer-state bucket is one 1-D tensor of ``numel_unpadded``
    elements, saved as several 1-D ShardedTensors per rank (one per parameter range and one per
    intra-bucket padding) with ``axis_fragmentations=None`` (irregular grid), arbitrary global
    offsets and uneven lengths. Bucket layout (world numel 176 = 2 x 88, unpadded 160):
    param A [0, 128), pad [128, 132), param B [132, 148), pad [148, 152), param C [152, 160);
    rank 0 holds [0, 88) (one piece), rank 1 holds [88, 128), [128, 132), [132, 148),
    [148, 152), [152, 160) (five pieces). Keys
    ``optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32)
    .bucket_idx_0.{param,exp_avg,exp_avg_sq}`` (one key each, no line break), fp32 [160],
    replica (0, 0, 0).
    Model weights ``decoder.layers.0.mlp.linear_fc1.weight`` bf16 [16, 8],
    ``decoder.layers.0.mlp.linear_fc1.bias`` bf16 [16] and
    ``decoder.layers.0.input_layernorm.weight`` bf16 [8], whole on both ranks with replica
    (0, 0, dp): only rank 0's copy is stored.
    ShardedObjects (1,)/(0,), replica (0, 0, dp), stored once:
    ``optimizer.distributed.dp_group_idx_0.per_bucket_numel``,
    ``...per_bucket_numel_unpadded`` and ``...optimizer`` (param_groups).
    Common: ``{"optimizer": {"param_state_sharding_type": "dp_reshardable"}, "iteration": 5}``.

``flat_legacy_mcore015`` (megatron-core 0.15.3, world 4; TP=2 x DP=2; rank = dp_rank * 2 + tp)
    Flattened ranges (``ShardedTensor.from_rank_offsets_flat``, the ``fully_sharded_model_space``
    distributed-optimizer format that megatron-core up to 0.15 writes and 0.16 can no longer
    build). Megatron stores an N-D flattened tensor of global shape [X, Y] and local chunk
    [x, y] as a DCP tensor of "reformulated" shape [X//x, Y//y, x*y] (see :func:`stored_shape`),
    and its ``.metadata`` is an ``MCoreMetadata`` (a megatron-core subclass of DCP's Metadata
    with ``mcore_data = {key: {"nd_reformulated_orig_global_shape": (X, Y)}}``).

    - model, replica (0, 0, dp): ``decoder.layers.0.mlp.linear_fc1.weight`` bf16 [16, 8] TP
      axis 0; ``decoder.layers.0.mlp.linear_fc1.bias`` bf16 [16] TP axis 0;
      ``decoder.layers.self_attention.linear_qkv.weight`` bf16 [2, 24, 8] stacked (2 layers on
      every rank), TP axis 1.
    - optimizer, ``optimizer.state.{fp32_param,exp_avg}.<model key>`` fp32 of the model shape,
      the TP-local chunk flattened and split over DP: fc1.weight chunk (64 elements) dp0
      [0, 40), dp1 [40, 64); fc1.bias chunk (8) dp0 [0, 3), dp1 [3, 8); qkv layer 0 chunk (96)
      dp0 [0, 96), layer 1 dp0 [0, 20), dp1 [20, 96). Replica (0, 0, 0).

    ShardedObjects: ``rng_state`` (1, 2)/(0, tp), replica dp. Common: iteration 7 and
    ``optimizer = {"param_state_sharding_type": "fully_sharded_model_space",
    "optimizer": {"param_groups": [...]}}``.

On-disk facts common to all (details in the engineer's notes, not in the repo): ``metadata.json``
is exactly ``{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend":
"torch", "common_backend_version": 1}``; ``common.pt`` is ``torch.save`` of the non-sharded
part; ShardedObjects live inside DCP as bytes entries keyed by their unique key
``<key>/shard_<offset>_<shape>`` (offset and shape dot-joined), each a ``torch.save`` of a
one-element list; tensors live in ``__<rank>_<n>.distcp`` as one ``torch.save`` per chunk.
"""

from __future__ import annotations

import argparse
import io
import math
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

ReplicaId = Union[int, Tuple[int, ...]]
RankOffset = Tuple[int, int, int]
"""Megatron's ``(axis, axis_rank_offset, axis_fragmentations)``; axes count prepended ones."""

BF16 = torch.bfloat16
FP32 = torch.float32

MCORE_VERSION = "0.16.1"
LEGACY_MCORE_VERSION = "0.15.3"
TORCH_VERSION = "2.13.0+cpu"

_DP_PREFIX = "optimizer.distributed.dp_group_idx_0"
_BUCKET_KEY = f"{_DP_PREFIX}.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0"


@dataclass(frozen=True)
class Piece:
    """One ShardedTensor that one rank passed to ``save``.

    Regular pieces give ``rank_offsets`` as ``ShardedTensor.from_rank_offsets`` takes them;
    irregular 1-D pieces (``dp_reshardable``) give ``offset`` and ``length`` instead and are
    built with ``axis_fragmentations=None``. ``flattened_range`` (start, stop) slices the
    flattened local chunk (``from_rank_offsets_flat``, megatron-core <= 0.15 only).
    """

    rank: int
    rank_offsets: Tuple[RankOffset, ...] = ()
    prepend_axis_num: int = 0
    replica_id: ReplicaId = 0
    flattened_range: Optional[Tuple[int, int]] = None
    offset: Optional[int] = None
    length: Optional[int] = None

    @property
    def regular(self) -> bool:
        """Whether the piece lies on a regular grid (``axis_fragmentations`` set)."""
        return self.offset is None

    @property
    def is_main_replica(self) -> bool:
        """Whether Megatron-Core stores this piece (replica id 0 or all zeros)."""
        rid = self.replica_id
        return rid == 0 if isinstance(rid, int) else all(r == 0 for r in rid)


@dataclass(frozen=True)
class TensorSpec:
    """One global tensor of a fixture and the pieces that ranks passed to ``save``."""

    key: str
    global_shape: Tuple[int, ...]
    dtype: torch.dtype
    pieces: Tuple[Piece, ...]


@dataclass(frozen=True)
class ObjectSpec:
    """One ShardedObject that one rank passed to ``save``."""

    key: str
    rank: int
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    @property
    def unique_key(self) -> str:
        """Megatron-Core's unique key, which is also the DCP key of the stored bytes."""
        off = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{off}_{shape}"

    @property
    def is_main_replica(self) -> bool:
        """Whether Megatron-Core stores this object."""
        rid = self.replica_id
        return rid == 0 if isinstance(rid, int) else all(r == 0 for r in rid)


@dataclass(frozen=True)
class Fixture:
    """One golden checkpoint: who saved what, with which megatron-core."""

    name: str
    world: int
    mcore_version: str
    tensors: Tuple[TensorSpec, ...]
    objects: Tuple[ObjectSpec, ...]
    content_metadata: Optional[Dict[str, Any]] = None


# ----------------------------------------------------------------------------- values


def full_tensor(key: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The whole global tensor ``key``: arange-based, distinct per key, exact in bf16 and fp32.

    Values are k/64 with integer |k| <= 127 for bf16 (8 significant bits suffice) and
    k/4 with |k| < 2**20 for fp32, so every platform computes the same bits.
    """
    n = math.prod(shape)
    seed = zlib.crc32(key.encode()) % 1009
    idx = torch.arange(n, dtype=torch.int64) + seed
    if dtype == BF16:
        vals = ((idx * 37) % 255 - 127).to(torch.float64) / 64.0
    else:
        vals = ((idx * 7919) % (1 << 20) - (1 << 19)).to(torch.float64) / 4.0
    return vals.to(dtype).reshape(shape)


def _rng_value(rank: int) -> List[Dict[str, Any]]:
    gen = torch.arange(16, dtype=torch.int64) * 13 + rank
    return [
        {
            "random_rng_state": (3, tuple(range(rank, rank + 8)), None),
            "torch_rng_state": (gen % 256).to(torch.uint8),
            "rng_tracker_states": {"model-parallel-rng": ((gen + 7) % 256).to(torch.uint8)},
        }
    ]


def object_value(name: str, spec: ObjectSpec) -> Any:
    """The value rank ``spec.rank`` passed for ShardedObject ``spec`` in fixture ``name``."""
    if spec.key == "rng_state":
        return _rng_value(spec.rank)
    if spec.key.endswith("._extra_state"):
        return io.BytesIO(f"extra_state {spec.unique_key}".encode())
    if spec.key == f"{_DP_PREFIX}.per_bucket_numel":
        return [{(BF16, FP32): [176]}]
    if spec.key == f"{_DP_PREFIX}.per_bucket_numel_unpadded":
        return [{(BF16, FP32): [160]}]
    if spec.key == f"{_DP_PREFIX}.optimizer":
        return {"param_groups": [_param_group()]}
    raise KeyError(f"no value for object {spec.key} in fixture {name}")


def _param_group() -> Dict[str, Any]:
    return {"lr": 0.0003, "betas": (0.9, 0.95), "eps": 1e-08, "weight_decay": 0.1, "params": [0, 1, 2], "step": 5}


def _args(name: str, tp: int, pp: int, dp: int) -> Dict[str, Any]:
    return {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "data_parallel_size": dp,
        "hidden_size": 8,
        "ffn_hidden_size": 16,
        "num_layers": 4 if pp > 1 else 1,
        "padded_vocab_size": 16,
        "bf16": True,
        "fixture": name,
    }


def expected_common(name: str) -> Dict[str, Any]:
    """What ``common.pt`` holds (``torch.load`` of it, content_metadata included)."""
    if name == "tp2":
        return {
            "iteration": 10,
            "checkpoint_version": 3.0,
            "args": _args(name, 2, 1, 1),
            "num_floating_point_operations_so_far": 123456789,
            "content_metadata": {"format": "golden-tp2", "distrib_optim_sharding_type": "dp_reshardable"},
        }
    if name == "pp2":
        return {"iteration": 20, "checkpoint_version": 3.0, "args": _args(name, 1, 2, 1)}
    if name == "tp2pp2":
        return {"iteration": 30, "checkpoint_version": 3.0, "args": argparse.Namespace(**_args(name, 2, 2, 1))}
    if name == "dist_opt":
        return {"optimizer": {"param_state_sharding_type": "dp_reshardable"}, "iteration": 5}
    if name == "flat_legacy_mcore015":
        return {
            "iteration": 7,
            "optimizer": {
                "param_state_sharding_type": "fully_sharded_model_space",
                "optimizer": {"param_groups": [_param_group()]},
            },
        }
    raise KeyError(f"unknown fixture {name}")


# ----------------------------------------------------------------------------- geometry


def local_shape(spec: TensorSpec, piece: Piece) -> Tuple[int, ...]:
    """The shape of the (non-flat) local chunk, prepended axes excluded."""
    if not piece.regular:
        assert piece.length is not None
        return (piece.length,)
    shape = list(spec.global_shape)
    for axis, _, fragm in piece.rank_offsets:
        shape[axis] = 1 if axis < piece.prepend_axis_num else spec.global_shape[axis] // fragm
    return tuple(shape[piece.prepend_axis_num :])


def global_offset(spec: TensorSpec, piece: Piece) -> Tuple[int, ...]:
    """Megatron's ``global_offset``: element offset of the local chunk, prepended axes included."""
    if not piece.regular:
        assert piece.offset is not None
        return (piece.offset,)
    loc = (1,) * piece.prepend_axis_num + local_shape(spec, piece)
    off = [0] * len(spec.global_shape)
    for axis, idx, _ in piece.rank_offsets:
        off[axis] = idx * loc[axis]
    return tuple(off)


def axis_fragmentations(spec: TensorSpec, piece: Piece) -> Optional[Tuple[int, ...]]:
    """Megatron's ``axis_fragmentations`` (None for irregular pieces)."""
    if not piece.regular:
        return None
    frag = [1] * len(spec.global_shape)
    for axis, _, fragm in piece.rank_offsets:
        frag[axis] = fragm
    return tuple(frag)


def global_slice(spec: TensorSpec, piece: Piece) -> Tuple[slice, ...]:
    """The slice of :func:`full_tensor` that the (non-flat) local chunk covers."""
    loc = (1,) * piece.prepend_axis_num + local_shape(spec, piece)
    return tuple(slice(o, o + n) for o, n in zip(global_offset(spec, piece), loc))


def local_data(spec: TensorSpec, piece: Piece) -> torch.Tensor:
    """The tensor the rank passed as ``ShardedTensor.data`` (flattened slice if flattened)."""
    whole = full_tensor(spec.key, spec.global_shape, spec.dtype)
    chunk = whole[global_slice(spec, piece)].reshape(local_shape(spec, piece))
    if piece.flattened_range is not None:
        start, stop = piece.flattened_range
        chunk = chunk.flatten()[start:stop]
    return chunk.clone()


def stored_shape(spec: TensorSpec) -> Tuple[int, ...]:
    """The global shape in DCP's ``.metadata``: reformulated for flattened tensors.

    Megatron-Core <= 0.15 saves a flattened tensor of global shape [X, Y] with local chunk
    [x, y] as [X//x, Y//y, x*y] (axis fragmentations, then the chunk's element count).
    """
    flat = [p for p in spec.pieces if p.flattened_range is not None]
    if not flat:
        return spec.global_shape
    frag = axis_fragmentations(spec, flat[0])
    assert frag is not None
    return frag + (math.prod(local_shape(spec, flat[0])),)


def dcp_chunks(spec: TensorSpec) -> List[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """``(offsets, sizes)`` of every chunk stored for ``spec`` (main replicas only), sorted."""
    chunks = []
    for piece in spec.pieces:
        if not piece.is_main_replica:
            continue
        if piece.flattened_range is not None:
            loc = local_shape(spec, piece)
            off = global_offset(spec, piece)
            chunk_idx = off[: piece.prepend_axis_num] + tuple(
                o // n for o, n in zip(off[piece.prepend_axis_num :], loc)
            )
            start, stop = piece.flattened_range
            chunks.append((chunk_idx + (start,), (1,) * len(chunk_idx) + (stop - start,)))
        else:
            size = (1,) * piece.prepend_axis_num + local_shape(spec, piece)
            chunks.append((global_offset(spec, piece), size))
    return sorted(chunks)


# ----------------------------------------------------------------------------- fixtures


Holders = Tuple[Tuple[int, int, Tuple[int, ...]], ...]
"""``(rank, tp_rank, global layers)`` for every rank that holds layers of a stacked tensor."""


def _tp_split(key: str, shape: Tuple[int, ...], dtype: torch.dtype, axis: int, ranks: Tuple[int, ...]) -> TensorSpec:
    """Split on ``axis`` over TP; ``ranks[tp]`` is the global rank of TP rank ``tp``."""
    tps = len(ranks)
    pieces = tuple(Piece(r, ((axis, tp, tps),), replica_id=(0, 0, 0)) for tp, r in enumerate(ranks))
    return TensorSpec(key, shape, dtype, pieces)


def _tp_replicated(key: str, shape: Tuple[int, ...], dtype: torch.dtype, ranks: Tuple[int, ...]) -> TensorSpec:
    """Whole on every TP rank, replica id (0, tp, 0): TP rank 0's copy is stored."""
    pieces = tuple(Piece(r, (), replica_id=(0, tp, 0)) for tp, r in enumerate(ranks))
    return TensorSpec(key, shape, dtype, pieces)


def _whole(key: str, shape: Tuple[int, ...], dtype: torch.dtype, rank: int) -> TensorSpec:
    return TensorSpec(key, shape, dtype, (Piece(rank, (), replica_id=(0, 0, 0)),))


def _stacked(
    key: str, shape: Tuple[int, ...], dtype: torch.dtype, holders: Holders, tps: int = 1, tp_axis: Optional[int] = None
) -> TensorSpec:
    """A layer-stacked tensor (leading layer axis prepended to each local layer's chunk).

    With ``tp_axis`` the layer is also split over ``tps`` TP ranks on that (global) axis;
    without it but with ``tps > 1`` it is replicated over TP with replica id (0, tp, 0).
    """
    pieces = []
    nlayers = shape[0]
    for rank, tp, layers in holders:
        for layer in layers:
            offs: Tuple[RankOffset, ...] = ((0, layer, nlayers),)
            replica: ReplicaId = (0, 0, 0)
            if tp_axis is not None:
                offs += ((tp_axis, tp, tps),)
            elif tps > 1:
                replica = (0, tp, 0)
            pieces.append(Piece(rank, offs, prepend_axis_num=1, replica_id=replica))
    return TensorSpec(key, shape, dtype, tuple(pieces))


_EXTRA = "decoder.layers.self_attention.linear_proj._extra_state"


def _tp2() -> Fixture:
    ranks = (0, 1)
    l0 = "decoder.layers.0."
    tensors = (
        _tp_split("embedding.word_embeddings.weight", (16, 8), BF16, 0, ranks),
        _tp_replicated(l0 + "input_layernorm.weight", (8,), FP32, ranks),
        _tp_split(l0 + "self_attention.linear_qkv.weight", (24, 8), BF16, 0, ranks),
        _tp_split(l0 + "self_attention.linear_qkv.bias", (24,), BF16, 0, ranks),
        _tp_split(l0 + "self_attention.linear_proj.weight", (8, 8), BF16, 1, ranks),
        _tp_replicated(l0 + "self_attention.linear_proj.bias", (8,), BF16, ranks),
        _tp_split(l0 + "mlp.linear_fc1.weight", (16, 8), BF16, 0, ranks),
        _tp_split(l0 + "mlp.linear_fc2.weight", (8, 16), BF16, 1, ranks),
        _tp_replicated("decoder.final_layernorm.weight", (8,), FP32, ranks),
        _tp_split("output_layer.weight", (16, 8), FP32, 0, ranks),
    )
    extra = l0 + "self_attention.linear_proj._extra_state"
    objects = tuple(ObjectSpec("rng_state", tp, (1, 2), (0, tp)) for tp in ranks) + tuple(
        ObjectSpec(extra, tp, (1,), (0,), (0, tp, 0)) for tp in ranks
    )
    content = expected_common("tp2")["content_metadata"]
    return Fixture("tp2", 2, MCORE_VERSION, tensors, objects, content_metadata=content)


def _pp2() -> Fixture:
    holders: Holders = ((0, 0, (0, 1)), (1, 0, (2, 3)))
    tensors = (
        _whole("embedding.word_embeddings.weight", (16, 8), BF16, 0),
        _stacked("decoder.layers.input_layernorm.weight", (4, 8), FP32, holders),
        _stacked("decoder.layers.self_attention.linear_qkv.weight", (4, 24, 8), BF16, holders),
        _stacked("decoder.layers.mlp.linear_fc1.weight", (4, 16, 8), BF16, holders),
        _stacked("decoder.layers.mlp.linear_fc2.weight", (4, 8, 16), BF16, holders),
        _whole("decoder.final_layernorm.weight", (8,), FP32, 1),
        _whole("output_layer.weight", (16, 8), BF16, 1),
    )
    objects = tuple(ObjectSpec("rng_state", pp, (2, 1), (pp, 0)) for pp in range(2)) + tuple(
        ObjectSpec(_EXTRA, layer // 2, (4,), (layer,), (0, 0, 0)) for layer in range(4)
    )
    return Fixture("pp2", 2, MCORE_VERSION, tensors, objects)


def _tp2pp2() -> Fixture:
    # global rank = pp * 2 + tp; stage pp holds layers 2 * pp and 2 * pp + 1
    holders: Holders = tuple((pp * 2 + tp, tp, (2 * pp, 2 * pp + 1)) for pp in range(2) for tp in range(2))
    first, last = (0, 1), (2, 3)
    qkv, proj = "linear_qkv.weight", "linear_proj.weight"
    attn = "decoder.layers.self_attention."
    tensors = (
        _tp_split("embedding.word_embeddings.weight", (16, 8), BF16, 0, first),
        _stacked("decoder.layers.input_layernorm.weight", (4, 8), FP32, holders, tps=2),
        _stacked(attn + qkv, (4, 24, 8), BF16, holders, tps=2, tp_axis=1),
        _stacked(attn + proj, (4, 8, 8), BF16, holders, tps=2, tp_axis=2),
        _tp_replicated("decoder.final_layernorm.weight", (8,), FP32, last),
        _tp_split("output_layer.weight", (16, 8), FP32, 0, last),
    )
    objects = tuple(
        ObjectSpec("rng_state", pp * 2 + tp, (2, 2), (pp, tp)) for pp in range(2) for tp in range(2)
    ) + tuple(
        ObjectSpec(_EXTRA, (layer // 2) * 2 + tp, (4,), (layer,), (0, tp, 0)) for layer in range(4) for tp in range(2)
    )
    return Fixture("tp2pp2", 4, MCORE_VERSION, tensors, objects)


# (rank, offset, length) of every piece of the dp_reshardable bucket; see the module docstring.
DIST_OPT_BUCKET_PIECES: Tuple[Tuple[int, int, int], ...] = (
    (0, 0, 88),
    (1, 88, 40),
    (1, 128, 4),
    (1, 132, 16),
    (1, 148, 4),
    (1, 152, 8),
)


def _dist_opt() -> Fixture:
    bucket = tuple(
        TensorSpec(
            f"{_BUCKET_KEY}.{state}",
            (160,),
            FP32,
            tuple(Piece(rank, replica_id=(0, 0, 0), offset=off, length=n) for rank, off, n in DIST_OPT_BUCKET_PIECES),
        )
        for state in ("param", "exp_avg", "exp_avg_sq")
    )
    model = tuple(
        TensorSpec(key, shape, BF16, tuple(Piece(dp, (), replica_id=(0, 0, dp)) for dp in range(2)))
        for key, shape in (
            ("decoder.layers.0.mlp.linear_fc1.weight", (16, 8)),
            ("decoder.layers.0.mlp.linear_fc1.bias", (16,)),
            ("decoder.layers.0.input_layernorm.weight", (8,)),
        )
    )
    objects = tuple(
        ObjectSpec(f"{_DP_PREFIX}.{name}", dp, (1,), (0,), (0, 0, dp))
        for name in ("optimizer", "per_bucket_numel", "per_bucket_numel_unpadded")
        for dp in range(2)
    )
    return Fixture("dist_opt", 2, MCORE_VERSION, model + bucket, objects)


def _flat_legacy() -> Fixture:
    fc1w, fc1b = "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc1.bias"
    qkv = "decoder.layers.self_attention.linear_qkv.weight"

    def model(key: str, shape: Tuple[int, ...], stacked: bool) -> TensorSpec:
        pieces = []
        for dp in range(2):
            for tp in range(2):
                if stacked:
                    for layer in range(2):
                        offs = ((0, layer, 2), (1, tp, 2))
                        pieces.append(Piece(dp * 2 + tp, offs, 1, (0, 0, dp)))
                else:
                    pieces.append(Piece(dp * 2 + tp, ((0, tp, 2),), 0, (0, 0, dp)))
        return TensorSpec(key, shape, BF16, tuple(pieces))

    # (layer or None, dp, start, stop) of each flattened range of the TP-local chunk
    ranges: Dict[str, Tuple[Tuple[Optional[int], int, int, int], ...]] = {
        fc1w: ((None, 0, 0, 40), (None, 1, 40, 64)),
        fc1b: ((None, 0, 0, 3), (None, 1, 3, 8)),
        qkv: ((0, 0, 0, 96), (1, 0, 0, 20), (1, 1, 20, 96)),
    }
    shapes = {fc1w: (16, 8), fc1b: (16,), qkv: (2, 24, 8)}
    tensors = [model(fc1w, shapes[fc1w], False), model(fc1b, shapes[fc1b], False), model(qkv, shapes[qkv], True)]
    for state in ("fp32_param", "exp_avg"):
        for key in (fc1w, fc1b, qkv):
            pieces = []
            for tp in range(2):
                for layer, dp, start, stop in ranges[key]:
                    if layer is None:
                        offs: Tuple[RankOffset, ...] = ((0, tp, 2),)
                        prepend = 0
                    else:
                        offs, prepend = ((0, layer, 2), (1, tp, 2)), 1
                    pieces.append(Piece(dp * 2 + tp, offs, prepend, (0, 0, 0), flattened_range=(start, stop)))
            tensors.append(TensorSpec(f"optimizer.state.{state}.{key}", shapes[key], FP32, tuple(pieces)))
    objects = tuple(ObjectSpec("rng_state", dp * 2 + tp, (1, 2), (0, tp), dp) for dp in range(2) for tp in range(2))
    return Fixture("flat_legacy_mcore015", 4, LEGACY_MCORE_VERSION, tuple(tensors), objects)


FIXTURES: Dict[str, Fixture] = {f.name: f for f in (_tp2(), _pp2(), _tp2pp2(), _dist_opt(), _flat_legacy())}
"""Every golden torch_dist fixture by directory name."""


def expected_tensors(name: str) -> Dict[str, torch.Tensor]:
    """Every tensor fixture ``name`` stores, whole (logical global shape), by ShardedTensor key."""
    return {t.key: full_tensor(t.key, t.global_shape, t.dtype) for t in FIXTURES[name].tensors}


def expected_objects(name: str) -> Dict[str, Any]:
    """Every stored ShardedObject value (main replicas only) by unique key."""
    return {o.unique_key: object_value(name, o) for o in FIXTURES[name].objects if o.is_main_replica}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t``, so that NaN payloads and -0.0 compare exactly."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(actual: Any, expected: Any, where: str = "") -> None:
    """Raise AssertionError unless ``actual`` equals ``expected`` exactly.

    Tensors must match in dtype, shape and bits; ``io.BytesIO`` by content; Namespaces by their
    attributes; containers recursively. ``where`` prefixes the message with the path compared.
    """
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"{where}: expected a tensor, got {type(actual).__name__}")
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            got = f"{actual.dtype}{list(actual.shape)}"
            raise AssertionError(f"{where}: {got} != {expected.dtype}{list(expected.shape)}")
        if not torch.equal(_bits(actual), _bits(expected)):
            raise AssertionError(f"{where}: values differ")
        return
    if isinstance(expected, io.BytesIO):
        if not isinstance(actual, io.BytesIO) or actual.getvalue() != expected.getvalue():
            raise AssertionError(f"{where}: BytesIO content differs: {actual!r}")
        return
    if isinstance(expected, argparse.Namespace):
        if not isinstance(actual, argparse.Namespace):
            raise AssertionError(f"{where}: expected a Namespace, got {type(actual).__name__}")
        assert_same(vars(actual), vars(expected), where)
        return
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(actual) != set(expected):
            keys = sorted(map(str, actual)) if isinstance(actual, dict) else type(actual).__name__
            raise AssertionError(f"{where}: keys {keys} != {sorted(map(str, expected))}")
        for k in expected:
            assert_same(actual[k], expected[k], f"{where}/{k}")
        return
    if isinstance(expected, (list, tuple)):
        if type(actual) is not type(expected) or len(actual) != len(expected):
            raise AssertionError(f"{where}: {actual!r} != {expected!r}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
        return
    if type(actual) is not type(expected) or actual != expected:
        raise AssertionError(f"{where}: {actual!r} != {expected!r}")
