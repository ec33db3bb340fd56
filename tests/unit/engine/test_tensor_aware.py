"""Megatron-Core's ``MCoreTensorAwareStateDict`` (``dist_ckpt.tensor_aware_state_dict``) in one process, used as
NVRx's local checkpoint manager uses it: split a model's sharded state dict, take the tensors out and put
them back (or fresh ones in), then rebuild the loaded state dict for a request. The fully-parallel split
over several ranks is in tests/distributed/test_tensor_aware.py."""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch

from dist_ckpt.errors import ArgumentTypeError, KeyMismatchError, StateDictStructureError
from dist_ckpt.mapping import LocalNonpersitentObject, ShardedObject, ShardedTensor, ShardedTensorFactory
from dist_ckpt.tensor_aware_state_dict import MCoreTensorAwareStateDict


def _split_rows(key: str, t: torch.Tensor, replica_id: int, flattened_range: Any = None) -> Dict[str, Any]:
    half = t.shape[0] // 2
    return {
        "top": ShardedTensor.from_rank_offsets(f"{key}.top", t[:half], replica_id=replica_id),
        "bottom": ShardedTensor.from_rank_offsets(f"{key}.bottom", t[half:], replica_id=replica_id),
    }


def _join_rows(parts: Dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([parts["top"], parts["bottom"]])


def _model(seed: float) -> Dict[str, Any]:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((2, 3), seed)),
        "fused": ShardedTensorFactory("fused", torch.arange(4.0).reshape(4, 1) + seed, _split_rows, _join_rows),
        "rng": ShardedObject("rng", {"seed": seed}, (1,), (0,)),
        "step": 7,
    }


def test_split_pop_insert_and_rebuild_the_loaded_state_dict() -> None:
    tasd, distribution = MCoreTensorAwareStateDict.from_state_dict(_model(1.0), algo="atomic")
    assert distribution == (None, None, None, None) and tasd.common_state_dict == {"step": 7}
    tensors = tasd.pop_tensors()
    assert tasd.is_hollow and len(tensors) == 3 and list(tasd._sharded_tensors)  # descriptions kept
    with pytest.raises(StateDictStructureError, match="hollow"):
        tasd.to_state_dict(_model(0.0))
    with pytest.raises(StateDictStructureError, match="2 tensors for the 3"):
        tasd.insert_tensors(tensors[:2])
    tasd.insert_tensors(tensors)

    request = _model(0.0)
    request["local"] = LocalNonpersitentObject("kept on this rank")
    loaded = tasd.to_state_dict(request)
    assert torch.equal(loaded["w"], torch.full((2, 3), 1.0))
    assert torch.equal(loaded["fused"], torch.arange(4.0).reshape(4, 1) + 1.0)  # the factory merged back
    assert loaded["rng"] == {"seed": 1.0} and loaded["step"] == 7 and loaded["local"] == "kept on this rank"


def test_init_tensors_gives_empty_tensors_to_restore_into_and_copies_keep_the_originals() -> None:
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_model(2.0), algo="atomic")
    originals = list(tasd.tensors)
    tasd.copy_tensors_to_cpu()
    copies = list(tasd.tensors)
    assert all(c.data_ptr() != o.data_ptr() and torch.equal(c, o) for c, o in zip(copies, originals))
    tasd.restore_tensor_device()
    shapes = [t.shape for t in tasd.pop_tensors()]
    tasd.init_tensors()
    assert not tasd.is_hollow and [t.shape for t in tasd.tensors] == shapes
    for t in tasd.tensors:
        t.fill_(5.0)
    assert torch.equal(tasd.to_state_dict(_model(0.0))["w"], torch.full((2, 3), 5.0))


def test_requests_it_cannot_serve_and_unknown_algorithms_are_refused() -> None:
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_model(3.0), algo="atomic")
    request = {"other": ShardedTensor.from_rank_offsets("other", torch.zeros(1))}
    with pytest.raises(KeyMismatchError, match="'other'"):
        tasd.to_state_dict(request)
    loaded, missing, unexpected = tasd.to_state_dict(request, strict="return_all", return_mismatch_keys=True)
    assert unexpected == {"other"} and missing >= {"w"} and "other" not in loaded
    with pytest.raises(ArgumentTypeError, match="algo"):
        MCoreTensorAwareStateDict.from_state_dict(_model(0.0), algo="two_stage")
