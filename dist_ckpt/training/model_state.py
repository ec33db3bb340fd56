"""A module and its optimizer as one sharded state dict keyed by parameter names.

torch.optim numbers parameters by position (``state[0]``, ``param_groups[0]["params"] ==
[0, 1, ...]``), which depends on how the optimizer was built, not on the model. Here every
entry is keyed by the parameter's fully qualified name (FQN, as in ``model.named_parameters()``),
so a checkpoint is independent of the layout -- world size, FSDP2 sharding or none -- and of the
order of parameters in the optimizer.

Names are canonical (`dist_ckpt.model.module_names`), as ``torch.distributed.checkpoint``'s
``get_state_dict`` makes them: the ``module.`` of DDP, the ``_orig_mod.`` of ``torch.compile``,
the ``_fsdp_wrapped_module.`` of FSDP1 and the ``_checkpoint_wrapped_module.`` of activation
checkpointing are left out, so a checkpoint of a wrapped model loads into the plain one and the
reverse. Checkpoints that store wrapped names (written before names were canonical) load too. An
FSDP1 model is loaded through its ``load_state_dict`` (its ``state_dict()`` holds copies); its
optimizer state (flattened per-rank shards) is refused: use FSDP2's ``fully_shard``.

Key scheme (checkpoint keys of ShardedTensors; ``<fqn>`` is e.g. ``layers.0.attn.weight``):

* ``model.<key>`` -- every entry ``<key>`` of ``model.state_dict()`` (parameters and persistent
  buffers), sharded like the live tensor (see `dist_ckpt.training.dtensor_shards`).
* ``optim.state.<fqn>.<name>`` -- every optimizer state tensor with at least one dim
  (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ``max_exp_avg_sq``), sharded like its
  parameter when it is a DTensor, else replicated.

The common state (saved once, by rank 0; readable with ``torch.load(weights_only=True)``):

```text
{"format": {"name": "dist_ckpt.model_state", "version": 1},
 "optim": {"class": "AdamW",
           "param_groups": [{"lr": ..., "betas": ..., ..., "params": [fqn, ...]}, ...],
           "tensor_state": {fqn: ["exp_avg", "exp_avg_sq"]},
           "state": {fqn: {"step": tensor(12.)}}}}
```

``state`` holds the per-parameter scalars (0-d tensors such as ``step``, Python numbers); they
are equal on every rank. ``param_groups`` carry every hyperparameter and list their parameters by
FQN, so on load each live group takes the hyperparameters of the saved group that held its
parameters. The optimizer part is absent when no optimizer was saved.

Loading is strict: a model entry or optimizer parameter missing from the checkpoint, or present
in the checkpoint but not in the model/optimizer, is a [`KeyMismatchError`][dist_ckpt.errors.KeyMismatchError];
a global shape that differs is a [`LoadMismatchError`][dist_ckpt.errors.LoadMismatchError]. A stored dtype
that differs from the live one is cast, like ``torch.nn.Module.load_state_dict``.

Example:

```python
sd = model_optim_state_dict(model, optim)    # for dc.save
plan = plan_model_load(model, tensors_metadata, "ckpt")
```
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, TypedDict

import torch

from dist_ckpt.collectives.distributed import get_rank
from dist_ckpt.errors import (
    CheckpointingException,
    KeyMismatchError,
    LoadMismatchError,
    NotACheckpointError,
    format_keys,
    with_article,
)
from dist_ckpt.model.module_names import ModuleNames, canonical_state_dict, has_fsdp1, match_stored_names
from dist_ckpt.model.sharded import ShardedStateDict, ShardedTensor
from dist_ckpt.training.dtensor_shards import is_dtensor, local_tensor, to_sharded_tensor
from dist_ckpt.training.load_targets import LoadTarget, make_target

logger = logging.getLogger(__name__)

FORMAT = {"name": "dist_ckpt.model_state", "version": 1}
MODEL_PREFIX = "model."
OPTIM_STATE_PREFIX = "optim.state."

__all__ = [
    "FORMAT",
    "MODEL_PREFIX",
    "ModelEntries",
    "OPTIM_STATE_PREFIX",
    "OptimLoadPlan",
    "OptimStateDict",
    "model_key",
    "model_entries",
    "model_optim_state_dict",
    "optim_key",
    "param_fqns",
    "plan_model_load",
    "plan_optim_load",
    "unsharded_optim_state",
]


class OptimStateDict(TypedDict):
    """A ``torch.optim`` style state dict keyed by parameter FQN instead of position."""

    state: Dict[str, Dict[str, Any]]
    param_groups: List[Dict[str, Any]]


def model_key(name: str) -> str:
    """Checkpoint key of model state-dict entry ``name``."""
    return f"{MODEL_PREFIX}{name}"


def optim_key(fqn: str, name: str) -> str:
    """Checkpoint key of optimizer state ``name`` (e.g. ``exp_avg``) of parameter ``fqn``."""
    return f"{OPTIM_STATE_PREFIX}{fqn}.{name}"


def _rank() -> str:
    return f"[rank {get_rank()}]"


def param_fqns(model: torch.nn.Module) -> Dict[int, str]:
    """``{id(param): fqn}`` for every parameter of ``model`` (the first name of a tied one), by
    canonical name (without wrapper attributes such as DDP's ``module.``)."""
    names = ModuleNames(model)
    return {id(p): names.canonical(name) for name, p in model.named_parameters()}


def _optim_param_names(model: torch.nn.Module, optim: torch.optim.Optimizer) -> List[List[str]]:
    """The FQN of every optimizer parameter, group by group; raises for a foreign parameter."""
    if has_fsdp1(model):
        raise CheckpointingException(
            f"{_rank()} the model contains FSDP1 FullyShardedDataParallel modules, whose optimizer state is "
            f"flattened and sharded per rank; save_model_and_optim_state handles the model alone (optim=None) or "
            f"FSDP2 (torch.distributed.fsdp.fully_shard), whose state is DTensors"
        )
    fqns = param_fqns(model)
    groups = []
    for g, group in enumerate(optim.param_groups):
        names = []
        for i, p in enumerate(group["params"]):
            if id(p) not in fqns:
                raise KeyMismatchError(
                    f"{_rank()} optimizer parameter {i} of param group {g} (shape {tuple(p.shape)}) is not a "
                    f"parameter of the model; build the optimizer from model.parameters()"
                )
            names.append(fqns[id(p)])
        groups.append(names)
    return groups


# --------------------------------------------------------------------------- save


@dataclass
class ModelEntries:
    """A model's state-dict tensors by canonical name, and how to give them back to the model.

    Attributes:
        tensors: ``{canonical name: tensor}`` of ``model.state_dict()``.
        raw_names: ``{canonical name: the model's own state-dict key}``.
        copies: the tensors are copies, not the model's own (FSDP1): after loading into them,
            `give_back()` hands them to ``model.load_state_dict``.
    """

    tensors: Dict[str, torch.Tensor]
    raw_names: Dict[str, str]
    copies: bool

    def give_back(self, model: torch.nn.Module) -> None:
        """Load the (loaded) tensors into ``model`` when they are copies; nothing otherwise."""
        if self.copies:
            model.load_state_dict({self.raw_names[name]: t for name, t in self.tensors.items()})


def model_entries(model: torch.nn.Module) -> ModelEntries:
    """``model.state_dict()``'s tensors by canonical name (see `ModelEntries`).

    Raises:
        CheckpointingException: an entry is not a tensor, or two entries share a canonical name.
    """
    state, raw_names = canonical_state_dict(model)
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointingException(
                f"{_rank()} model state-dict entry {raw_names[name]!r} is {with_article(type(value).__name__)}, "
                "not a tensor; "
                f"only tensors (parameters, buffers) can be saved with save_model_and_optim_state"
            )
    return ModelEntries(state, raw_names, has_fsdp1(model))


def _optim_state_entry(fqn: str, param: torch.Tensor, name: str, value: Any) -> Any:
    """A ShardedTensor for a state tensor with dims, the value itself for a scalar."""
    if not isinstance(value, torch.Tensor) or value.ndim == 0:
        return value
    if is_dtensor(param) and not is_dtensor(value):
        raise CheckpointingException(
            f"{_rank()} optimizer state {name!r} of DTensor parameter {fqn!r} is a plain tensor of shape "
            f"{tuple(value.shape)}; its sharding is unknown (only scalars and DTensors are supported)"
        )
    return to_sharded_tensor(optim_key(fqn, name), value)


def model_optim_state_dict(model: torch.nn.Module, optim: Optional[torch.optim.Optimizer]) -> ShardedStateDict:
    """The sharded state dict that [`dist_ckpt.save()`][dist_ckpt.engine.save.save] writes for ``model`` and ``optim``.

    See the module docstring for the keys. ShardedTensors hold this rank's local data (a
    DTensor's local shard, or the whole tensor as a replica on every rank).

    Example:

    ```python
    dc.save(model_optim_state_dict(model, optim), "ckpt/step_100")
    ```
    """
    sd: ShardedStateDict = {
        "format": dict(FORMAT),
        "model": {name: to_sharded_tensor(model_key(name), t) for name, t in model_entries(model).tensors.items()},
    }
    if optim is None:
        return sd
    names = _optim_param_names(model, optim)
    groups, tensor_state, state = [], {}, {}
    for group, fqns in zip(optim.param_groups, names):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(fqns)})
        for p, fqn in zip(group["params"], fqns):
            entries = {name: _optim_state_entry(fqn, p, name, v) for name, v in optim.state.get(p, {}).items()}
            if entries:
                state[fqn] = entries
                tensor_state[fqn] = sorted(n for n, v in entries.items() if isinstance(v, ShardedTensor))
    sd["optim"] = {"class": type(optim).__name__, "param_groups": groups, "tensor_state": tensor_state, "state": state}
    return sd


