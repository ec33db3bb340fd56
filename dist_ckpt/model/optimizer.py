"""Helpers that derive the sharding of optimizer state from the sharding of model parameters.

Typical use with a ``torch.optim`` optimizer:

```python
model_sd = model.sharded_state_dict()               # ShardedTensors wrapping the params
id_map = get_param_id_to_sharded_param_map(model_sd, optim.param_groups[0]["params"])
optim_sd = optim.state_dict()
optim_state_to_sharding_state(optim_sd, id_map, exclude_keys=("step",))
```
"""

from __future__ import annotations

import logging
from copy import deepcopy
from dataclasses import replace
from typing import Dict, Iterable, Tuple, Union

import torch

from dist_ckpt.errors import InvalidShardedTensorError
from dist_ckpt.model.dict_utils import nested_values
from dist_ckpt.model.sharded import (
    LocalNonPersistentObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)
from dist_ckpt.model.state_dict_utils import extract_sharded_tensors_and_factories

logger = logging.getLogger(__name__)

ShardedParam = Union[ShardedTensor, ShardedTensorFactory]


def get_optim_param_to_id_map(optim_params_iter: Iterable[torch.nn.Parameter]) -> Dict[int, int]:
    """``{id(param): position}`` in the optimizer's parameter order (first occurrence wins)."""
    mapping: Dict[int, int] = {}
    for i, param in enumerate(optim_params_iter):
        mapping.setdefault(id(param), i)
    return mapping


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict, optim_params_iter: Iterable[torch.nn.Parameter]
) -> Dict[int, ShardedParam]:
    """Map optimizer state ids (parameter positions) to the model's sharded parameters.

    Args:
        model_sharded_state_dict: a sharded state dict whose ShardedTensor / factory ``data``
            are the parameters themselves (build it with ``keep_vars=True``).
        optim_params_iter: the parameters in the optimizer's order.
    """
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    param_to_id = get_optim_param_to_id_map(optim_params_iter)
    id_to_sharded: Dict[int, ShardedParam] = {}
    for ten in nested_values(sharded):
        if id(ten.data) in param_to_id:
            id_to_sharded[param_to_id[id(ten.data)]] = ten
        else:
            logger.debug("%s is not tracked by the optimizer", ten)
    if not id_to_sharded:
        logger.warning(
            "no model parameter of the sharded state dict is tracked by the optimizer; build the "
            "model state dict with keep_vars=True so that its tensors are the parameters"
        )
    return id_to_sharded


def make_sharded_optimizer_tensor(model_param: ShardedParam, optim_param: torch.Tensor, prefix: str) -> ShardedParam:
    """Wrap ``optim_param`` (e.g. Adam's ``exp_avg``) with the sharding of ``model_param``.

    The key becomes ``f"{prefix}.{model_param.key}"``.
    """
    if isinstance(model_param, ShardedTensorFactory):
        return replace(model_param, key=f"{prefix}.{model_param.key}", data=optim_param)
    expected = (
        model_param.local_shape
        if model_param.flattened_range is None
        else (model_param.flattened_range.stop - model_param.flattened_range.start,)
    )
    if tuple(optim_param.shape) != tuple(expected):
        raise InvalidShardedTensorError(
            f"optimizer state {prefix}.{model_param.key} has shape {tuple(optim_param.shape)}, but its "
            f"parameter's local shape is {tuple(expected)}"
        )
    return replace(model_param, key=f"{prefix}.{model_param.key}", data=optim_param, dtype=optim_param.dtype)


def optim_state_to_sharding_state(
    optim_state_dict: StateDict, id_to_sharded_param_map: Dict[int, ShardedParam], exclude_keys: Tuple[str, ...] = ()
) -> None:
    """Turn a ``torch.optim`` state dict into a sharded state dict, in place.

    Each tensor under ``optim_state_dict["state"][param_id][name]`` becomes a ShardedTensor
    keyed ``optimizer.state.{name}.{param key}`` with its parameter's sharding, and each
    ``param_groups[i]["params"]`` becomes a LocalNonPersistentObject.
    """
    sharded_state: Dict[int, Dict[str, ShardedParam]] = {}
    for param_id, param_state in optim_state_dict["state"].items():
        if param_id not in id_to_sharded_param_map:
            raise InvalidShardedTensorError(f"optimizer param id {param_id} matches no sharded model parameter")
        sharded_state[param_id] = {
            name: make_sharded_optimizer_tensor(
                id_to_sharded_param_map[param_id], value, prefix=f"optimizer.state.{name}"
            )
            for name, value in param_state.items()
            if name not in exclude_keys
        }
    optim_state_dict["param_groups"] = deepcopy(optim_state_dict["param_groups"])
    for group in optim_state_dict["param_groups"]:
        group["params"] = LocalNonPersistentObject(group["params"])
    optim_state_dict["state"] = sharded_state
