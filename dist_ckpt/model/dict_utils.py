"""Helpers for nested dicts and lists (state dicts).

Every function here traverses dicts and lists; any other object (tuples included) is a leaf.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, TextIO, Tuple, Union

import numpy as np
import torch

from dist_ckpt.errors import StateDictStructureError

Nested = Union[Dict[Any, Any], List[Any]]


def extract_matching_values(
    x: Nested, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> Tuple[Nested, Nested]:
    """Split ``x`` into (matching, non-matching) leaves, keeping the nesting.

    Args:
        x: a dict or list (the top level must be one of them).
        predicate: decides which leaves match.
        return_lists_as_dicts: if True, lists come back as ``{index: value}`` dicts so that the
            original positions are kept; otherwise each part is a compacted list.

    Example:

    ```pycon
    >>> extract_matching_values({"a": 1, "b": "x"}, lambda v: isinstance(v, int))
    ({'a': 1}, {'b': 'x'})
    ```
    """
    if isinstance(x, dict):
        matching: Dict[Any, Any] = {}
        nonmatching: Dict[Any, Any] = {}
        for k, v in x.items():
            if isinstance(v, (dict, list)):
                match, nonmatch = extract_matching_values(v, predicate, return_lists_as_dicts)
                if match:
                    matching[k] = match
                if nonmatch or not v:
                    nonmatching[k] = nonmatch
            elif predicate(v):
                matching[k] = v
            else:
                nonmatching[k] = v
        return matching, nonmatching
    if isinstance(x, list):
        if return_lists_as_dicts:
            m_dict: Dict[int, Any] = {}
            n_dict: Dict[int, Any] = {}
            for i, v in enumerate(x):
                _extract_elem(v, i, predicate, True, m_dict, n_dict)
            return m_dict, n_dict
        m_list: List[Any] = []
        n_list: List[Any] = []
        for i, v in enumerate(x):
            _extract_elem(v, i, predicate, False, m_list, n_list)
        return m_list, n_list
    raise StateDictStructureError(f"expected a dict or list at the top level, got {type(x).__name__}")


def _extract_elem(
    v: Any, index: int, predicate: Callable[[Any], bool], as_dicts: bool, matching: Any, nonmatching: Any
) -> None:
    def put(target: Any, value: Any) -> None:
        if as_dicts:
            target[index] = value
        else:
            target.append(value)

    if isinstance(v, (dict, list)) and v:
        match, nonmatch = extract_matching_values(v, predicate, as_dicts)
        if match:
            put(matching, match)
        if nonmatch:
            put(nonmatching, nonmatch)
    elif predicate(v):
        put(matching, v)
    else:
        put(nonmatching, v)


def _values_differ(x1: Any, x2: Any) -> bool:
    if isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
        if x1.shape != x2.shape or x1.dtype != x2.dtype:
            return True
        a, b = x1.detach().cpu(), x2.detach().cpu()
        if a.is_floating_point() or a.is_complex():
            return not torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)) or not torch.equal(
                a.isnan(), b.isnan()
            )
        return not torch.equal(a, b)
    if isinstance(x1, torch.Tensor) or isinstance(x2, torch.Tensor):
        return True
    try:
        result = x1 != x2
        if isinstance(result, np.ndarray):
            return bool(result.any())
        return bool(result)
    except Exception:  # objects whose comparison raises are treated as different
        return True


def diff(x1: Any, x2: Any, prefix: Tuple[Any, ...] = ()) -> Tuple[List[Any], List[Any], List[Any]]:
    """Recursive diff of two nested values.

    Returns:
        ``(only_left, only_right, mismatch)``: key paths only in ``x1``, key paths only in
        ``x2``, and ``(path, type(left), type(right))`` for values present in both but unequal.
        Tensors are compared element-wise (NaNs in the same places count as equal).
    """
    only_left: List[Any] = []
    only_right: List[Any] = []
    mismatch: List[Any] = []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        for k in x1.keys() & x2.keys():
            left, right, mis = diff(x1[k], x2[k], prefix + (k,))
            only_left += left
            only_right += right
            mismatch += mis
    elif isinstance(x1, (list, tuple)) and isinstance(x2, (list, tuple)) and type(x1) is type(x2):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        for i, (v1, v2) in enumerate(zip(x1, x2)):
            left, right, mis = diff(v1, v2, prefix + (i,))
            only_left += left
            only_right += right
            mismatch += mis
    elif _values_differ(x1, x2):
        mismatch.append((prefix, type(x1), type(x2)))
    return only_left, only_right, mismatch


def inspect_types(x: Any, prefix: Tuple[Any, ...] = (), indent: int = 4, file: Optional[TextIO] = None) -> None:
    """Print the nesting of ``x`` with the type of every leaf (a debugging aid)."""
    out = file if file is not None else sys.stdout
    pad = " " * indent * len(prefix)
    if isinstance(x, dict):
        out.write("\n")
        for k, v in x.items():
            out.write(f"{pad}> {k}: ")
            inspect_types(v, prefix + (k,), indent, out)
    elif isinstance(x, list):
        out.write("\n")
        for i, v in enumerate(x):
            out.write(f"{pad}- {i}: ")
            inspect_types(v, prefix + (i,), indent, out)
    elif isinstance(x, torch.Tensor):
        out.write(f"Tensor of shape {tuple(x.shape)}, dtype {x.dtype}\n")
    else:
        try:
            text = str(x)
        except Exception:
            text = "<no string repr>"
        if len(text) > 30:
            text = text[:30] + "... (truncated)"
        out.write(f"[{type(x).__name__}]: {text}\n")


def nested_values(x: Nested) -> Iterator[Any]:
    """Iterate over the leaves of a nested dict/list."""
    for v in x.values() if isinstance(x, dict) else x:
        if isinstance(v, (dict, list)):
            yield from nested_values(v)
        else:
            yield v


def nested_items_iter(x: Nested) -> Iterator[Tuple[Any, Any, Any]]:
    """Iterate over ``(container, key, leaf)`` triples of a nested dict/list."""
    for k, v in x.items() if isinstance(x, dict) else enumerate(x):
        if isinstance(v, (dict, list)):
            yield from nested_items_iter(v)
        else:
            yield x, k, v


def dict_map(f: Callable[[Any], Any], d: Nested) -> None:
    """Replace every leaf ``v`` of a nested dict/list by ``f(v)``, in place."""
    for container, k, v in list(nested_items_iter(d)):
        container[k] = f(v)


def dict_map_with_key(f: Callable[[Any, Any], Any], d: Nested) -> None:
    """Replace every leaf ``v`` stored under key ``k`` by ``f(k, v)``, in place."""
    for container, k, v in list(nested_items_iter(d)):
        container[k] = f(k, v)


def dict_list_map_inplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Map the leaves of nested dicts/lists in place; returns ``x`` (or ``f(x)`` for a leaf)."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
    elif isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, v) for v in x]
    else:
        return f(x)
    return x


def dict_list_map_outplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Map the leaves of nested dicts/lists into a new structure."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def merge(x1: Nested, x2: Nested, key: Tuple[Any, ...] = ()) -> Nested:
    """Merge ``x2`` into ``x1`` recursively (in place) and return ``x1``.

    Dicts are merged key by key; lists must have equal lengths and are merged element-wise;
    any other pair of values present in both raises
    [`StateDictStructureError`][dist_ckpt.errors.StateDictStructureError].
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = merge(x1[k], v2, key + (k,)) if k in x1 else v2
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise StateDictStructureError(f"cannot merge lists of different lengths ({len(x1)} and {len(x2)}) at {key}")
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key + (i,))
    else:
        raise StateDictStructureError(
            f"cannot merge two leaf values at {key}: {type(x1).__name__} and {type(x2).__name__}"
        )
    return x1