# --------------------------------------------------------------------------- load


def _check_format(common: Mapping[str, Any], checkpoint_dir: str) -> None:
    fmt = common.get("format")
    if not isinstance(fmt, dict) or fmt.get("name") != FORMAT["name"]:
        raise NotACheckpointError(
            f"{_rank()} {checkpoint_dir!r} is a dist_ckpt checkpoint but was not written by "
            f"save_model_and_optim_state (no {FORMAT['name']!r} format marker in its common state)"
        )
    if fmt.get("version") != FORMAT["version"]:
        raise LoadMismatchError(
            f"{_rank()} {checkpoint_dir!r} has model-state format version {fmt.get('version')!r}; this "
            f"dist_ckpt reads version {FORMAT['version']}"
        )


def _target(
    key: str, live: torch.Tensor, stored: Optional[ShardedTensor], what: str, checkpoint_dir: str
) -> LoadTarget:
    if stored is None:
        raise KeyMismatchError(
            f"{_rank()} {what} has no entry {key!r} in checkpoint {checkpoint_dir!r}", unexpected_keys=[key]
        )
    if tuple(stored.global_shape) != tuple(live.shape):
        raise LoadMismatchError(
            f"{_rank()} {what} ({key!r}) has shape {tuple(live.shape)}, but checkpoint {checkpoint_dir!r} "
            f"stores shape {tuple(stored.global_shape)} ({stored.dtype})"
        )
    return make_target(key, live, stored.dtype)


