"""Which tensors an HF export writes, and under which names.

A training checkpoint holds more than an inference model needs: optimizer state (Adam moments,
fp32 master copies, momentum buffers) and common state. [`select_keys()`][dist_ckpt.hf.select.select_keys] keeps the
model weights by default and lets ``include`` / ``exclude`` shell patterns decide otherwise;
[`rename_keys()`][dist_ckpt.hf.select.rename_keys] maps stored names to the names a model class expects (``model.`` ->
``""`` for a checkpoint of
[`dist_ckpt.save_model_and_optim_state()`][dist_ckpt.training.model_optim.save_model_and_optim_state]).

What counts as optimizer state ([`is_optimizer_key()`][dist_ckpt.hf.select.is_optimizer_key]), by the key's
dot-separated parts:

* the first part is ``optimizer``, ``optim`` or ``optimizer_state`` -- dist_ckpt's one-call API
  stores ``optim.state.<param>.<state>``, Megatron-Core ``optimizer.state.<state>.<param>``,
  distributed optimizers ``optimizer.distributed.*``;
* or any part is the name of a torch.optim / Megatron optimizer tensor: ``exp_avg``,
  ``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``, ``fp32_param``,
  ``fp32_from_fp16_params``, ``master_param``, ``main_param``.

Example:

```python
keys = select_keys(["model.fc.weight", "optim.state.fc.weight.exp_avg"])   # ["model.fc.weight"]
names = rename_keys(keys, {"model.": ""})                                  # {"model.fc.weight": "fc.weight"}
```
"""

from __future__ import annotations

import fnmatch
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

from dist_ckpt.errors import InvalidKeyError

__all__ = ["OPTIMIZER_PREFIXES", "OPTIMIZER_STATE_NAMES", "is_optimizer_key", "rename_keys", "select_keys"]

#: first key parts under which optimizer state is stored
OPTIMIZER_PREFIXES = frozenset({"optimizer", "optim", "optimizer_state"})
#: key parts that name an optimizer's per-parameter tensors
OPTIMIZER_STATE_NAMES = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "momentum_buffer",
        "fp32_param",
        "fp32_from_fp16_params",
        "master_param",
        "main_param",
    }
)


def is_optimizer_key(key: str) -> bool:
    """Whether ``key`` holds optimizer state (module docstring); e.g. ``"optim.state.fc.weight.exp_avg"``."""
    parts = key.split(".")
    return parts[0] in OPTIMIZER_PREFIXES or any(p in OPTIMIZER_STATE_NAMES for p in parts)


def select_keys(keys: Iterable[str], include: Optional[Sequence[str]] = None, exclude: Sequence[str] = ()) -> List[str]:
    """The ``keys`` to export, in their order.

    Args:
        keys: stored tensor keys.
        include: shell patterns (``fnmatch``, case-sensitive); a key is kept if it matches one.
            None (default): every key that is not optimizer state
            ([`is_optimizer_key()`][dist_ckpt.hf.select.is_optimizer_key]). Patterns override that default: ``["*"]``
            keeps optimizer state too.
        exclude: shell patterns of keys to leave out, applied after ``include``.

    Example:

    ```python
    select_keys(keys, exclude=["*.extra_state", "rotary_pos_emb.*"])
    ```
    """

    def included(key: str) -> bool:
        if include is None:
            return not is_optimizer_key(key)
        return any(fnmatch.fnmatchcase(key, pattern) for pattern in include)

    return [k for k in keys if included(k) and not any(fnmatch.fnmatchcase(k, p) for p in exclude)]


def _matches(key: str, prefix: str) -> bool:
    """``prefix`` is ``key``, or a leading run of its dot-separated parts (``"layers.1"`` matches
    ``"layers.1.w"`` but not ``"layers.10.w"``); a prefix ending in ``.`` matches what follows it."""
    if not key.startswith(prefix):
        return False
    return len(key) == len(prefix) or prefix.endswith(".") or key[len(prefix)] == "."


def rename_keys(keys: Iterable[str], rename: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``{stored key: exported name}``: the longest matching prefix of ``rename`` replaced.

    Args:
        keys: the keys to export.
        rename: ``{old prefix: new prefix}``. A prefix matches whole dot-separated parts
            (`_matches()`), so ``{"decoder.layers.1": "h.1"}`` leaves ``decoder.layers.10``
            alone; ``{"model.": ""}`` strips a leading ``model.``. Keys no prefix matches keep
            their names.

    Raises:
        InvalidKeyError: two keys get the same name, or a key's new name is empty.

    Example:

    ```python
    rename_keys(["model.fc.weight"], {"model.": ""})      # {"model.fc.weight": "fc.weight"}
    ```
    """
    by_length = sorted((rename or {}).items(), key=lambda item: len(item[0]), reverse=True)
    names: Dict[str, str] = {}
    owner: Dict[str, str] = {}
    for key in keys:
        name = key
        for old, new in by_length:
            if _matches(key, old):
                name = new + key[len(old) :]
                break
        if not name:
            raise InvalidKeyError(
                f"renaming {key!r} with {dict(rename or {})} leaves an empty name; fix the rename map"
            )
        if name in owner:
            raise InvalidKeyError(
                f"keys {owner[name]!r} and {key!r} would both be exported as {name!r}; fix the rename map "
                "or leave one out with an exclude pattern"
            )
        owner[name] = key
        names[key] = name
    return names