def zip_strict(*iterables: Iterable[Any]) -> Iterator[Tuple[Any, ...]]:
    """``zip`` of iterables that must have equal lengths; the error names every length.

    Each iterable is consumed into a list first, so the lengths are checked before the first
    tuple is produced (``zip(..., strict=True)`` notices only at the end, and names only which
    one ran out).

    Example:

    ```pycon
    >>> list(zip_strict([1, 2], "ab"))
    [(1, 'a'), (2, 'b')]
    ```

    Raises:
        StateDictStructureError: the lengths differ (also a ValueError).
    """
    lists = [list(it) for it in iterables]
    lengths = [len(x) for x in lists]
    if len(set(lengths)) > 1:
        raise StateDictStructureError(f"zip_strict got iterables of unequal lengths {lengths}; expected equal lengths")
    return zip(*lists)


def map_reduce(
    xs: Iterable[Any],
    key_fn: Callable[[Any], Any] = lambda x: x,
    value_fn: Callable[[Any], Any] = lambda x: x,
    reduce_fn: Callable[[List[Any]], Any] = lambda x: x,
) -> Dict[Any, Any]:
    """Group ``value_fn(x)`` by ``key_fn(x)`` and reduce each group with ``reduce_fn``.

    Follows ``more_itertools.map_reduce``.
    """
    groups: Dict[Any, List[Any]] = defaultdict(list)
    for x in xs:
        groups[key_fn(x)].append(value_fn(x))
    return {k: reduce_fn(v) for k, v in groups.items()}
