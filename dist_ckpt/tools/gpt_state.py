"""A GPT-like sharded state (model + distributed-optimizer Adam) that any rank can regenerate.

Used by the demo and the benchmarks. Every value is a pure function of (seed, key, global element
index), computed with integer arithmetic only, so any rank can compute the expected content of any
slice without communication and compare loaded tensors bit-exactly.

The model is sharded with tensor parallelism (embedding split on the vocabulary, column- and
row-parallel projections, replicated layernorms) with layers stacked on a prepended axis; the
Adam state (``exp_avg``, ``exp_avg_sq``) is flattened distributed-optimizer style: each rank's
local parameter chunks are concatenated and the buffer is split evenly over data-parallel ranks.
"""

from __future__ import annotations

import functools
import math
import os
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from dist_ckpt.model.sharded import ShardedObject, ShardedStateDict, ShardedTensor, StateDict

MODEL_DTYPE = torch.bfloat16
OPTIMIZER_DTYPE = torch.float32
OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")
RNG_KEY = "rng_state"
_MASK32 = 0xFFFFFFFF
_HASH_MULT = 0x45D9F3B  # < 2**27: products of 32-bit values stay far below int64 overflow
MAX_REPORTED = 20

Index = Tuple[Union[int, slice], ...]


# --------------------------------------------------------------------------- model description


@dataclass(frozen=True)
class DemoConfig:
    """Shape of the GPT-like model; every rank derives the same state from it.

    Attributes:
        hidden: hidden size (a multiple of the tensor-parallel size of every layout used).
        layers: number of transformer layers, stacked along a prepended axis in the checkpoint.
        vocab: vocabulary size (also a multiple of the tensor-parallel size).
        seed: all values are a function of the seed, the key and the element index.
        step: iteration number saved in the common state.
    """

    hidden: int
    layers: int = 4
    vocab: int = 8000
    seed: int = 1234
    step: int = 1000

    @classmethod
    def for_size(cls, target_bytes: int, tp_multiple: int, layers: int = 4, seed: int = 1234) -> "DemoConfig":
        """The config whose full state (model + Adam moments) is closest to ``target_bytes``.

        ``hidden`` and ``vocab`` are rounded to multiples of ``tp_multiple`` so that every
        tensor-parallel split is even.
        """
        vocab = _round_up(8000, tp_multiple)
        per_param = MODEL_DTYPE.itemsize + len(OPTIMIZER_STATES) * OPTIMIZER_DTYPE.itemsize
        # params(h) = 12 L h^2 + (vocab + 13 L + 2) h: solve params(h) * per_param = target
        a, b = 12 * layers, vocab + 13 * layers + 2
        h = (-b + math.sqrt(b * b + 4 * a * target_bytes / per_param)) / (2 * a)
        hidden = max(tp_multiple, int(round(h / tp_multiple)) * tp_multiple)
        return cls(hidden=hidden, layers=layers, vocab=vocab, seed=seed)


@dataclass(frozen=True)
class ParamSpec:
    """One model parameter: its per-layer shape and how tensor parallelism splits it.

    Attributes:
        key: checkpoint key.
        shape: global shape of one layer's tensor (without the stacked layer axis).
        tp_axis: axis split over tensor-parallel ranks, or None if replicated on all of them.
        stacked: one tensor per layer, stacked along a prepended layer axis.
    """

    key: str
    shape: Tuple[int, ...]
    tp_axis: Optional[int]
    stacked: bool

    def global_shape(self, cfg: DemoConfig) -> Tuple[int, ...]:
        return ((cfg.layers,) if self.stacked else ()) + self.shape


def param_specs(cfg: DemoConfig) -> List[ParamSpec]:
    """The GPT-like parameter list: Megatron-style column/row-parallel linears, replicated norms."""
    h, f = cfg.hidden, 4 * cfg.hidden
    layer = "decoder.layers."
    return [
        ParamSpec("embedding.word_embeddings.weight", (cfg.vocab, h), 0, False),
        ParamSpec(layer + "input_layernorm.weight", (h,), None, True),
        ParamSpec(layer + "input_layernorm.bias", (h,), None, True),
        ParamSpec(layer + "self_attention.linear_qkv.weight", (3 * h, h), 0, True),  # column parallel
        ParamSpec(layer + "self_attention.linear_qkv.bias", (3 * h,), 0, True),
        ParamSpec(layer + "self_attention.linear_proj.weight", (h, h), 1, True),  # row parallel
        ParamSpec(layer + "self_attention.linear_proj.bias", (h,), None, True),
        ParamSpec(layer + "pre_mlp_layernorm.weight", (h,), None, True),
        ParamSpec(layer + "pre_mlp_layernorm.bias", (h,), None, True),
        ParamSpec(layer + "mlp.linear_fc1.weight", (f, h), 0, True),  # column parallel
        ParamSpec(layer + "mlp.linear_fc1.bias", (f,), 0, True),
        ParamSpec(layer + "mlp.linear_fc2.weight", (h, f), 1, True),  # row parallel
        ParamSpec(layer + "mlp.linear_fc2.bias", (h,), None, True),
        ParamSpec("decoder.final_layernorm.weight", (h,), None, False),
        ParamSpec("decoder.final_layernorm.bias", (h,), None, False),
    ]


