"""TierConfig checks its values on construction; the local tier's memory bound."""

from __future__ import annotations

import pytest

from dist_ckpt.errors import CheckpointManagementError
from dist_ckpt.tiers import TierConfig, local_tier_bytes


def test_defaults_and_persist_schedule() -> None:
    config = TierConfig(local_dir="/dev/shm/run", persist_every=3)
    assert [i for i in range(1, 10) if config.persists(i)] == [3, 6, 9]


@pytest.mark.parametrize(
    ("field", "value"), [("replicas", -1), ("persist_every", 0), ("keep_local", 0), ("replicas", True)]
)
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(CheckpointManagementError, match=field):
        TierConfig(local_dir="/dev/shm/run", **{field: value})  # type: ignore[arg-type]


def test_empty_local_dir_is_refused() -> None:
    with pytest.raises(CheckpointManagementError, match="local_dir"):
        TierConfig(local_dir="")


def test_memory_bound() -> None:
    config = TierConfig(local_dir="/x", replicas=2, keep_local=2)
    assert local_tier_bytes(1000, config) == 6000
    with pytest.raises(CheckpointManagementError):
        local_tier_bytes(-1, config)
