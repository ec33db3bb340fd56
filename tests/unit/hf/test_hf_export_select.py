"""export-hf as an inference export (issue 16, item 7): which keys, which names, config.json,
and a folder that loads the way ``transformers`` loads one.

``transformers`` is not a dependency (it is large), so :func:`load_like_transformers` does what
its ``from_pretrained`` does with a local folder of safetensors weights: read ``config.json``
(a JSON object), then either ``model.safetensors`` or ``model.safetensors.index.json`` -- its
``weight_map`` names the shard of every key, each shard is opened with the safetensors library,
and a shard whose metadata lacks ``format: pt`` is refused -- and finally
``model.load_state_dict(state, strict=True)``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from safetensors import safe_open

import dist_ckpt as dc
from dist_ckpt.errors import InvalidKeyError, KeyMismatchError
from dist_ckpt.hf import export, is_optimizer_key, rename_keys, select_keys
from dist_ckpt.testing.layouts import bitwise_equal
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


class TinyLM(torch.nn.Module):
    """A module whose parameter names look like a transformers model's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(50, 16)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(11)])
        self.norm = torch.nn.LayerNorm(16)
        self.lm_head = torch.nn.Linear(16, 50, bias=False)


def load_like_transformers(folder: Path, model: torch.nn.Module) -> Dict[str, object]:
    """Load ``folder`` into ``model`` as transformers' from_pretrained would; return the config."""
    config = json.loads((folder / "config.json").read_text())
    assert isinstance(config, dict) and "model_type" in config
    index_file = folder / SAFE_WEIGHTS_INDEX_NAME
    if index_file.exists():
        index = json.loads(index_file.read_text())
        shard_files = sorted(set(index["weight_map"].values()))
        assert index["metadata"]["total_size"] > 0
    else:
        index, shard_files = None, [SAFE_WEIGHTS_NAME]
    state: Dict[str, torch.Tensor] = {}
    for name in shard_files:
        with safe_open(str(folder / name), framework="pt") as f:
            metadata = f.metadata()
            if metadata is None or metadata.get("format") not in ("pt", "tf", "flax", "mlx"):
                raise OSError(f"{name} does not contain the valid metadata")
            for key in f.keys():
                assert key not in state, f"{key} is in two shards"
                if index is not None:
                    assert index["weight_map"][key] == name, f"the index puts {key} elsewhere"
                state[key] = f.get_tensor(key)
    if index is not None:
        assert set(index["weight_map"]) == set(state)
    model.load_state_dict(state, strict=True)
    return config


def _trained(tmp_path: Path) -> Tuple[TinyLM, Path]:
    """A TinyLM after one Adam step, saved with the one-call API."""
    torch.manual_seed(0)
    model = TinyLM()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 50, (4, 8))
    h = model.embed_tokens(tokens)
    for layer in model.layers:
        h = layer(h)
    model.lm_head(model.norm(h)).logsumexp(-1).mean().backward()
    optim.step()
    ckpt = tmp_path / "ckpt"
    dc.save_model_and_optim_state(str(ckpt), model, optim)
    return model, ckpt


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    entry = Path(sys.executable).parent / "dist-ckpt"
    command = [str(entry)] if entry.exists() else [sys.executable, "-m", "dist_ckpt"]
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


# --------------------------------------------------------------------------- selection and names


@pytest.mark.parametrize(
    "key, optimizer",
    [
        ("model.layers.0.weight", False),
        ("decoder.layers.0.mlp.linear_fc1.weight", False),
        ("embedding.word_embeddings.weight", False),
        ("optim.state.layers.0.weight.exp_avg", True),  # dist_ckpt's one-call API
        ("optimizer.state.exp_avg.decoder.layers.0.weight", True),  # Megatron-Core
        ("optimizer.state.fp32_param.decoder.layers.0.weight", True),
        ("optimizer_state.param_groups.0.lr", True),
        ("decoder.w.exp_avg_sq", True),
        ("layers.0.momentum_buffer", True),
        ("model.exp_avg_tracker.weight", False),  # a part named like a state, not equal to one
    ],
)
def test_optimizer_keys(key, optimizer):
    assert is_optimizer_key(key) is optimizer


def test_select_keys_default_include_and_exclude():
    keys = ["model.a", "model.b.extra_state", "optim.state.a.exp_avg", "optimizer.x"]
    assert select_keys(keys) == ["model.a", "model.b.extra_state"]
    assert select_keys(keys, exclude=["*.extra_state"]) == ["model.a"]
    assert select_keys(keys, include=["*"]) == keys
    assert select_keys(keys, include=["optim.*"], exclude=["*.exp_avg"]) == []


