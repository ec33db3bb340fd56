"""Names of a model's parameters and buffers without the attributes of wrapper modules.

Wrapping a model renames every entry of its state dict: ``DistributedDataParallel`` (and
``DataParallel``) put it under ``module.``, ``torch.compile`` under ``_orig_mod.``, FSDP1
(``FullyShardedDataParallel``) under ``_fsdp_wrapped_module.`` and activation checkpointing
under ``_checkpoint_wrapped_module.``, at whatever depth the wrapper sits. As
``torch.distributed.checkpoint.state_dict.get_state_dict`` does, dist_ckpt names every entry by
its *canonical* name, the one it has in the unwrapped model, so a checkpoint saved from a
wrapped model loads into the plain one and the reverse.

An attribute is dropped only where the module that holds it is such a wrapper (found by type,
not by name): a plain submodule that happens to be called ``module`` keeps its name.
Checkpoints written before canonical names (keys such as ``module.fc.weight``) still match, by
`match_stored_names()`.

Example:

```python
ddp = DistributedDataParallel(torch.compile(net))
names = ModuleNames(ddp)
names.canonical("module._orig_mod.fc.weight")    # "fc.weight"
sd, raw = canonical_state_dict(ddp)              # {"fc.weight": ...}, {"fc.weight": "module._orig_mod.fc.weight"}
```
"""

from __future__ import annotations

import sys
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from dist_ckpt.errors import CheckpointingException

__all__ = [
    "WRAPPER_ATTRIBUTES",
    "ModuleNames",
    "canonical_state_dict",
    "has_fsdp1",
    "match_stored_names",
    "raw_names",
    "strip_wrapper_prefixes",
    "wrapped_attribute",
]

#: the wrappers whose attribute is dropped from names: (module that defines the class, class
#: name, the attribute that holds the wrapped module). A class whose module was never imported
#: cannot have instances, so nothing here imports torch._dynamo or FSDP.
_FSDP1 = ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel", "_fsdp_wrapped_module")
_WRAPPERS: Tuple[Tuple[str, str, str], ...] = (
    ("torch.nn.parallel.distributed", "DistributedDataParallel", "module"),
    ("torch.nn.parallel.data_parallel", "DataParallel", "module"),
    ("torch._dynamo.eval_frame", "OptimizedModule", "_orig_mod"),
    _FSDP1,
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper", "_checkpoint_wrapped_module"),
)

#: the attribute names a wrapper puts into state-dict keys
WRAPPER_ATTRIBUTES = tuple(sorted({attribute for _, _, attribute in _WRAPPERS}))

#: attributes dropped only as the leading atoms of a stored name: ``module`` is also a common
#: name of ordinary submodules, but DDP and DataParallel only ever wrap a whole model
_LEADING_ONLY = frozenset({"module"})


def _is_instance(module: torch.nn.Module, wrapper: Tuple[str, str, str]) -> bool:
    defining = sys.modules.get(wrapper[0])
    cls = getattr(defining, wrapper[1], None) if defining is not None else None
    return isinstance(cls, type) and isinstance(module, cls)


def wrapped_attribute(module: torch.nn.Module) -> Optional[str]:
    """The attribute holding the wrapped module when ``module`` is a wrapper (else None)."""
    for wrapper in _WRAPPERS:
        if _is_instance(module, wrapper):
            return wrapper[2]
    return None


