"""Every kind of damage to every file of a committed checkpoint, on every backend.

Kinds: a flipped byte (at seeded positions), truncation (to half, and by one byte), deletion,
a swap with the same file of another checkpoint of the same layout, appended bytes, and for
integrity records (checksum manifests, the safetensors index) their removal or downgrade (an
index rewritten as version 1, a manifest without the entry of a file). After each, a load of
everything must raise a typed error or return exactly what was saved, and ``verify`` may only
say "ok" if the load is right.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest

import dist_ckpt as dc
from tests.unit.backends.safetensors.legacy_index import downgrade_index_to_v1

from . import tally
from .scenario import SilentWrong, check_loads, state, strategy

BACKENDS = ["safetensors", "zarr", "torch_dist"]
Damage = Callable[[Path, Path], None]  # (file, the same file in the other checkpoint)


def _flip(at: float) -> Damage:
    def damage(f: Path, _: Path) -> None:
        raw = bytearray(f.read_bytes())
        raw[int(at * (len(raw) - 1))] ^= 0x10
        f.write_bytes(bytes(raw))

    return damage


def _truncate(keep: Callable[[int], int]) -> Damage:
    def damage(f: Path, _: Path) -> None:
        raw = f.read_bytes()
        f.write_bytes(raw[: keep(len(raw))])

    return damage


def _delete(f: Path, _: Path) -> None:
    f.unlink()


def _swap(f: Path, other: Path) -> None:
    shutil.copyfile(other, f)


def _append(f: Path, _: Path) -> None:
    with open(f, "ab") as out:
        out.write(b'\n{"x": 1}\x00')


def _downgrade(f: Path, _: Path) -> None:
    """An index rewritten as version 1 (no checksums); a manifest that lost an entry; a save
    record (torch_dist's ``dist_ckpt.json``) that lost an integrity record."""
    if f.name == "index.json":
        downgrade_index_to_v1(f.parent.parent)
        return
    doc = json.loads(f.read_text())
    entries = doc["integrity_records"] if f.name == "dist_ckpt.json" else doc["files"]
    entries.pop(sorted(entries)[0])
    f.write_text(json.dumps(doc))


def _damages(seed: str) -> List[Tuple[str, Damage]]:
    rng = random.Random(seed)
    flips = [(f"flip@{p:.2f}", _flip(p)) for p in [0.0, 0.5, 1.0] + [rng.random() for _ in range(3)]]
    return flips + [
        ("truncate to half", _truncate(lambda n: n // 2)),
        ("truncate by 1 byte", _truncate(lambda n: n - 1)),
        ("delete", _delete),
        ("swap with another checkpoint's", _swap),
        ("append", _append),
    ]


_RECORDS = {"index.json", "checksums.json", "common.checksums.json", "torch_dist.checksums.json", "dist_ckpt.json"}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Tuple[Path, Path]]:
    """For each backend, the checkpoint to damage (values 2) and another one (values 5)."""
    root = tmp_path_factory.mktemp("pair")
    out = {}
    for backend in BACKENDS:
        for value in (2.0, 5.0):
            dc.save(state(value), root / f"{backend}_{value}", sharded_strategy=strategy(backend))
        out[backend] = (root / f"{backend}_2.0", root / f"{backend}_5.0")
    return out


def _counterpart(other: Path, rel: Path) -> Path:
    """The file of the other checkpoint in ``rel``'s place (a safetensors shard table is named by
    its crc32c, so the other checkpoint's has another name)."""
    path = other / rel
    if path.exists() or not (rel.name.startswith("index.") and rel.suffix == ".bin"):
        return path
    (table,) = (other / rel.parent).glob("index.*.bin")
    return table


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_damage_to_every_file(tmp_path, pair, backend):
    pristine, other = pair[backend]
    files = sorted(p.relative_to(pristine) for p in pristine.rglob("*") if p.is_file())
    assert len(files) >= 7, files
    row = f"corrupt every file, {backend}"
    for rel in files:
        damages = _damages(f"{backend}/{rel}")
        if rel.name in _RECORDS:
            damages.append(("record downgrade", _downgrade))
        for name, damage in damages:
            target = tmp_path / "ckpt"

            def attempt(rel: Path = rel, damage: Damage = damage) -> None:
                shutil.rmtree(target, ignore_errors=True)
                shutil.copytree(pristine, target)
                damage(target / rel, _counterpart(other, rel))
                loaded_right = True
                try:
                    check_loads(target, 2.0)
                except SilentWrong:
                    raise
                except dc.CheckpointingException:
                    loaded_right = False
                if dc.verify_checkpoint(target).ok and not loaded_right:
                    raise SilentWrong(f"verify says {rel} damaged by {name!r} is ok, but it does not load")

            tally.attempt(row, f"{rel}: {name}", attempt)
    tally.assert_clean(row)
