"""dist_ckpt.training.checkpoints on an object store: the run directory is s3://bucket/run (moto server)."""

from __future__ import annotations

import io
import json
import zipfile
from typing import Any, List

import pytest
import torch
from safetensors.torch import save as safetensors_bytes

import dist_ckpt
from dist_ckpt.errors import CheckpointManagementError, CorruptCheckpointError, NotACheckpointError
from dist_ckpt.record.commit import CheckpointingConfig, save_config
from dist_ckpt.storage import StorageError, open_storage
from dist_ckpt.training.checkpoints import (
    CheckpointFormat,
    create_pretrained_symlinks,
    find_latest_checkpoint,
    get_checkpoint_metadata,
    list_checkpoints,
    load_checkpoint_metrics,
    maybe_delete_oldest_checkpoint,
    next_checkpoint_path,
    save_checkpoint_metrics,
    validate_checkpoint,
)
from tests.s3_server import FaultRule

pytestmark = pytest.mark.usefixtures("s3_env")


def _commit(run: str, name: str) -> str:
    """A committed dist_ckpt checkpoint (a stand-in common.pt, then the commit marker)."""
    url = f"{run}/{name}"
    open_storage(url).write("common.pt", b"x")
    save_config(CheckpointingConfig("safetensors"), url)
    return url


def _partial(run: str, name: str) -> str:
    """A save that crashed before its commit: files but no metadata.json."""
    url = f"{run}/{name}"
    open_storage(url).write("common.pt", b"x")
    open_storage(url).write("safetensors/rank00000_0.safetensors", b"y" * 100)
    return url


def _names(run: str) -> List[str]:
    return open_storage(run).list_dirs()


def test_latest_skips_partial_and_unmanaged_directories(s3_url: str) -> None:
    assert find_latest_checkpoint(s3_url) is None  # nothing there yet
    _commit(s3_url, "checkpoint-100")
    _commit(s3_url, "iter_0000200")
    _partial(s3_url, "checkpoint-300")  # crashed save: newer but not complete
    _commit(s3_url, "final")  # no step in the name: not managed
    assert find_latest_checkpoint(s3_url) == f"{s3_url}/iter_0000200"
    assert validate_checkpoint(f"{s3_url}/iter_0000200")
    assert not validate_checkpoint(f"{s3_url}/checkpoint-300")
    assert get_checkpoint_metadata(f"{s3_url}/checkpoint-300") is None  # uncommitted dist_ckpt save
    meta = get_checkpoint_metadata(f"{s3_url}/checkpoint-100")
    assert meta is not None and meta.complete and meta.step == 100 and meta.backend == "safetensors"
    # a storage works as well as a URL
    assert find_latest_checkpoint(open_storage(s3_url)) == f"{s3_url}/iter_0000200"


def test_list_checkpoints_lists_complete_ones_with_metrics(s3_url: str) -> None:
    assert list_checkpoints(s3_url) == []
    _commit(s3_url, "checkpoint-100")
    _commit(s3_url, "iter_0000200")
    _partial(s3_url, "checkpoint-300")
    save_checkpoint_metrics(f"{s3_url}/iter_0000200", {"eval_loss": 1.5})
    found = list_checkpoints(s3_url)
    assert [(c.step, c.path, c.metrics) for c in found] == [
        (100, f"{s3_url}/checkpoint-100", None),
        (200, f"{s3_url}/iter_0000200", {"eval_loss": 1.5}),
    ]


def test_a_corrupt_marker_is_not_complete(s3_url: str) -> None:
    _commit(s3_url, "checkpoint-1")
    open_storage(f"{s3_url}/checkpoint-2").write("metadata.json", b"{not json")
    meta = get_checkpoint_metadata(f"{s3_url}/checkpoint-2")
    assert meta is not None and meta.format is CheckpointFormat.DIST_CKPT and not meta.complete
    assert find_latest_checkpoint(s3_url) == f"{s3_url}/checkpoint-1"


def test_next_checkpoint_path_is_a_url(s3_url: str) -> None:
    assert next_checkpoint_path(s3_url, 1000) == f"{s3_url}/checkpoint-1000"
    assert next_checkpoint_path(s3_url + "/", "iter_0000010") == f"{s3_url}/iter_0000010"


def test_a_real_save_is_found_and_loads(s3_url: str) -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    path = next_checkpoint_path(s3_url, 5)
    dist_ckpt.save({"w": dist_ckpt.ShardedTensor.from_rank_offsets("w", t.clone())}, path)
    latest = find_latest_checkpoint(s3_url)
    assert latest == path
    out = dist_ckpt.load({"w": dist_ckpt.ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4))}, latest)
    assert torch.equal(out["w"], t)


def _hf(url: str, tensors: dict, truncate: int = 0) -> None:
    data = safetensors_bytes(tensors)
    open_storage(url).write("model.safetensors", data[: len(data) - truncate])


def test_hf_weights_are_complete_only_when_whole(s3_url: str) -> None:
    _hf(f"{s3_url}/checkpoint-1", {"a": torch.ones(4)})
    _hf(f"{s3_url}/checkpoint-2", {"a": torch.ones(4)}, truncate=3)
    meta = get_checkpoint_metadata(f"{s3_url}/checkpoint-1")
    assert meta is not None and meta.format is CheckpointFormat.HF and meta.complete and meta.safetensors
    assert not validate_checkpoint(f"{s3_url}/checkpoint-2")
    assert find_latest_checkpoint(s3_url) == f"{s3_url}/checkpoint-1"