def plan_model_load(
    model: torch.nn.Module,
    tensors_metadata: Mapping[str, ShardedTensor],
    common: Mapping[str, Any],
    checkpoint_dir: str,
    entries: Optional[ModelEntries] = None,
) -> List[LoadTarget]:
    """Load targets for every ``model.state_dict()`` entry, checked against the checkpoint.

    Entries match by canonical name; a checkpoint that stores wrapped names (``module.fc.weight``)
    matches too (`match_stored_names()`).

    Args:
        model: the model to load into.
        tensors_metadata: ``dist_ckpt.load_tensors_metadata(checkpoint_dir)``.
        common: ``dist_ckpt.load_common_state_dict(checkpoint_dir)``.
        checkpoint_dir: for error messages.
        entries: ``model_entries(model)``, when the caller keeps them (to `give_back()`
            copies); taken here otherwise.

    Raises:
        KeyMismatchError: an entry of the model is not in the checkpoint, or vice versa.
        LoadMismatchError: a global shape differs.
    """
    _check_format(common, checkpoint_dir)
    live = (entries or model_entries(model)).tensors
    stored_names = {k[len(MODEL_PREFIX) :] for k in tensors_metadata if k.startswith(MODEL_PREFIX)}
    match = match_stored_names(live, stored_names)
    extra = sorted(stored_names - set(match.values()))
    absent = sorted(set(live) - set(match))
    if extra or absent:
        parts = []
        if absent:
            parts.append(f"model entries absent from the checkpoint: {format_keys(absent)}")
        if extra:
            parts.append(f"checkpointed model entries the model does not have: {format_keys(extra)}")
        raise KeyMismatchError(
            f"{_rank()} model does not match checkpoint {checkpoint_dir!r}: " + "; ".join(parts),
            missing_keys=[model_key(n) for n in extra],
            unexpected_keys=[model_key(n) for n in absent],
        )
    return [
        _target(key, t, tensors_metadata.get(key), f"model entry {name!r}", checkpoint_dir)
        for name, t in live.items()
        for key in [model_key(match[name])]
    ]


