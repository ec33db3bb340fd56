"""Seeded fuzzing of every metadata parser: more than 10,000 malformed documents.

Each parser of checkpoint metadata -- metadata.json, the safetensors index and file headers,
zarr.json nodes, checksum manifests (torch_dist's too), torch_dist's ``dist_ckpt.json``,
HuggingFace indexes, the save-in-progress record -- gets mutations of a valid document: random
bytes, truncations, flipped bytes, values of wrong types at every node (huge and negative numbers,
floats, lone surrogates, long strings, deep nesting), nesting far beyond any real document, and
non-UTF-8 text; DCP's ``.metadata`` pickle gets random bytes, truncations and flipped bytes.
Every call must return or raise a CheckpointingException; nothing else (RecursionError, KeyError,
UnicodeEncodeError, torch's "Storage size calculation overflowed"...) may escape.

Then whole loads: metadata files of a real checkpoint are mutated *and re-signed* (their
checksum entries and integrity records updated, as a consistent forgery would be), so that the
mutation reaches the parsers behind the checksums; each load must raise a typed error or return
exactly what was saved.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest

import dist_ckpt as dc
from dist_ckpt.backends.safetensors.format import read_header_at
from dist_ckpt.backends.safetensors.index import parse_index
from dist_ckpt.backends.safetensors.index import tensors_metadata as safetensors_tensors_metadata
from dist_ckpt.backends.torch_dist.checksums import parse_manifest
from dist_ckpt.backends.torch_dist.layout import parse_layout
from dist_ckpt.backends.torch_dist.metadata import unpickle_metadata
from dist_ckpt.backends.zarr.metadata import open_tensor_info
from dist_ckpt.backends.zarr.metadata import tensors_metadata as zarr_tensors_metadata
from dist_ckpt.engine.save_claim import IN_PROGRESS_FILENAME, SaveClaim
from dist_ckpt.hf.index import load_shard_index
from dist_ckpt.integrity.checksums import bytes_digest, crc_to_hex, parse_manifest_bytes
from dist_ckpt.integrity.records import record_of
from dist_ckpt.integrity.safe_json import loads
from dist_ckpt.record.commit import RECORD_FILENAME, read_config, read_integrity_records, read_save_record
from dist_ckpt.storage import LocalStorage
from dist_ckpt.storage.object_path import ObjectPath
from tests.json_damage import (
    Damage,
    Node,
    damaged_documents,
    flipped_byte,
    json_nodes,
    random_bytes,
    set_node,
    truncated,
)

from . import tally
from .scenario import check_loads, state, strategy

#: mutations per parser (10 JSON parsers: 13,000 documents; and as many damaged DCP pickles)
PER_PARSER = 1300
#: whole-load mutations per backend
LOADS = 120

_WRONG: List[Any] = [
    None,
    True,
    0,
    -1,
    2**63,
    2**70,
    -(2**64),
    10**30,
    1.5,
    -0.0,
    "",
    "x",
    "\ud800",
    "é" * 300,
    "a" * 5000,
    [],
    [1, "a"],
    [2**62, 2**62],
    [-1, 0],
    {},
    {"a": None},
    {"\udfff": 1},
]


def _deeply_nested(raw: bytes, rng: random.Random, nodes: List[Node]) -> Damage:
    return "deeply nested", b"[" * rng.randrange(100, 200_000) + b"1"


def _nested_at_a_node(raw: bytes, rng: random.Random, nodes: List[Node]) -> Damage:
    if not nodes:
        return _wrong_types(raw, rng, nodes)
    mutated = json.loads(raw)
    node = rng.choice(nodes)
    set_node(mutated, node, "__deep__")
    depth = rng.randrange(30, 3000)
    text = json.dumps(mutated).replace('"__deep__"', "[" * depth + "1" + "]" * depth, 1)
    return f"{node} nested {depth} deep", text.encode()


def _not_utf8(raw: bytes, rng: random.Random, nodes: List[Node]) -> Damage:
    return "not UTF-8", raw.replace(b'"', b'"\xff', 1)


def _wrong_types(raw: bytes, rng: random.Random, nodes: List[Node]) -> Damage:
    mutated = json.loads(raw)
    for _ in range(rng.randrange(1, 3)):
        if nodes:
            node = rng.choice(nodes)
            try:
                # a copy: a second change may go inside the first one's value, which must not be
                # _WRONG's own list (it would change for later documents, or contain itself)
                set_node(mutated, node, copy.deepcopy(rng.choice(_WRONG)))
            except (KeyError, IndexError, TypeError):  # the node went with an earlier change
                pass
    return f"wrong types at {len(nodes)} nodes", json.dumps(mutated).encode("utf-8", "surrogatepass")


_KINDS = (
    random_bytes(80),
    truncated,
    flipped_byte,
    _deeply_nested,
    _nested_at_a_node,
    _not_utf8,
    _wrong_types,
    _wrong_types,
)


def mutations(raw: bytes, rng: random.Random, count: int) -> List[Tuple[str, bytes]]:
    """``count`` seeded mutations of the JSON document ``raw`` (see the module docstring)."""
    return damaged_documents(raw, rng, count, _KINDS)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz")
    out = {}
    for backend in ("safetensors", "zarr", "torch_dist"):
        dc.save(state(2.0), root / backend, sharded_strategy=strategy(backend))
        out[backend] = root / backend
    return out


def _parsers(saved: Dict[str, Path], scratch: Path) -> List[Tuple[str, bytes, Callable[[bytes], Any]]]:
    """(name, a valid document, a call that parses a document of that kind)."""
    st, zr, td = saved["safetensors"], saved["zarr"], saved["torch_dist"]
    scratch.mkdir(parents=True, exist_ok=True)
    data_file = next((st / "safetensors").glob("*.safetensors"))
    data = data_file.read_bytes()
    header_len = int.from_bytes(data[:8], "little")

    def metadata_json(raw: bytes) -> Any:
        (scratch / "metadata.json").write_bytes(raw)
        return read_config(scratch), read_integrity_records(scratch)

    def index_json(raw: bytes) -> Any:
        return safetensors_tensors_metadata(parse_index(loads(raw, "index.json"), LocalStorage(st / "safetensors")))

    def header(raw: bytes) -> Any:
        path = scratch / "x.safetensors"
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + header_len :])
        return read_header_at(path)

    shutil.copytree(zr / "zarr", scratch / "zarr")
    (scratch / "zarr" / "checksums.json").unlink()  # parsed without the manifest: the fuzz reaches the parser
    root = ObjectPath(LocalStorage(scratch)) / "zarr"

    def zarr_json(name: str) -> Callable[[bytes], Any]:
        node = scratch / "zarr" / name / "zarr.json"
        original = node.read_bytes()

        def parse(raw: bytes) -> Any:
            node.write_bytes(raw)
            try:
                return open_tensor_info(root, name.split("/")[0]), zarr_tensors_metadata(root)
            finally:
                node.write_bytes(original)

        return parse

    def hf_index(raw: bytes) -> Any:
        (scratch / "model.safetensors.index.json").write_bytes(raw)
        return load_shard_index(scratch, "model.safetensors.index.json")

    (scratch / "torch_dist").mkdir()
    shutil.copyfile(td / "metadata.json", scratch / "torch_dist" / "metadata.json")

    def save_record(raw: bytes) -> Any:
        (scratch / "torch_dist" / RECORD_FILENAME).write_bytes(raw)
        return read_save_record(scratch / "torch_dist"), read_integrity_records(scratch / "torch_dist")

    hf_doc = json.dumps({"metadata": {"total_size": 10}, "weight_map": {"a": "model-1.safetensors"}}).encode()
    claim = SaveClaim("ab" * 16, ("safetensors", "common.pt")).to_bytes()
    return [
        ("metadata.json", (st / "metadata.json").read_bytes(), metadata_json),
        ("safetensors index.json", (st / "safetensors" / "index.json").read_bytes(), index_json),
        ("safetensors header", data[8 : 8 + header_len], header),
        ("zarr.json of an array", (zr / "zarr" / "w" / "zarr.json").read_bytes(), zarr_json("w")),
        ("zarr.json of a flattened group", (zr / "zarr" / "f" / "zarr.json").read_bytes(), zarr_json("f")),
        ("checksum manifest", (zr / "zarr" / "checksums.json").read_bytes(), lambda r: parse_manifest_bytes(r, "m")),
        ("HuggingFace index", hf_doc, hf_index),
        ("torch_dist checksum manifest", (td / "torch_dist.checksums.json").read_bytes(), torch_dist_manifest),
        ("dist_ckpt.json", (td / RECORD_FILENAME).read_bytes(), save_record),
        (IN_PROGRESS_FILENAME, claim, lambda r: SaveClaim.parse(r, IN_PROGRESS_FILENAME)),
    ]


def torch_dist_manifest(raw: bytes) -> Any:
    return parse_manifest(raw, "torch_dist.checksums.json")


def test_wrong_types_never_share_or_change_the_wrong_values():
    """Two changes to one document may nest (the second inside the first one's value): each must
    get its own copy, or the document could contain itself and _WRONG change for later seeds."""
    raw = json.dumps({"a": {"b": [1, 2, {"c": "d"}]}, "e": [0, 1]}).encode()
    wrong_before = json.dumps(_WRONG, default=repr)
    nodes = json_nodes(json.loads(raw))
    for seed in range(3000):
        _wrong_types(raw, random.Random(seed), nodes)  # shared values: "Circular reference"
    assert json.dumps(_WRONG, default=repr) == wrong_before


def test_every_parser_survives_malformed_documents(saved, tmp_path):
    row = "malformed metadata, every parser"
    for name, valid, parse in _parsers(saved, tmp_path / "scratch"):
        parse(valid)  # the unmutated document parses
        rng = random.Random(f"dist_ckpt-fuzz/{name}")
        for what, raw in mutations(valid, rng, PER_PARSER):

            def attempt(raw: bytes = raw) -> None:
                try:
                    parse(raw)
                except dc.CheckpointingException:
                    pass

            tally.attempt(row, f"{name}: {what}", attempt, seconds=30)
    assert tally.ROWS[row].counts["attempts"] >= 10_000
    tally.assert_clean(row)


def test_damaged_dcp_metadata_pickles(saved):
    """DCP's ``.metadata`` is a pickle, read by a restricted unpickler: random bytes, truncations
    and flipped bytes must give a typed error or metadata that parses into a layout."""
    valid = (saved["torch_dist"] / ".metadata").read_bytes()
    parse_layout(unpickle_metadata(valid, ".metadata"), ".metadata")
    rng = random.Random("dist_ckpt-fuzz/.metadata")
    row = "malformed metadata, DCP .metadata pickle"
    for i in range(PER_PARSER):
        kind = i % 3
        if kind == 0:
            what, raw = "random bytes", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80)))
        elif kind == 1:
            what, raw = "truncated", valid[: rng.randrange(len(valid))]
        else:
            damaged = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                damaged[rng.randrange(len(valid))] = rng.randrange(256)
            what, raw = "flipped bytes", bytes(damaged)

        def attempt(raw: bytes = raw) -> None:
            try:
                parse_layout(unpickle_metadata(raw, ".metadata"), ".metadata")
            except dc.CheckpointingException:
                pass

        tally.attempt(row, what, attempt, seconds=30)
    tally.assert_clean(row)


def _resign(ckpt: Path, rel: str) -> None:
    """Make the mutated file ``rel`` consistent with the checkpoint's checksums, as a forger
    would: its entry in the manifest that lists it, and the records in metadata.json."""
    manifests = {"zarr/": "zarr/checksums.json", "objects/": "objects/checksums.json"}
    for prefix, manifest in manifests.items():
        if rel.startswith(prefix) and rel != manifest and (ckpt / manifest).is_file():
            doc = json.loads((ckpt / manifest).read_text())
            name = rel[len(prefix) :]
            if name in doc["files"]:
                digest = bytes_digest((ckpt / rel).read_bytes())
                doc["files"][name] = {"size": digest.size, "crc32c": crc_to_hex(digest.crc32c)}
                (ckpt / manifest).write_text(json.dumps(doc))
    meta = json.loads((ckpt / "metadata.json").read_text())
    for key in meta.get("integrity_records", {}):
        meta["integrity_records"][key] = record_of((ckpt / key).read_bytes()).to_json()
    (ckpt / "metadata.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("backend", ["safetensors", "zarr"])
def test_whole_loads_of_forged_metadata(saved, tmp_path, backend):
    pristine = saved[backend]
    files = sorted(
        str(p.relative_to(pristine))
        for p in pristine.rglob("*.json")
        if p.name != "metadata.json" and "objects" not in p.parts[-2:-1]
    )
    rng = random.Random(f"dist_ckpt-forged/{backend}")
    row = f"forged metadata, whole load, {backend}"
    target = tmp_path / "ckpt"
    for i in range(LOADS):
        rel = files[i % len(files)]
        what, raw = mutations((pristine / rel).read_bytes(), rng, 8)[rng.randrange(8)]

        def attempt(rel: str = rel, raw: bytes = raw) -> None:
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(pristine, target)
            (target / rel).write_bytes(raw)
            _resign(target, rel)
            try:
                check_loads(target, 2.0)
            except dc.CheckpointingException:
                pass

        tally.attempt(row, f"{rel}: {what}", attempt, seconds=60)
    assert os.path.isdir(pristine)
    tally.assert_clean(row)
