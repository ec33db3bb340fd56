"""torch_dist on an object store: DCP's file reader and writer need local files, so the strategies
are refused there by the storage's capability (``local_paths``) before any byte moves; what reads
through the storage alone -- ``.metadata`` and ``dist-ckpt verify``'s checks of the DCP files --
works on any storage."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import dist_ckpt as dc
from dist_ckpt.backends.torch_dist.metadata import read_metadata
from dist_ckpt.backends.torch_dist.verify import verify_torch_dist
from dist_ckpt.errors import IncompatibleStrategyError
from dist_ckpt.storage import open_storage
from dist_ckpt.tools.verify import verify_checkpoint
from tests.torch_dist_golden import fixture_dir


def _upload(name: str, url: str) -> None:
    storage = open_storage(url)
    for path in sorted(fixture_dir(name).iterdir()):
        storage.write(path.name, path.read_bytes())


def test_a_save_to_an_object_store_is_refused_before_writing(s3_url: str, s3_env: Any) -> None:
    sd = {"w": dc.ShardedTensor.from_rank_offsets("w", torch.ones(4))}
    with pytest.raises(IncompatibleStrategyError, match="object storage"):
        dc.save(sd, s3_url, sharded_strategy=("torch_dist", 1))
    assert open_storage(s3_url).list() == []


def test_a_checkpoint_on_an_object_store_is_refused_by_load_and_read_by_verify(s3_url: str, s3_env: Any) -> None:
    _upload("tp2", s3_url)
    sd = {"w": dc.ShardedTensor.from_rank_offsets("embedding.word_embeddings.weight", torch.empty(16, 8))}
    with pytest.raises(IncompatibleStrategyError, match=s3_url):
        dc.load(sd, s3_url)
    assert sorted(read_metadata(s3_url).state_dict_metadata) == sorted(
        read_metadata(fixture_dir("tp2")).state_dict_metadata
    )
    direct = verify_torch_dist(s3_url)
    assert direct.problems == [] and any("no checksums recorded" in n for n in direct.notes)
    assert direct.bytes_checked == verify_torch_dist(fixture_dir("tp2")).bytes_checked > 0
    report = verify_checkpoint(s3_url)
    assert not report.ok and any("cannot check the 'torch_dist' part" in str(p) for p in report.problems)
