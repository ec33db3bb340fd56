"""The preprocessing of a state dict before a save or a load, as Megatron-Core's
``state_dict_utils`` exposes it, and the content metadata a save stores in the common state.

[`save()`][dist_ckpt.engine.save.save] and [`load()`][dist_ckpt.engine.load.load] run the same
splits inside their steps; these functions are for callers that prepare a state dict themselves
(Megatron-Core's trainers and custom strategies do): factories applied, LocalNonPersistentObjects
taken out, sharded and common parts split, empty flattened ranges dropped.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from dist_ckpt.engine.checks.save_checks import validate_save
from dist_ckpt.engine.load import _load_preprocess
from dist_ckpt.engine.load_parts import load_common_state_dict
from dist_ckpt.errors import ArgumentTypeError, StateDictStructureError
from dist_ckpt.model.dict_utils import dict_list_map_inplace, nested_values
from dist_ckpt.model.sharded import ShardedBase, ShardedStateDict, StateDict, apply_factories
from dist_ckpt.model.state_dict_utils import (
    extract_nonpersistent,
    extract_sharded_base,
    filter_out_empty_flatten_tensor,
)
from dist_ckpt.storage.location import LocationLike

#: the common-state key under which ``save(..., content_metadata=...)`` stores its dict
#: (Megatron-Core's, so that either library reads the other's)
CONTENT_METADATA_KEY = "content_metadata"
#: entries Megatron-Core keeps in its content metadata for its own use that cannot be saved
#: (a process group)
_UNSAVED_CONTENT_METADATA = ("dp_cp_group",)


def content_metadata_to_save(content_metadata: Any) -> Dict[str, Any]:
    """A copy of ``content_metadata`` without the entries that are process-local (a process
    group under ``dp_cp_group``, as Megatron-Core's trainers pass it).

    Raises:
        ArgumentTypeError: ``content_metadata`` is not a dict (also a TypeError).
    """
    if not isinstance(content_metadata, dict):
        raise ArgumentTypeError(
            f"content_metadata must be a dict (stored under the common-state key {CONTENT_METADATA_KEY!r}), "
            f"got {type(content_metadata).__name__}"
        )
    return {k: v for k, v in content_metadata.items() if k not in _UNSAVED_CONTENT_METADATA}


def add_content_metadata(common_state_dict: StateDict, content_metadata: Optional[Dict[str, Any]]) -> None:
    """Put ``content_metadata`` (if given) in the common state under `CONTENT_METADATA_KEY`;
    without it, a dict the state dict itself holds there loses its process-local entries
    (`content_metadata_to_save()`), as Megatron-Core's save does.

    Raises:
        ArgumentTypeError: ``content_metadata`` is not a dict.
        StateDictStructureError: the state dict already holds another value under that key, which
            the content metadata would silently replace.
    """
    if content_metadata is None:
        existing = common_state_dict.get(CONTENT_METADATA_KEY) if isinstance(common_state_dict, dict) else None
        if isinstance(existing, dict):
            common_state_dict[CONTENT_METADATA_KEY] = content_metadata_to_save(existing)
        return
    value = content_metadata_to_save(content_metadata)
    if not isinstance(common_state_dict, dict):
        raise StateDictStructureError(
            f"content_metadata needs a state dict that is a dict, got {type(common_state_dict).__name__}"
        )
    existing = common_state_dict.get(CONTENT_METADATA_KEY, value)
    if existing != value:
        raise StateDictStructureError(
            f"the state dict already holds {CONTENT_METADATA_KEY!r} = {existing!r}, and content_metadata={value!r} "
            f"would replace it; remove the entry or pass the same dict"
        )
    common_state_dict[CONTENT_METADATA_KEY] = value


def load_content_metadata(
    checkpoint_dir: Optional[LocationLike] = None, *, preloaded_state_dict: Optional[StateDict] = None
) -> Optional[Dict[str, Any]]:
    """The dict a checkpoint was saved with as ``save(..., content_metadata=...)``, or None if it
    was saved without one; reads the common state (not collective, no process group needed).

    Example:

    ```python
    save(sd, "ckpt/iter_10", content_metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    load_content_metadata("ckpt/iter_10")     # {'distrib_optim_sharding_type': 'dp_reshardable'}
    ```

    Args:
        checkpoint_dir: the checkpoint to read.
        preloaded_state_dict: a common state (or a loaded state dict) already in memory, read
            instead of the checkpoint.

    Raises:
        ArgumentTypeError: neither argument is given.
        NotACheckpointError: ``checkpoint_dir`` holds no committed checkpoint.
    """
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise ArgumentTypeError("load_content_metadata needs checkpoint_dir or preloaded_state_dict; got neither")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir)
    value = preloaded_state_dict.get(CONTENT_METADATA_KEY)
    return None if value is None else dict(value)


def save_preprocess(
    sharded_state_dict: ShardedStateDict,
    validate_access_integrity: bool = True,
    preprocess_common_before_consistancy_check: Optional[Callable[[StateDict], StateDict]] = None,
) -> Tuple[ShardedStateDict, StateDict]:
    """Prepare a state dict for saving: ``(sharded part, common part)``.

    Applies factories (in place, as the save does), drops LocalNonPersistentObjects, splits the
    ShardedBase leaves from the common state, drops empty flattened ranges
    (`filter_out_empty_flatten_tensor()`) and the process-local entries of a
    ``"content_metadata"`` dict. With ``validate_access_integrity`` it then checks, as
    a save does, that the main replicas cover every tensor exactly once and warns where the
    common state differs between ranks (collective then; the same error on every rank).

    Example:

    ```python
    sharded, common = save_preprocess({"w": ShardedTensor.from_rank_offsets("w", w), "step": 3})
    # sharded == {"w": ShardedTensor(...)}, common == {"step": 3}
    ```

    Args:
        sharded_state_dict: the state to save.
        validate_access_integrity: run the save's sharding check.
        preprocess_common_before_consistancy_check: applied to the common state before the
            cross-rank comparison only.

    Raises:
        ShardingIntegrityError: the main replicas do not cover a tensor exactly once.
    """
    apply_factories(sharded_state_dict)
    _, persistent = extract_nonpersistent(sharded_state_dict)
    sharded_part, common_state_dict = extract_sharded_base(persistent)
    sharded_part = filter_out_empty_flatten_tensor(sharded_part)
    add_content_metadata(common_state_dict, None)
    if validate_access_integrity:
        local_metadata = [sh.without_data() for sh in nested_values(sharded_part) if isinstance(sh, ShardedBase)]
        validate_save(local_metadata, common_state_dict, preprocess_common_before_consistancy_check)
    return sharded_part, common_state_dict


def load_preprocess(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict, ShardedStateDict]:
    """Prepare a load request without modifying ``sharded_state_dict``:
    ``(request, non-persistent local values, factories)``.

    The request is a copy of the structure with empty flattened ranges dropped and factories
    applied; the second dict holds the unwrapped values of the LocalNonPersistentObjects (taken
    out of the request); the third the ShardedTensorFactories without their data (lists as
    ``{index: value}`` dicts), for ``apply_factory_merges`` after loading.

    Example:

    ```python
    request, local_values, factories = load_preprocess(model_sharded_state_dict)
    ```
    """
    request, factories = _load_preprocess(filter_out_empty_flatten_tensor(sharded_state_dict))
    nonpersistent, request = extract_nonpersistent(request)
    dict_list_map_inplace(lambda o: o.unwrap(), nonpersistent)
    return request, nonpersistent, factories


__all__ = [
    "CONTENT_METADATA_KEY",
    "add_content_metadata",
    "content_metadata_to_save",
    "load_content_metadata",
    "load_preprocess",
    "save_preprocess",
]