@dataclass
class OptimLoadPlan:
    """What `plan_optim_load()` prepared: state tensors to fill, and how to assemble them.

    Attributes:
        targets: load targets of the tensor states (in freshly allocated tensors).
        state: ``{position: {name: value}}`` in ``optim.state_dict()`` numbering; tensor states
            are the allocated tensors, filled once the targets are loaded.
        param_groups: the live groups with the saved hyperparameters (``params`` as positions).
    """

    targets: List[LoadTarget] = field(default_factory=list)
    state: Dict[int, Dict[str, Any]] = field(default_factory=dict)
    param_groups: List[Dict[str, Any]] = field(default_factory=list)

    def torch_state_dict(self) -> Dict[str, Any]:
        """The position-keyed state dict for ``optim.load_state_dict`` (after loading)."""
        return {"state": self.state, "param_groups": self.param_groups}


def _saved_group_of(saved_groups: Sequence[Mapping[str, Any]]) -> Dict[str, int]:
    where: Dict[str, int] = {}
    for i, group in enumerate(saved_groups):
        for fqn in group["params"]:
            where[fqn] = i
    return where


def _match_groups(
    live_names: List[List[str]], saved_groups: Sequence[Mapping[str, Any]], checkpoint_dir: str
) -> Tuple[List[Dict[str, Any]], Dict[str, str]]:
    """Each live group with the hyperparameters of the saved group that held its parameters, and
    ``{live fqn: saved fqn}`` (they differ for a checkpoint that stores wrapped names)."""
    where = _saved_group_of(saved_groups)
    live_all = {fqn for names in live_names for fqn in names}
    saved_fqn = match_stored_names(sorted(live_all), where)
    absent = sorted(live_all - set(saved_fqn))
    extra = sorted(set(where) - set(saved_fqn.values()))
    if absent or extra:
        parts = []
        if absent:
            parts.append(f"optimizer parameters absent from the checkpoint: {format_keys(absent)}")
        if extra:
            parts.append(f"checkpointed optimizer parameters this optimizer does not hold: {format_keys(extra)}")
        raise KeyMismatchError(
            f"{_rank()} optimizer of checkpoint {checkpoint_dir!r} does not match: " + "; ".join(parts),
            missing_keys=extra,
            unexpected_keys=absent,
        )
    groups: List[Dict[str, Any]] = []
    position = 0
    for g, names in enumerate(live_names):
        sources = sorted({where[saved_fqn[fqn]] for fqn in names})
        if len(sources) > 1:
            raise LoadMismatchError(
                f"{_rank()} optimizer param group {g} holds parameters that checkpoint {checkpoint_dir!r} keeps in "
                f"different groups {sources} (e.g. {names[0]!r}); build the param groups as when saving"
            )
        source = saved_groups[sources[0]] if sources else (saved_groups[g] if g < len(saved_groups) else {})
        hyper = {k: v for k, v in source.items() if k != "params"}
        groups.append({**hyper, "params": list(range(position, position + len(names)))})
        position += len(names)
    return groups, saved_fqn


def _clone_scalar(value: Any) -> Any:
    # every parameter needs its own step tensor: Adam increments it in place
    return value.clone() if isinstance(value, torch.Tensor) else value


