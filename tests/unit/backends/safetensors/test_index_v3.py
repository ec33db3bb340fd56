"""Unit tests of safetensors index version 3 (index_parts, index_v3, index_write): the binary shard
table, read lazily and checked per tensor, and the merge of the ranks' parts on rank 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

from dist_ckpt.backends.safetensors.index import INDEX_FILENAME, SAFETENSORS_DIR, read_index
from dist_ckpt.backends.safetensors.index_parts import IndexPart, merge_index_parts
from dist_ckpt.backends.safetensors.index_v3 import TableTensor
from dist_ckpt.backends.safetensors.strategy import (
    SafetensorsLoadShardedStrategy,
    SafetensorsSaveOptions,
    SafetensorsSaveShardedStrategy,
)
from dist_ckpt.backends.safetensors.write import PartResult, plan_file
from dist_ckpt.errors import CheckpointingException, CorruptCheckpointError
from dist_ckpt.integrity.checksums import crc32c, crc_to_hex
from dist_ckpt.model.sharded import ShardedTensor


def save(sd: Dict[str, ShardedTensor], path: Path, **options) -> None:
    SafetensorsSaveShardedStrategy(SafetensorsSaveOptions(**options)).save(sd, path)


def load(sd: Dict[str, ShardedTensor], path: Path) -> Dict[str, torch.Tensor]:
    return SafetensorsLoadShardedStrategy().load(sd, path)


def many_tensors(n: int = 40, parts: int = 4) -> Dict[str, ShardedTensor]:
    """``n`` tensors, each split into ``parts`` row chunks held by "virtual ranks" of one process."""
    sd = {}
    for i in range(n):
        full = torch.arange(parts * 6, dtype=torch.float32).reshape(parts * 2, 3) + i
        for p in range(parts):
            sd[f"t{i}@{p}"] = ShardedTensor.from_rank_offsets(f"t{i}", full[2 * p : 2 * p + 2].clone(), (0, p, parts))
    return sd


def doc_of(path: Path) -> dict:
    return json.loads((path / SAFETENSORS_DIR / INDEX_FILENAME).read_text())


def test_every_kind_of_shard_round_trips(tmp_path: Path) -> None:
    flat = torch.arange(24, dtype=torch.float32)
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 3), (0, 0, 2)),
        "w1": ShardedTensor.from_rank_offsets("w", torch.ones(2, 3) * 2, (0, 1, 2)),
        "stacked": ShardedTensor.from_rank_offsets(
            "s", torch.ones(4, dtype=torch.bfloat16), (0, 1, 3), prepend_axis_num=1
        ),
        "f0": ShardedTensor.from_rank_offsets_flat("f", flat[:7].clone(), (4, 6), flattened_range=slice(0, 7)),
        "f1": ShardedTensor.from_rank_offsets_flat("f", flat[7:].clone(), (4, 6), flattened_range=slice(7, 24)),
        "scalar": ShardedTensor.from_rank_offsets("scalar", torch.tensor(3.0, dtype=torch.float64)),
        "empty": ShardedTensor.from_rank_offsets("empty", torch.zeros(0, 5)),
    }
    save(sd, tmp_path, thread_count=3, checksum_block_bytes=8)
    index = read_index(tmp_path)
    assert sorted(index.tensors) == ["empty", "f", "s", "scalar", "w"]
    assert all(isinstance(t, TableTensor) for t in index.tensors.values())
    s = index.tensors["s"]
    assert s.global_shape == (3, 4) and s.dtype == torch.bfloat16
    (shard,) = s.shards
    assert shard.global_offset == (1, 0) and shard.chunk_shape == (1, 4) and shard.name == "s@1.0"
    assert sorted(sh.flat_range for sh in index.tensors["f"].shards) == [(0, 7), (7, 24)]
    assert {sh.name for sh in index.tensors["f"].shards} == {"f@0.0+0", "f@0.0+7"}
    assert index.tensors["empty"].shards == [] and index.tensors["scalar"].shards[0].global_offset == ()
    for sh in index.tensors["f"].shards:
        assert sh.crcs is not None and len(sh.crcs) == -(-(sh.byte_range[1] - sh.byte_range[0]) // 8)
    request = {
        "f": ShardedTensor.from_rank_offsets("f", torch.empty(4, 6)),
        "s": ShardedTensor.from_rank_offsets("s", torch.empty(4, dtype=torch.bfloat16), (0, 1, 3), prepend_axis_num=1),
        "scalar": ShardedTensor.from_rank_offsets("scalar", torch.empty((), dtype=torch.float64)),
    }
    out = load(request, tmp_path)
    assert torch.equal(out["f"].flatten(), flat) and out["s"].eq(1).all() and out["scalar"].item() == 3.0


def test_a_load_reads_only_the_rows_it_needs(tmp_path: Path) -> None:
    save(many_tensors(), tmp_path)
    index = read_index(tmp_path)
    request = {"x": ShardedTensor.from_rank_offsets("t7", torch.empty(2, 3), (0, 1, 4))}
    from dist_ckpt.backends.safetensors.io import ReadOptions
    from dist_ckpt.backends.safetensors.load import load_from_index

    out = load_from_index(request, index, ReadOptions())
    assert torch.equal(out["x"], torch.arange(6, 12, dtype=torch.float32).reshape(2, 3) + 7)
    t7 = index.tensors["t7"]
    assert isinstance(t7, TableTensor)
    assert list(t7._table._checked) == ["t7"]  # no other tensor's rows were read or checked
    assert len(t7._made) == 1  # and only the one overlapping shard became an object


def _rewrite_rows(path: Path, key: str, change) -> None:  # type: ignore[no-untyped-def]
    """Change a tensor's rows in the shard table and record the rows' new crc (a consistent lie)."""
    doc = doc_of(path)
    table = path / SAFETENSORS_DIR / doc["shard_table"]["file"]
    spec, entry = doc["shard_table"], doc["tensors"][key]
    width = 5 + 2 * spec["ndim"]
    raw = np.fromfile(table, dtype=np.uint8)
    rows = raw[: spec["rows"] * width * 8].view("<i8").reshape(spec["rows"], width)
    crcs = raw[spec["rows"] * width * 8 :].view("<u4")
    first, count = entry["rows"]
    change(rows[first : first + count])
    b0, bn = entry["blocks"]
    crc = crc32c(crcs[b0 : b0 + bn].tobytes(), crc32c(rows[first : first + count].tobytes()))
    entry["table_crc32c"] = crc_to_hex(crc)
    raw.tofile(table)
    (path / SAFETENSORS_DIR / INDEX_FILENAME).write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "column, value, message",
    [
        (0, 99, "names a file the index does not list"),
        (5, 7, "has a box outside"),
        (1, 3, "bad flat range"),
        (4, 10**9, "byte range outside its file"),
        (4, -5, "byte range outside its file"),
        (3, 0, "not its elements times 4"),
    ],
)
def test_rows_are_checked_before_any_read(tmp_path: Path, column: int, value: int, message: str) -> None:
    save(many_tensors(3), tmp_path)

    def change(rows: np.ndarray) -> None:
        rows[0, column] = value

    _rewrite_rows(tmp_path, "t1", change)
    with pytest.raises(CorruptCheckpointError, match=message) as info:
        load({"x": ShardedTensor.from_rank_offsets("t1", torch.empty(8, 3))}, tmp_path)
    assert "'t1'" in str(info.value) and INDEX_FILENAME in str(info.value)
    out = load({"x": ShardedTensor.from_rank_offsets("t2", torch.empty(8, 3))}, tmp_path)  # the others still load
    assert torch.equal(out["x"], torch.arange(24, dtype=torch.float32).reshape(8, 3) + 2)


def test_a_damaged_table_is_reported_for_the_tensor_it_touches(tmp_path: Path) -> None:
    save(many_tensors(3), tmp_path)
    doc = doc_of(tmp_path)
    table = tmp_path / SAFETENSORS_DIR / doc["shard_table"]["file"]
    raw = bytearray(table.read_bytes())
    first = doc["tensors"]["t1"]["rows"][0]
    raw[first * (5 + 2 * 2) * 8 + 3 * 8] ^= 1  # a bit of t1's first byte range
    table.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="table is damaged") as info:
        load({"x": ShardedTensor.from_rank_offsets("t1", torch.empty(8, 3))}, tmp_path)
    assert "'t1'" in str(info.value)
    load({"x": ShardedTensor.from_rank_offsets("t0", torch.empty(8, 3))}, tmp_path)
    report = SafetensorsLoadShardedStrategy().verify_integrity(tmp_path)
    assert any("'t1'" in str(p) and "damaged" in str(p) for p in report.problems), report.problems


def test_a_missing_or_truncated_table(tmp_path: Path) -> None:
    save(many_tensors(2), tmp_path)
    table = tmp_path / SAFETENSORS_DIR / doc_of(tmp_path)["shard_table"]["file"]
    request = {"x": ShardedTensor.from_rank_offsets("t1", torch.empty(8, 3))}
    table.write_bytes(table.read_bytes()[:-4])
    with pytest.raises(CorruptCheckpointError, match="bytes, the index says"):
        load(request, tmp_path)
    table.unlink()
    with pytest.raises(CorruptCheckpointError, match="is missing"):
        load(request, tmp_path)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["shard_table"].update(file="../x.bin"), "index.<crc>.bin"),
        (lambda d: d["shard_table"].update(rows=-1), "'rows'"),
        (lambda d: d["shard_table"].update(size=3), "does not match"),
        (lambda d: d["shard_table"].update(columns=["file"]), "'columns'"),
        (lambda d: d.update(files={}), "'files' must be a list"),
        (lambda d: d["files"].append(dict(d["files"][0])), "lists a file twice"),
        (lambda d: d["files"][0].update(name="a/b"), "plain file name"),
        (lambda d: d["tensors"]["t0"].update(rows=[0, 10**6]), "outside the shard table"),
        (lambda d: d["tensors"]["t0"].update(global_shape=[1, 2, 3, 4]), "'global_shape'"),
        (lambda d: d["tensors"]["t0"].update(dtype="float99"), "float99"),
        (lambda d: d.update(tensors=[]), "'tensors' must be a JSON object"),
    ],
)
def test_malformed_document(tmp_path: Path, mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    save(many_tensors(2), tmp_path)
    doc = doc_of(tmp_path)
    mutate(doc)
    (tmp_path / SAFETENSORS_DIR / INDEX_FILENAME).write_text(json.dumps(doc))
    with pytest.raises(CorruptCheckpointError, match=message) as info:
        load({"x": ShardedTensor.from_rank_offsets("t0", torch.empty(8, 3))}, tmp_path)
    assert INDEX_FILENAME in str(info.value)


def _part(rank: int, shards: List[ShardedTensor], checksums: bool = False, writer: int = -1) -> bytes:
    items = [(f"{sh.key}@{rank}", sh.dtype, tuple(sh.local_shape)) for sh in shards]
    plan = plan_file(f"rank{rank if writer < 0 else writer:05d}_0.safetensors", items, {})
    result = PartResult(plan.name, 0, tuple("00000000" if checksums else "" for _ in shards), None)
    return IndexPart(rank, shards, [(plan, shards)]).encode([result], checksums)


def test_merge_orders_tensors_by_key_and_rows_by_rank() -> None:
    parts = [
        _part(r, [ShardedTensor.from_rank_offsets(k, torch.zeros(2), (0, r, 2)) for k in ("b", "a")]) for r in range(2)
    ]
    merged = merge_index_parts(parts)
    assert merged.keys == ["a", "b"] and merged.shapes == [(4,), (4,)] and merged.dtypes == ["float32"] * 2
    assert merged.key_rows.tolist() == [[0, 2], [2, 2]]
    assert merged.rows[:, 0].tolist() == [0, 1, 0, 1]  # file ids: rank 0's file, then rank 1's
    assert merged.rows[:, 5].tolist() == [0, 2, 0, 2]  # offsets along the split axis
    assert [f[0] for f in merged.files] == ["rank00000_0.safetensors", "rank00001_0.safetensors"]


def test_merge_records_a_tensor_saved_as_flattened_ranges_by_any_rank() -> None:
    """A rank whose main replicas of a flattened tensor hold no element still lists the key; the
    merged index marks the tensor flattened when any rank saved it so."""
    whole = [ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, r, 2)) for r in range(2)]
    flat = [
        ShardedTensor.from_rank_offsets_flat("f", torch.zeros(n), (2, 2), flattened_range=slice(a, a + n))
        for a, n in ((0, 4), (4, 0))
    ]
    merged = merge_index_parts([_part(r, [whole[r], flat[r]]) for r in range(2)])
    assert merged.keys == ["f", "w"] and merged.flattened == [True, False]


def test_flattened_mark_survives_a_removal(tmp_path: Path) -> None:
    flat = torch.arange(24, dtype=torch.float32)
    sd = {
        "f0": ShardedTensor.from_rank_offsets_flat("f", flat[:7].clone(), (4, 6), flattened_range=slice(0, 7)),
        "f1": ShardedTensor.from_rank_offsets_flat("f", flat[7:].clone(), (4, 6), flattened_range=slice(7, 24)),
        "w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 3)),
        "x": ShardedTensor.from_rank_offsets("x", torch.ones(3)),
    }
    save(sd, tmp_path)
    assert [k for k, t in doc_of(tmp_path)["tensors"].items() if t.get("flattened")] == ["f"]
    SafetensorsLoadShardedStrategy().remove_sharded_tensors(tmp_path, "x")
    index = read_index(tmp_path)
    assert sorted(index.tensors) == ["f", "w"] and index.tensors["f"].flattened and not index.tensors["w"].flattened
    assert [k for k, t in doc_of(tmp_path)["tensors"].items() if t.get("flattened")] == ["f"]


def test_merge_refuses_disagreeing_ranks() -> None:
    a = _part(0, [ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, 0, 2))])
    b = _part(1, [ShardedTensor.from_rank_offsets("w", torch.zeros(3), (0, 1, 2))])
    with pytest.raises(CheckpointingException, match=r"tensor 'w': rank 1 saves it as float32 \[6\].*\[4\]"):
        merge_index_parts([a, b])
    c = _part(1, [ShardedTensor.from_rank_offsets("w", torch.zeros(2, dtype=torch.int32), (0, 1, 2))])
    with pytest.raises(CheckpointingException, match="int32"):
        merge_index_parts([a, c])
    e = _part(1, [ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, 1, 2))], writer=0)
    with pytest.raises(CheckpointingException, match="ranks 0 and 1 both wrote 'rank00000_0.safetensors'"):
        merge_index_parts([a, e])
    with pytest.raises(CheckpointingException, match="rank 1 is not an index part"):
        merge_index_parts([a, a])  # a part that says it is rank 0's, from rank 1
    d = _part(1, [ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, 1, 2))], checksums=True)
    with pytest.raises(CheckpointingException, match="checksums"):
        merge_index_parts([a, d])


def test_on_an_object_store(s3_url: str, s3_env: Any) -> None:
    """The table is an object beside the files; a removal writes a new table object and deletes the old."""
    import dist_ckpt as dc
    from dist_ckpt.storage import open_storage

    dc.save(many_tensors(3), s3_url, sharded_strategy=("safetensors", 1))
    storage = open_storage(s3_url)
    tables = [o.key for o in storage.list("safetensors") if o.key.endswith(".bin")]
    assert len(tables) == 1
    request = {"x": ShardedTensor.from_rank_offsets("t2", torch.empty(8, 3))}
    assert torch.equal(dc.load(request, s3_url)["x"], torch.arange(24, dtype=torch.float32).reshape(8, 3) + 2)
    dc.remove_sharded_tensors(s3_url, "t1")
    after = [o.key for o in storage.list("safetensors") if o.key.endswith(".bin")]
    assert len(after) == 1 and after != tables
    assert set(dc.load_tensors_metadata(s3_url)) == {"t0", "t2"}
    assert torch.equal(dc.load(request, s3_url)["x"], torch.arange(24, dtype=torch.float32).reshape(8, 3) + 2)
    assert dc.verify_checkpoint(s3_url).ok


@pytest.mark.parametrize("pieces", [3, 12])  # searched in Python (few rows) and with numpy (many)
def test_flattened_ranges_reshard_exactly(tmp_path: Path, pieces: int) -> None:
    """Stored flattened ranges are found by box and by range; any other cut loads the same values."""
    rng = np.random.default_rng(pieces)
    full = torch.arange(2 * 6 * 5, dtype=torch.float32).reshape(2, 6, 5)  # two chunks of (6, 5) along axis 0

    def cuts(n: int) -> List[int]:
        return [0, *sorted(rng.choice(np.arange(1, 30), n - 1, replace=False).tolist()), 30]

    def flat_state(parts: int, empty: bool) -> Dict[str, ShardedTensor]:
        sd = {}
        for c in range(2):
            chunk = full[c].flatten()
            points = cuts(parts)
            for i, (a, b) in enumerate(zip(points[:-1], points[1:])):
                data = torch.zeros(b - a) if empty else chunk[a:b].clone()
                sd[f"{c}.{i}"] = ShardedTensor.from_rank_offsets_flat(
                    "f", data, (1, 6, 5), (0, c, 2), flattened_range=slice(a, b)
                )
        return sd

    save(flat_state(pieces, empty=False), tmp_path)
    for _ in range(5):
        request = flat_state(int(rng.integers(1, 6)), empty=True)
        ranges = {name: sh.flattened_range for name, sh in request.items()}
        out = load(request, tmp_path)  # (replaces the request's values by tensors)
        for name, rng_slice in ranges.items():
            c = int(name.split(".")[0])
            assert torch.equal(out[name], full[c].flatten()[rng_slice]), name
    whole = load({"w": ShardedTensor.from_rank_offsets("f", torch.empty(2, 6, 5))}, tmp_path)
    assert torch.equal(whole["w"], full)