def optimizer_key(state: str, param_key: str) -> str:
    """Checkpoint key of an Adam moment (Megatron-Core's naming)."""
    return f"optimizer.state.{state}.{param_key}"


def state_bytes(cfg: DemoConfig) -> int:
    """Bytes of the whole state, each tensor counted once (model + Adam moments)."""
    numel = sum(math.prod(p.global_shape(cfg)) for p in param_specs(cfg))
    return numel * (MODEL_DTYPE.itemsize + len(OPTIMIZER_STATES) * OPTIMIZER_DTYPE.itemsize)


@dataclass(frozen=True)
class Layout:
    """A tensor-parallel x data-parallel layout; global rank = dp_rank * tp + tp_rank."""

    tp: int
    dp: int

    def coords(self, rank: int) -> Tuple[int, int]:
        """``(tp_rank, dp_rank)`` of a global rank."""
        return rank % self.tp, rank // self.tp

    def __str__(self) -> str:
        return f"TP={self.tp} DP={self.dp}"


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# --------------------------------------------------------------------------- deterministic values


def _key_seed(key: str, seed: int) -> int:
    return (zlib.crc32(key.encode("utf-8")) ^ (seed * 0x9E3779B1)) & _MASK32


def _global_indices(global_shape: Sequence[int], index: Index) -> torch.Tensor:
    """Row-major linear indices (int64) of ``global[index]``; int entries drop their axis."""
    strides = [math.prod(global_shape[i + 1 :]) for i in range(len(global_shape))]
    flat = torch.zeros((), dtype=torch.int64)
    for ix, stride in zip(index, strides):
        if isinstance(ix, int):
            flat = flat + ix * stride
        else:
            flat = flat.unsqueeze(-1) + torch.arange(ix.start, ix.stop, dtype=torch.int64) * stride
    return flat


def synthetic_values(
    key: str, seed: int, global_shape: Sequence[int], index: Index, dtype: torch.dtype
) -> torch.Tensor:
    """``global[index]`` of the synthetic tensor ``key``: a hash of each element's global index.

    Integer-only arithmetic (no overflow, no float rounding differences between vectorized and
    scalar code), so the same element has the same bits whichever slice computes it.
    """
    x = (_global_indices(global_shape, index) + _key_seed(key, seed)) & _MASK32
    for _ in range(2):
        x = ((x >> 16) ^ x) * _HASH_MULT & _MASK32
    x = (x >> 16) ^ x
    values = ((x >> 8) & 0xFFFFFF).to(torch.float32) * 2.0**-23 - 1.0  # uniform in [-1, 1)
    return values.to(dtype)


def expected_values(sh: ShardedTensor, seed: int) -> torch.Tensor:
    """What ``sh.data`` must hold: its slice (or flattened range) of the synthetic tensor."""
    values = synthetic_values(sh.key, seed, sh.global_shape, sh.global_slice(), sh.dtype)
    if sh.flattened_range is not None:
        values = values.reshape(-1)[sh.flattened_range]
    return values


def expected_rng_state(seed: int, rank: int) -> torch.Tensor:
    """The ShardedObject of ``rank``: a real torch CPU generator state, seeded per rank."""
    return torch.Generator().manual_seed(seed + rank).get_state()