def test_rename_keys_by_whole_parts_longest_first():
    keys = ["model.layers.1.w", "model.layers.10.w", "model.norm.w", "head"]
    names = rename_keys(keys, {"model.": "", "model.layers.1": "h.first"})
    assert names == {
        "model.layers.1.w": "h.first.w",
        "model.layers.10.w": "layers.10.w",
        "model.norm.w": "norm.w",
        "head": "head",
    }


def test_rename_refuses_a_collision_and_an_empty_name():
    with pytest.raises(InvalidKeyError, match="'a.w' and 'b.w' would both be exported as 'w'"):
        rename_keys(["a.w", "b.w"], {"a.": "", "b.": ""})
    with pytest.raises(InvalidKeyError, match="empty name"):
        rename_keys(["w"], {"w": ""})


# --------------------------------------------------------------------------- the export itself


def test_library_export_loads_like_transformers(tmp_path):
    model, ckpt = _trained(tmp_path)
    result = export(
        ckpt,
        tmp_path / "hf",
        max_shard_size=1500,
        rename={"model.": ""},
        config={"model_type": "tiny", "hidden_size": 16},
    )
    assert result.index == SAFE_WEIGHTS_INDEX_NAME and len(result.files) > 1 and result.config == "config.json"
    assert result.left_out and all(k.startswith("optim.state.") for k in result.left_out)
    fresh = TinyLM()
    config = load_like_transformers(tmp_path / "hf", fresh)
    assert config == {"model_type": "tiny", "hidden_size": 16}
    for name, tensor in model.state_dict().items():
        assert bitwise_equal(fresh.state_dict()[name], tensor), name


def test_cli_export_with_rename_and_config(tmp_path):
    model, ckpt = _trained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "tiny", "vocab_size": 50}\n')
    proc = _cli(
        "export-hf",
        str(ckpt),
        str(tmp_path / "hf"),
        "--rename",
        "model.=",
        "--config",
        str(tmp_path / "config.json"),
        "--max-shard-size",
        "2KiB",
        "--json",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["config"] == "config.json" and doc["index"] == SAFE_WEIGHTS_INDEX_NAME
    assert doc["renamed"]["model.lm_head.weight"] == "lm_head.weight"
    assert sorted(doc["left_out"]) == sorted(k for k in dc.load_tensors_metadata(str(ckpt)) if k.startswith("optim."))
    assert (tmp_path / "hf" / "config.json").read_text() == (tmp_path / "config.json").read_text()  # copied as is
    fresh = TinyLM()
    load_like_transformers(tmp_path / "hf", fresh)
    for name, tensor in model.state_dict().items():
        assert bitwise_equal(fresh.state_dict()[name], tensor), name


def test_cli_include_exclude_and_rename_file(tmp_path):
    _, ckpt = _trained(tmp_path)
    (tmp_path / "names.json").write_text(json.dumps({"model.layers": "h", "model.": ""}))
    proc = _cli(
        "export-hf",
        str(ckpt),
        str(tmp_path / "hf"),
        "--include",
        "model.layers.*",
        "--include",
        "model.norm.*",
        "--exclude",
        "*.bias",
        "--rename-file",
        str(tmp_path / "names.json"),
        "--json",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    with safe_open(str(tmp_path / "hf" / SAFE_WEIGHTS_NAME), framework="pt") as f:
        exported: List[str] = sorted(f.keys())
    assert exported == sorted([f"h.{i}.weight" for i in range(11)] + ["norm.weight"])
    everything = _cli("export-hf", str(ckpt), str(tmp_path / "all"), "--include", "*", "--json", cwd=tmp_path)
    assert json.loads(everything.stdout)["tensors"] == len(dc.load_tensors_metadata(str(ckpt)))


def test_cli_export_errors(tmp_path):
    _, ckpt = _trained(tmp_path)
    (tmp_path / "list.json").write_text("[1, 2]")
    for args, status, text in [
        (["--config", str(tmp_path / "absent.json")], 2, "cannot read the config"),
        (["--config", str(tmp_path / "list.json")], 2, "not an object"),
        (["--rename", "no-equals-sign"], 2, "expected OLD=NEW"),
        (["--rename", "model.layers.0=a", "--rename", "model.layers.1=a"], 1, "would both be exported as"),
        (["--include", "nothing.*"], 1, "no tensor of"),
    ]:
        out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
        proc = _cli("export-hf", str(ckpt), str(out), *args, cwd=tmp_path)
        assert proc.returncode == status and text in proc.stderr, (args, proc.stderr)
        assert not (out / SAFE_WEIGHTS_NAME).exists()


def test_export_refuses_to_overwrite_another_config(tmp_path):
    _, ckpt = _trained(tmp_path)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "other"}')
    with pytest.raises(dc.CheckpointExistsError, match="config.json"):
        export(ckpt, out, config={"model_type": "tiny"})
    with pytest.raises(KeyMismatchError, match="include"):
        export(ckpt, tmp_path / "none", include=["absent.*"])
    shutil.rmtree(out)
