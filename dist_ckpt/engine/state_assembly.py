"""Put a loaded state dict back together in the shape of the load request.

``save`` splits a state dict into the common part (written to ``common.pt``, lists compacted as
Megatron-Core does) and the sharded and non-persistent leaves. Merging the parts back by
position (Megatron-Core's way) fails when a list mixes both kinds. Here the *request* (the
sharded state dict passed to ``load``) drives the reassembly: when a list of the request has
exactly as many elements with plain values as the stored list, they are matched in order -- the
exact inverse of the split, so ``[ShardedTensor, 7]`` comes back as ``[tensor, 7]``; otherwise
(a request that omits plain values) elements are merged by position, as Megatron-Core does.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Set, Tuple

from dist_ckpt.errors import StateDictStructureError
from dist_ckpt.model.sharded import LocalNonPersistentObject, ShardedBase


def _is_special(x: Any) -> bool:
    return isinstance(x, (ShardedBase, LocalNonPersistentObject))


def has_common_part(x: Any) -> bool:
    """Whether splitting ``x`` leaves anything in the common part (mirrors the split rules)."""
    if isinstance(x, dict):
        return not x or any(has_common_part(v) for v in x.values())
    if isinstance(x, list):
        return not x or any(has_common_part(v) for v in x)
    return not _is_special(x)


def _has_special(x: Any) -> bool:
    if isinstance(x, dict):
        return any(_has_special(v) for v in x.values())
    if isinstance(x, list):
        return any(_has_special(v) for v in x)
    return _is_special(x)


def _paired_leaves(inputs: Any, outputs: Any, path: Tuple[Any, ...]) -> Iterator[Tuple[Any, Any]]:
    if isinstance(inputs, dict):
        if not isinstance(outputs, dict):
            raise StateDictStructureError(f"a strategy returned {type(outputs).__name__} at {path}, expected a dict")
        for k, v in inputs.items():
            if k not in outputs:
                raise StateDictStructureError(f"a strategy returned no value at {path + (k,)}")
            yield from _paired_leaves(v, outputs[k], path + (k,))
    elif isinstance(inputs, list):
        if not isinstance(outputs, list) or len(outputs) != len(inputs):
            raise StateDictStructureError(f"a strategy returned a different list at {path}")
        for i, (a, b) in enumerate(zip(inputs, outputs)):
            yield from _paired_leaves(a, b, path + (i,))
    else:
        yield inputs, outputs


def loaded_values(inputs: Any, outputs: Any) -> Dict[int, Any]:
    """``{id(sharded leaf): loaded value}`` from a strategy's input and its same-shaped output."""
    return {id(a): b for a, b in _paired_leaves(inputs, outputs, ()) if isinstance(a, ShardedBase)}


def assemble(common: Any, request: Any, values: Dict[int, Any], kept: Set[int]) -> Any:
    """The loaded state: ``common`` with every sharded / non-persistent leaf of ``request`` put
    back where the request has it.

    Args:
        common: the common state loaded from the checkpoint (modified in place).
        request: the load request after factories were applied.
        values: loaded values by ``id`` of the request's ShardedBase leaves.
        kept: ``id`` of the ShardedBase leaves that were loaded; the others were deliberately
            skipped (non-strict load) and are left out of the result.
    """
    return _fill(common, request, values, kept, ())


def _leaf_value(x: Any, values: Dict[int, Any], path: Tuple[Any, ...]) -> Any:
    if isinstance(x, LocalNonPersistentObject):
        return x.unwrap()
    try:
        return values[id(x)]
    except KeyError:
        raise StateDictStructureError(f"no value was loaded for {x} at {path}") from None


def _fill(common: Any, request: Any, values: Dict[int, Any], kept: Set[int], path: Tuple[Any, ...]) -> Any:
    if isinstance(request, dict):
        out = common if isinstance(common, dict) else {}
        for k, v in request.items():
            if isinstance(v, ShardedBase) and id(v) not in kept:
                continue
            if _is_special(v):
                out[k] = _leaf_value(v, values, path + (k,))
            elif isinstance(v, (dict, list)) and _has_special(v):
                out[k] = _fill(out.get(k), v, values, kept, path + (k,))
        return out
    if isinstance(request, list):
        return _fill_list(common if isinstance(common, list) else [], request, values, kept, path)
    return common


def _fill_list(stored: list, request: list, values: Dict[int, Any], kept: Set[int], path: Tuple[Any, ...]) -> list:  # type: ignore[type-arg]
    if sum(has_common_part(v) for v in request) == len(stored):
        parts = iter(stored)  # the request accounts for every stored element: match in order
        pairs = [(v, next(parts) if has_common_part(v) else None) for v in request]
    elif len(stored) == len(request):
        pairs = list(zip(request, stored))  # positional merge, as Megatron-Core
    elif not stored:
        pairs = [(v, None) for v in request]
    else:
        raise StateDictStructureError(
            f"the list at {path} has {len(stored)} stored plain elements, which the load request's "
            f"list of {len(request)} elements does not account for; request the saved structure"
        )
    out = []
    for i, (v, part) in enumerate(pairs):
        if isinstance(v, ShardedBase) and id(v) not in kept:
            continue
        if _is_special(v):
            out.append(_leaf_value(v, values, path + (i,)))
        elif _has_special(v):
            out.append(_fill(part, v, values, kept, path + (i,)))
        else:
            out.append(part)
    return out