def common_state(cfg: DemoConfig) -> StateDict:
    """Non-sharded objects, identical on every rank (saved once, by rank 0)."""
    return {
        "step": cfg.step,
        "config": asdict(cfg),
        "optimizer": {"param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}]},
    }


# --------------------------------------------------------------------------- sharded state dicts


def _model_shard(spec: ParamSpec, cfg: DemoConfig, layout: Layout, rank: int, layer: Optional[int]) -> ShardedTensor:
    tp_rank, dp_rank = layout.coords(rank)
    local_shape = list(spec.shape)
    offsets: List[Tuple[int, int, int]] = []
    prepend = 0
    if layer is not None:
        offsets.append((0, layer, cfg.layers))
        prepend = 1
    if spec.tp_axis is not None:
        local_shape[spec.tp_axis] //= layout.tp
        offsets.append((spec.tp_axis + prepend, tp_rank, layout.tp))
    # replicated over TP: only tp_rank 0 holds the main replica; always replicated over DP
    replica_id = (0 if spec.tp_axis is not None else tp_rank, dp_rank)
    data = torch.empty(local_shape, dtype=MODEL_DTYPE)
    return ShardedTensor.from_rank_offsets(spec.key, data, *offsets, replica_id=replica_id, prepend_axis_num=prepend)


def model_shards(cfg: DemoConfig, layout: Layout, rank: int) -> List[ShardedTensor]:
    """This rank's parameter chunks (data allocated, not filled), in a fixed order."""
    shards = []
    for spec in param_specs(cfg):
        for layer in range(cfg.layers) if spec.stacked else [None]:
            shards.append(_model_shard(spec, cfg, layout, rank, layer))
    return shards


def dp_flat_ranges(numels: Sequence[int], dp: int, dp_rank: int) -> List[Optional[slice]]:
    """Distributed-optimizer split: each chunk's part of data-parallel rank ``dp_rank``'s range.

    The chunks are concatenated into one flat buffer, the buffer is cut into ``dp`` equal parts
    (the last one shorter), and each chunk gets the intersection of its span with part
    ``dp_rank``, relative to the chunk (None if empty).
    """
    total = sum(numels)
    part = -(-total // dp) if total else 0
    lo, hi = dp_rank * part, min(total, (dp_rank + 1) * part)
    ranges: List[Optional[slice]] = []
    start = 0
    for n in numels:
        a, b = max(lo, start), min(hi, start + n)
        ranges.append(slice(a - start, b - start) if b > a else None)
        start += n
    return ranges


def optimizer_shards(model: Sequence[ShardedTensor], layout: Layout, rank: int) -> Dict[str, List[ShardedTensor]]:
    """Adam moments of this rank's part of the flat buffer, as flattened ShardedTensors."""
    tp_rank, dp_rank = layout.coords(rank)
    ranges = dp_flat_ranges([math.prod(sh.local_shape) for sh in model], layout.dp, dp_rank)
    out: Dict[str, List[ShardedTensor]] = {state: [] for state in OPTIMIZER_STATES}
    for sh, rng in zip(model, ranges):
        if rng is None:
            continue
        grid = zip(sh.global_offset, sh.full_local_shape, sh.global_shape)
        offsets = [(axis, off // n, glob // n) for axis, (off, n, glob) in enumerate(grid) if glob != n]
        # DP ranks hold disjoint ranges, so only the TP replication of a parameter carries over
        replica_id = (sh.replica_id[0] if isinstance(sh.replica_id, tuple) else 0, 0)
        for state in OPTIMIZER_STATES:
            out[state].append(
                ShardedTensor.from_rank_offsets_flat(
                    optimizer_key(state, sh.key),
                    torch.empty(rng.stop - rng.start, dtype=OPTIMIZER_DTYPE),
                    sh.local_shape,
                    *offsets,
                    flattened_range=rng,
                    replica_id=replica_id,
                    prepend_axis_num=sh.prepend_axis_num,
                )
            )
    return out


def build_sharded_state_dict(cfg: DemoConfig, layout: Layout, rank: int, fill: bool) -> ShardedStateDict:
    """This rank's sharded state dict in ``layout``; with ``fill`` its tensors hold the values.

    Without ``fill`` the tensors are allocated but uninitialized: a load request.
    """
    model = model_shards(cfg, layout, rank)
    optimizer = optimizer_shards(model, layout, rank)
    world = layout.tp * layout.dp
    sd: ShardedStateDict = common_state(cfg)
    sd["model"] = _group_by_key(model)
    sd["optimizer"]["state"] = {state: _group_by_key(shards) for state, shards in optimizer.items()}
    rng = expected_rng_state(cfg.seed, rank) if fill else None
    sd[RNG_KEY] = ShardedObject(RNG_KEY, rng, (world,), (rank,), replica_id=0)
    if fill:
        for sh in sharded_tensors(sd):
            assert sh.data is not None
            sh.data.copy_(expected_values(sh, cfg.seed))
    return sd


def full_load_request(cfg: DemoConfig, saved_world: int) -> ShardedStateDict:
    """A single-process request for every tensor whole (TP=1, nothing flattened) and every object.

    The common values are included as plain leaves: load ignores them, verification checks them.
    """
    sd: ShardedStateDict = common_state(cfg)
    sd["model"] = {}
    sd["optimizer"]["state"] = {s: {} for s in OPTIMIZER_STATES}
    for spec in param_specs(cfg):
        shape = spec.global_shape(cfg)
        param = torch.empty(shape, dtype=MODEL_DTYPE)
        sd["model"][spec.key] = ShardedTensor.from_rank_offsets(spec.key, param)
        for state in OPTIMIZER_STATES:
            key = optimizer_key(state, spec.key)
            sd["optimizer"]["state"][state][spec.key] = ShardedTensor.from_rank_offsets(
                key, torch.empty(shape, dtype=OPTIMIZER_DTYPE)
            )
    sd[RNG_KEY] = [ShardedObject(RNG_KEY, None, (saved_world,), (r,)) for r in range(saved_world)]
    return sd


def _group_by_key(shards: Sequence[ShardedTensor]) -> Dict[str, Union[ShardedTensor, List[ShardedTensor]]]:
    """``{key: shard}``, or ``{key: [one shard per layer]}`` for stacked parameters."""
    grouped: Dict[str, List[ShardedTensor]] = {}
    for sh in shards:
        grouped.setdefault(sh.key, []).append(sh)
    return {k: v if v[0].prepend_axis_num else v[0] for k, v in grouped.items()}


def _leaves(tree: Any, path: Tuple[Any, ...] = ()) -> Iterator[Tuple[Tuple[Any, ...], Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, path + (i,))
    else:
        yield path, tree


def sharded_tensors(sd: ShardedStateDict) -> Iterator[ShardedTensor]:
    return (leaf for _, leaf in _leaves(sd) if isinstance(leaf, ShardedTensor))


# --------------------------------------------------------------------------- verification


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def _lookup(tree: Any, path: Tuple[Any, ...]) -> Any:
    return functools.reduce(lambda node, part: node[part], path, tree)


def _compare_tensor(where: str, sh: ShardedTensor, got: Any, seed: int) -> Optional[str]:
    if not isinstance(got, torch.Tensor):
        return f"{where}: expected a tensor, got {type(got).__name__}"
    want = expected_values(sh, seed)
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{where}: expected {want.dtype} {tuple(want.shape)}, got {got.dtype} {tuple(got.shape)}"
    differ = int((_bits(got) != _bits(want)).sum())
    if differ:
        flat = sh.flattened_range
        rng = "" if flat is None else f", flat range {flat.start}:{flat.stop}"
        return f"{where} (offset {sh.global_offset}{rng}): {differ} of {want.numel()} elements differ"
    return None


def verify_loaded(request: ShardedStateDict, loaded: StateDict, cfg: DemoConfig) -> Tuple[int, List[str]]:
    """Compare every loaded value with what was saved, bit for bit.

    Returns:
        ``(number of values checked, descriptions of the mismatches)``.
    """
    problems: List[str] = []
    checked = 0
    for path, leaf in _leaves(request):
        where = "/".join(map(str, path))
        try:
            got = _lookup(loaded, path)
        except (KeyError, IndexError, TypeError):
            problems.append(f"{where}: missing from the loaded state dict")
            continue
        checked += 1
        problem: Optional[str] = None
        if isinstance(leaf, ShardedTensor):
            problem = _compare_tensor(where, leaf, got, cfg.seed)
        elif isinstance(leaf, ShardedObject):
            want = expected_rng_state(cfg.seed, leaf.global_offset[0])
            if not (isinstance(got, torch.Tensor) and torch.equal(got, want)):
                problem = f"{where}: ShardedObject {leaf.unique_key} differs from the saved one"
        elif got != _lookup(common_state(cfg), path):
            problem = f"{where}: common value {got!r} differs from the saved one"
        if problem:
            problems.append(problem)
    return checked, problems


# --------------------------------------------------------------------------- files and page cache


def evict_page_cache(path: Union[str, Path]) -> int:
    """Drop every file under ``path`` from the page cache, so the next read hits the disk.

    Each file is fsynced first (only clean pages can be dropped). Returns the number of files.
    """
    count = 0
    for file in _files(Path(path)):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        count += 1
    return count


def checkpoint_files(path: Union[str, Path]) -> Tuple[int, int]:
    """``(number of files, total bytes)`` under ``path``."""
    files = list(_files(Path(path)))
    return len(files), sum(f.stat().st_size for f in files)


def _files(root: Path) -> Iterator[Path]:
    for dirpath, _, names in os.walk(root):
        for name in names:
            yield Path(dirpath) / name