def plan_optim_load(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    tensors_metadata: Mapping[str, ShardedTensor],
    common: Mapping[str, Any],
    checkpoint_dir: str,
) -> OptimLoadPlan:
    """Allocate ``optim``'s state as saved and plan its loading (see `OptimLoadPlan`).

    State tensors of a DTensor parameter are DTensors with the parameter's placements; those of
    a plain parameter are plain tensors of the stored shape. Parameters without saved state (no
    step taken yet) get none, as in an uninterrupted run.

    Raises:
        KeyMismatchError: the checkpoint has no optimizer state, or its parameters differ.
        LoadMismatchError: shapes or param-group membership differ.
    """
    _check_format(common, checkpoint_dir)
    saved = common.get("optim")
    if not isinstance(saved, dict):
        raise KeyMismatchError(
            f"{_rank()} checkpoint {checkpoint_dir!r} holds no optimizer state; pass optim=None to load the model only"
        )
    if saved.get("class") != type(optim).__name__:
        logger.warning(
            "loading the state of a %s optimizer from %s into a %s",
            saved.get("class"),
            checkpoint_dir,
            type(optim).__name__,
        )
    live_names = _optim_param_names(model, optim)
    param_groups, saved_fqn = _match_groups(live_names, saved["param_groups"], checkpoint_dir)
    plan = OptimLoadPlan(param_groups=param_groups)
    position = 0
    for group, names in zip(optim.param_groups, live_names):
        for p, fqn in zip(group["params"], (saved_fqn[n] for n in names)):
            entries = {name: _clone_scalar(v) for name, v in saved.get("state", {}).get(fqn, {}).items()}
            for name in saved.get("tensor_state", {}).get(fqn, []):
                key = optim_key(fqn, name)
                stored = tensors_metadata.get(key)
                if stored is None:
                    raise KeyMismatchError(
                        f"{_rank()} checkpoint {checkpoint_dir!r} lists optimizer state {key!r} but does not hold it",
                        unexpected_keys=[key],
                    )
                entries[name] = _allocate_like(p, stored, key, checkpoint_dir)
                plan.targets.append(make_target(key, entries[name]))
            if entries:
                plan.state[position] = entries
            position += 1
    return plan


def _allocate_like(param: torch.Tensor, stored: ShardedTensor, key: str, checkpoint_dir: str) -> torch.Tensor:
    """A tensor for stored state ``key``: a DTensor placed like ``param``, or a plain tensor."""
    shape = tuple(stored.global_shape)
    if not is_dtensor(param):
        return torch.empty(shape, dtype=stored.dtype, device=local_tensor(param).device)
    if shape != tuple(param.shape):
        raise LoadMismatchError(
            f"{_rank()} optimizer state {key!r} in checkpoint {checkpoint_dir!r} has shape {shape}, but its "
            f"DTensor parameter has shape {tuple(param.shape)}; only state shaped like its parameter can be "
            f"placed like it"
        )
    with torch.no_grad():
        return torch.empty_like(param, dtype=stored.dtype)


# --------------------------------------------------------------------------- unshard


def unsharded_optim_state(
    full_tensors: Mapping[str, torch.Tensor], common: Mapping[str, Any], checkpoint_dir: str
) -> OptimStateDict:
    """Assemble the FQN-keyed optimizer state dict from whole tensors and the common state.

    Args:
        full_tensors: whole ``optim.state.*`` tensors keyed by checkpoint key.
        common: the checkpoint's common state.
        checkpoint_dir: for error messages.
    """
    _check_format(common, checkpoint_dir)
    saved = common.get("optim")
    if not isinstance(saved, dict):
        raise KeyMismatchError(f"{_rank()} checkpoint {checkpoint_dir!r} holds no optimizer state")
    state: Dict[str, Dict[str, Any]] = {fqn: dict(entries) for fqn, entries in saved.get("state", {}).items()}
    for fqn, names in saved.get("tensor_state", {}).items():
        for name in names:
            key = optim_key(fqn, name)
            if key not in full_tensors:
                raise KeyMismatchError(
                    f"{_rank()} checkpoint {checkpoint_dir!r} lists optimizer state {key!r} but does not hold it",
                    unexpected_keys=[key],
                )
            state.setdefault(fqn, {})[name] = full_tensors[key]
    groups = [dict(g, params=list(g["params"])) for g in saved["param_groups"]]
    return OptimStateDict(state=state, param_groups=groups)