def has_fsdp1(model: torch.nn.Module) -> bool:
    """Whether ``model`` contains an FSDP1 ``FullyShardedDataParallel`` module.

    FSDP1's ``state_dict()`` returns gathered copies (not the parameters themselves) and its
    optimizer holds flattened per-rank shards, so callers treat such a model specially.
    """
    return any(_is_instance(m, _FSDP1) for m in model.modules())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class ModuleNames:
    """Canonical names of one model's modules, parameters and buffers (built once per model).

    Args:
        model: the (possibly wrapped) model.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        #: raw module path -> canonical module path ("" is the model itself)
        self.canonical_paths: Dict[str, str] = {"": ""}
        #: canonical module path -> the innermost module at it (a wrapper and what it wraps
        #: share one canonical path; parameters live in the wrapped module)
        self.modules: Dict[str, torch.nn.Module] = {"": model}
        stack: List[Tuple[torch.nn.Module, str, str]] = [(model, "", "")]
        while stack:
            module, raw, canonical = stack.pop()
            dropped = wrapped_attribute(module)
            for child_name, child in module._modules.items():
                if child is None:
                    continue
                child_raw = _join(raw, child_name)
                child_canonical = canonical if child_name == dropped else _join(canonical, child_name)
                self.canonical_paths[child_raw] = child_canonical
                if child_name == dropped or child_canonical not in self.modules:
                    self.modules[child_canonical] = child
                stack.append((child, child_raw, child_canonical))

    def canonical(self, name: str) -> str:
        """The canonical form of a parameter, buffer or state-dict name of the model.

        A name whose owner is not a module path of the model (e.g. a key FSDP1's
        ``state_dict()`` already cleaned) is returned unchanged.
        """
        path, _, attribute = name.rpartition(".")
        if path not in self.canonical_paths:
            return name
        return _join(self.canonical_paths[path], attribute)

    def canonical_map(self, raw_names: Iterable[str]) -> Dict[str, str]:
        """``{canonical: raw}`` for ``raw_names``; raises if two names become one."""
        out: Dict[str, str] = {}
        for raw in raw_names:
            canonical = self.canonical(raw)
            if canonical in out and out[canonical] != raw:
                raise CheckpointingException(
                    f"state-dict entries {out[canonical]!r} and {raw!r} of {type(self.model).__name__} both name "
                    f"{canonical!r} once the wrapper attributes {WRAPPER_ATTRIBUTES} are dropped; rename one"
                )
            out[canonical] = raw
        return out

    def submodule(self, canonical_path: str) -> torch.nn.Module:
        """The module at a canonical (or raw) dotted path; AttributeError if there is none."""
        if canonical_path in self.modules:
            return self.modules[canonical_path]
        return self.model.get_submodule(canonical_path)


def canonical_state_dict(
    model: torch.nn.Module, keep_vars: bool = False
) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """``model.state_dict()`` keyed by canonical names, and ``{canonical: raw}`` for each key.

    Example:

    ```python
    sd, raw = canonical_state_dict(ddp_model)
    ddp_model.load_state_dict({raw[k]: v for k, v in sd.items()})
    ```
    """
    state = model.state_dict(keep_vars=keep_vars)
    raw_of = ModuleNames(model).canonical_map(state)
    return {canonical: state[raw] for canonical, raw in raw_of.items()}, raw_of


def strip_wrapper_prefixes(name: str) -> str:
    """``name`` without wrapper attributes, judged from the name alone (for stored names).

    ``_orig_mod``, ``_fsdp_wrapped_module`` and ``_checkpoint_wrapped_module`` atoms are dropped
    wherever they are; ``module`` only among the leading atoms (where DDP puts it).

    Example:

    ```python
    strip_wrapper_prefixes("module._orig_mod.fc.weight")   # "fc.weight"
    strip_wrapper_prefixes("encoder.module.weight")         # unchanged
    ```
    """
    atoms = name.split(".")
    kept: List[str] = []
    for atom in atoms[:-1]:
        leading = not kept
        if atom in WRAPPER_ATTRIBUTES and (leading or atom not in _LEADING_ONLY):
            continue
        kept.append(atom)
    kept.append(atoms[-1])
    return ".".join(kept)


def match_stored_names(live: Iterable[str], stored: Iterable[str]) -> Dict[str, str]:
    """``{live name: stored name}`` for every live (canonical) name found among ``stored``.

    A name is found as it is, or else as a stored name that equals it once
    `strip_wrapper_prefixes()` drops wrapper attributes (a checkpoint written with the
    wrapped names), when exactly one stored name does. Unmatched names on either side are left
    for the caller to report.

    Example:

    ```python
    match_stored_names(["fc.weight"], ["module.fc.weight"])   # {"fc.weight": "module.fc.weight"}
    ```
    """
    stored_set = set(stored)
    matched = {name: name for name in live if name in stored_set}
    unused = stored_set - set(matched.values())
    by_stripped: Dict[str, List[str]] = {}
    for name in sorted(unused):
        by_stripped.setdefault(strip_wrapper_prefixes(name), []).append(name)
    for name in live:
        if name not in matched and len(by_stripped.get(name, [])) == 1:
            matched[name] = by_stripped[name][0]
    return matched


def raw_names(model: torch.nn.Module, canonical: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``canonical``'s entries keyed by ``model``'s own (raw) state-dict names, for ``load_state_dict``."""
    raw_of = ModuleNames(model).canonical_map(model.state_dict(keep_vars=True))
    return {raw_of.get(name, name): value for name, value in canonical.items()}
