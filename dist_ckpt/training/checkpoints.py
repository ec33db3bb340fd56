"""Checkpoint directories over time: the latest complete one, the list of them, rotation, best, metrics.

A training run writes its checkpoints into one directory, ``model_dir``:

```text
model_dir/
  checkpoint-1000/     complete dist_ckpt checkpoint (its metadata.json is committed)
  checkpoint-2000/     complete HuggingFace-format checkpoint (model.safetensors)
  checkpoint-3000/     a save in progress or a crashed one (no commit marker): not complete
  model.safetensors -> checkpoint-2000/model.safetensors    (create_pretrained_symlinks)
```

The functions here are single-process utilities: call them from one process (e.g. rank 0),
never from every rank at once, and not while another process rotates the same ``model_dir``.

**Names.** The name of a checkpoint directory carries its step. Recognised names
(`CHECKPOINT_NAME_PATTERNS`, ``N`` = decimal digits, leading zeros allowed):
``checkpoint-N`` (HuggingFace Trainer; what
[`next_checkpoint_path()`][dist_ckpt.training.checkpoints.next_checkpoint_path] creates), ``checkpoint_N``, ``iter_N``
(Megatron, ``iter_0001000``), ``step-N``, ``step_N`` and ``global_stepN`` (DeepSpeed). Any other entry of ``model_dir``
(files, ``runs/``, ``final/``, hidden names) is not managed: never returned as the latest checkpoint, never counted or
deleted by rotation. Unlike the reference, checkpoints live directly in ``model_dir`` (Megatron's
layout), not in a ``checkpoints/`` subdirectory.

**Order.** Checkpoints are ordered by ``(step, name)``: by step, never by modification time
(copies, restores and coarse clocks reorder mtimes); two names with the same step
(``checkpoint-1000`` and ``iter_0001000``) are ordered by their names as strings.

**Completeness.** Completeness is decided by each format's commit marker, nothing else. A
directory is a *complete* checkpoint iff

* it is a committed dist_ckpt checkpoint: its ``metadata.json`` is valid
  ([`dist_ckpt.record.commit.maybe_load_config()`][dist_ckpt.record.commit.maybe_load_config]), or
* it holds HuggingFace weights, looked for in this order: ``model.safetensors.index.json``,
  ``model.safetensors``, ``pytorch_model.bin.index.json``, ``pytorch_model.bin`` (the first
  one present decides). An index must hold a non-empty ``weight_map`` whose every shard file
  exists in the directory and is whole; a safetensors file is whole when its size is exactly
  what its header says (a truncated copy is not); a torch zip file is whole when its central
  directory can be found.

A directory that holds dist_ckpt files (``metadata.json``, even a corrupt one, or
``common.pt``) is judged as dist_ckpt only: HF-named files in it never make it complete, so an
uncommitted dist_ckpt save of HF-style files cannot pass for a finished HF checkpoint. Anything
else (no marker, a corrupt ``metadata.json``, an index with a missing shard) is *partial*:
ignored by [`find_latest_checkpoint()`][dist_ckpt.training.checkpoints.find_latest_checkpoint], never counted as
complete.

**Deletion.** No crash leaves a half-deleted directory that looks complete: on a local disk
it is (1) renamed to a hidden trash name (``.dist_ckpt-trash-...``) no pattern recognises, (2)
``model_dir`` is fsynced, (3) its commit markers go, (4) the rest; the next rotation removes
trash left by a crash. An object store cannot rename: the markers (``metadata.json``, the HF
names) are deleted *first*, so a crash leaves a partial directory, skipped and later removed.

**Any storage.** ``model_dir`` and checkpoint paths may be paths, ``s3://`` URLs or a
[`Storage`][dist_ckpt.storage.base.Storage]; one implementation works through the storage (a
run's checkpoints are the directories directly under it: ``list_dirs``, one request on S3) and
returns paths named as the run was. Where the storage has ``local_paths`` it also uses what only
a local directory has: the trash rename and symlinks
([`create_pretrained_symlinks()`][dist_ckpt.training.checkpoints.create_pretrained_symlinks]).

This module is the contract and the one place to import from; the code is split by job:
names, completeness, the latest checkpoint and the list of complete ones
([`list_checkpoints()`][dist_ckpt.training.checkpoints.list_checkpoints], with their metrics) in
`dist_ckpt.training.checkpoint_dirs`, rotation
and deletion in `dist_ckpt.training.rotation`, the HF links in `dist_ckpt.training.hf_links`.
The structural checks of HF weight files live in `dist_ckpt.training.hf_weights`, the metrics
file in [`dist_ckpt.training.metrics`][dist_ckpt.training.metrics] (its functions are re-exported here).
"""

from dist_ckpt.training.checkpoint_dirs import (
    CHECKPOINT_NAME_PATTERNS,
    CheckpointFormat,
    CheckpointMeta,
    RunCheckpoint,
    checkpoint_names,
    find_latest_checkpoint,
    get_checkpoint_metadata,
    list_checkpoints,
    next_checkpoint_path,
    parse_checkpoint_step,
    validate_checkpoint,
)
from dist_ckpt.training.hf_links import create_pretrained_symlinks
from dist_ckpt.training.metrics import METRICS_FILENAME, load_checkpoint_metrics, save_checkpoint_metrics
from dist_ckpt.training.rotation import maybe_delete_oldest_checkpoint

# in reading order: the API page lists them so (names, completeness, latest, listing, rotation, links, metrics)
__all__ = [
    "CHECKPOINT_NAME_PATTERNS",
    "CheckpointFormat",
    "CheckpointMeta",
    "parse_checkpoint_step",
    "next_checkpoint_path",
    "checkpoint_names",
    "get_checkpoint_metadata",
    "validate_checkpoint",
    "find_latest_checkpoint",
    "RunCheckpoint",
    "list_checkpoints",
    "maybe_delete_oldest_checkpoint",
    "create_pretrained_symlinks",
    "METRICS_FILENAME",
    "load_checkpoint_metrics",
    "save_checkpoint_metrics",
]