def test_hf_index_needs_every_shard(s3_url: str) -> None:
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    for name, complete in (("checkpoint-1", True), ("checkpoint-2", False)):
        storage = open_storage(f"{s3_url}/{name}")
        storage.write("model.safetensors.index.json", json.dumps(index).encode())
        storage.write("model-00001-of-00002.safetensors", safetensors_bytes({"a": torch.ones(2)}))
        if complete:
            storage.write("model-00002-of-00002.safetensors", safetensors_bytes({"b": torch.ones(2)}))
        meta = get_checkpoint_metadata(storage.url)
        assert meta is not None and meta.is_index and meta.complete is complete


def test_torch_weights_need_their_central_directory(s3_url: str) -> None:
    buffer = io.BytesIO()
    torch.save({"a": torch.ones(3)}, buffer)
    data = buffer.getvalue()
    assert zipfile.is_zipfile(io.BytesIO(data))
    open_storage(f"{s3_url}/checkpoint-1").write("pytorch_model.bin", data)
    open_storage(f"{s3_url}/checkpoint-2").write("pytorch_model.bin", data[:-30])  # lost its end record
    assert validate_checkpoint(f"{s3_url}/checkpoint-1")
    assert not validate_checkpoint(f"{s3_url}/checkpoint-2")


def test_rotation_keeps_newest_best_and_preserved(s3_url: str) -> None:
    for step in (1, 2, 3, 4, 5):
        _commit(s3_url, f"checkpoint-{step}")
    _partial(s3_url, "checkpoint-0")  # leftover of a crashed save, below the newest complete one
    _partial(s3_url, "checkpoint-9")  # may be a save in progress: never removed
    maybe_delete_oldest_checkpoint(
        s3_url, 2, best_checkpoint=f"{s3_url}/checkpoint-1", preserved_checkpoints="checkpoint-2"
    )
    # complete: 1 (best), 2 (preserved), 5 (newest) kept; 3 and 4 go (2 allowed, all kept count)
    assert _names(s3_url) == ["checkpoint-1", "checkpoint-2", "checkpoint-5", "checkpoint-9"]
    assert open_storage(f"{s3_url}/checkpoint-3").list() == []  # every object of it is gone
    maybe_delete_oldest_checkpoint(s3_url, 1)
    assert _names(s3_url) == ["checkpoint-5", "checkpoint-9"]
    with pytest.raises(CheckpointManagementError, match="max_checkpoints"):
        maybe_delete_oldest_checkpoint(s3_url, 0)


def test_a_deletion_interrupted_after_the_markers_is_partial(s3_url: str) -> None:
    """Deletion removes the commit marker first: a crash after that leaves a partial directory,
    skipped by find_latest_checkpoint and removed by the next rotation."""
    _commit(s3_url, "checkpoint-1")
    _commit(s3_url, "checkpoint-2")
    open_storage(f"{s3_url}/checkpoint-2").delete("metadata.json")  # what a crash mid-deletion leaves
    assert find_latest_checkpoint(s3_url) == f"{s3_url}/checkpoint-1"
    _commit(s3_url, "checkpoint-3")
    maybe_delete_oldest_checkpoint(s3_url, 5)
    assert _names(s3_url) == ["checkpoint-1", "checkpoint-3"]


def test_a_deletion_that_fails_midway_leaves_no_complete_checkpoint(s3_url: str, s3_env: Any) -> None:
    """The markers go first: when the bulk delete of the rest fails, what remains is partial."""
    _commit(s3_url, "checkpoint-1")
    open_storage(f"{s3_url}/checkpoint-1").write("safetensors/rank00000_0.safetensors", b"z" * 10)
    _commit(s3_url, "checkpoint-2")
    # the 5 marker deletions (metadata.json + 4 HF names) pass, the bulk delete after them is refused
    s3_env.inject_faults([FaultRule(status=403, method="POST", query_contains="delete", skip=5, count=1)])
    with pytest.raises(StorageError):
        maybe_delete_oldest_checkpoint(s3_url, 1)
    s3_env.clear_faults()
    assert open_storage(f"{s3_url}/checkpoint-1").exists("common.pt")  # the rest is still there ...
    assert not validate_checkpoint(f"{s3_url}/checkpoint-1")  # ... but it is no checkpoint any more
    maybe_delete_oldest_checkpoint(s3_url, 1)
    assert _names(s3_url) == ["checkpoint-2"]


def test_metrics_round_trip(s3_url: str) -> None:
    url = _commit(s3_url, "checkpoint-1")
    assert load_checkpoint_metrics(url) is None
    save_checkpoint_metrics(url, {"eval_loss": 2.5, "acc": 1})
    assert load_checkpoint_metrics(url) == {"eval_loss": 2.5, "acc": 1.0}
    with pytest.raises(NotACheckpointError, match="checkpoint-7"):
        save_checkpoint_metrics(f"{s3_url}/checkpoint-7", {"eval_loss": 1.0})
    open_storage(url).write("eval_metrics.json", b"[1, 2]")
    with pytest.raises(CorruptCheckpointError, match="eval_metrics.json"):
        load_checkpoint_metrics(url)


def test_symlinks_are_refused_on_object_stores(s3_url: str) -> None:
    _hf(f"{s3_url}/checkpoint-1", {"a": torch.ones(4)})
    with pytest.raises(CheckpointManagementError, match="no symlinks") as info:
        create_pretrained_symlinks(s3_url)
    assert s3_url in str(info.value)


def test_a_refused_request_is_an_error_not_no_checkpoint(s3_env: Any) -> None:
    with pytest.raises(StorageError, match="no-such-bucket"):
        find_latest_checkpoint("s3://no-such-bucket/run")
    with pytest.raises(StorageError, match="no-such-bucket"):
        validate_checkpoint("s3://no-such-bucket/run/checkpoint-1")
