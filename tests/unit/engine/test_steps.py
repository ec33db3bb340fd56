"""The step names of save, load and convert are one enum: reports and progress events use its values."""

from pathlib import Path

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.engine.steps import Step


def test_a_step_is_its_name() -> None:
    assert Step.SAVE_SHARDED == "saving sharded tensors"
    assert str(Step.COMMIT) == f"{Step.COMMIT}" == "committing metadata.json"
    assert f"{Step.LOAD_SHARDED:>30}".strip() == "loading sharded tensors"
    with pytest.raises(AttributeError):
        Step.SAVE_SHARDD  # type: ignore[attr-defined]  # noqa: B018


def test_every_phase_of_a_save_and_a_load_is_a_step(tmp_path: Path) -> None:
    sd = {"w": dc.ShardedTensor.from_rank_offsets("w", torch.arange(8.0)), "step": 3}
    saved = dc.save_with_report(sd, tmp_path / "ckpt").report
    request = {"w": dc.ShardedTensor.from_rank_offsets("w", torch.empty(8))}
    loaded = dc.load_with_report(request, tmp_path / "ckpt").report
    values = {s.value for s in Step}
    assert [p.name for p in saved.phases if p.name not in values] == []
    assert [p.name for p in loaded.phases if p.name not in values] == []
    assert saved.phase_seconds(Step.SAVE_SHARDED) == saved.phase_seconds("saving sharded tensors") > 0
    assert loaded.phases[-1].name == Step.ASSEMBLE
