"""Convert a checkpoint from one backend to another, one tensor in memory at a time.

[`convert()`][dist_ckpt.tools.convert.convert] is what ``dist-ckpt convert SRC DST --to BACKEND`` runs: any dist_ckpt
backend (or a HuggingFace folder) to any backend whose save strategy can stream
(`can_stream`: ``safetensors``, ``zarr``,
``torch_dist``), or
to a HuggingFace folder (``"hf"``). One process, no process group. Source and destination may
be ``s3://`` URLs where the backends support object stores (the source of any backend that reads
from them; a ``safetensors`` destination, written as objects of about 256 MiB).

Memory stays bounded by the largest tensor, whatever the size of the checkpoint: the source
side assembles each tensor whole from its stored shards
([`iter_unsharded()`][dist_ckpt.tools.unshard.iter_unsharded], which keeps no reference to a tensor once the next
one is asked for), the target side writes it straight away
([`TensorStreamWriter`][dist_ckpt.backends.base.TensorStreamWriter]: the file layout is planned up front
from shapes and dtypes, so no tensor has to wait for another) and drops it before the next one
is read.

Steps (dist_ckpt target):

1. open the source: its load strategies and every tensor's shape and dtype (no data);
2. refuse a destination that is not empty (or is the source);
3. copy the tensors, sorted by key, each whole (the result is what a one-rank save of the whole
   tensors writes: one stored shard per tensor);
4. copy the common state, then every ShardedObject, one at a time (their checksum manifests
   are written as a save writes them; a ``torch_dist`` target stores them inside its DCP files,
   as Megatron-Core does, and finishes its writer after them);
5. commit ``metadata.json`` last: an interrupted conversion is never a checkpoint, and a failed
   one removes what it wrote.

A HuggingFace folder holds tensors only: converting *to* ``hf`` drops the common state and the
ShardedObjects (the result lists what was dropped); converting *from* ``hf`` gives a checkpoint
with an empty common state. Tied names that the HF folder stores once are written as tensors of
their own.

Example:

```python
result = convert("ckpt/iter_1000", "ckpt_zarr/iter_1000", to="zarr")
print(result.report.summary())
convert("ckpt/iter_1000", "hf/iter_1000", to="hf", max_shard_size=5 * 10**9)
```
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import shutil
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple, Union

from dist_ckpt.backends.base import LoadCommonStrategy, LoadShardedStrategy, SaveShardedStrategy, TensorStreamWriter
from dist_ckpt.backends.registry import StrategyAction, StrategySpec, get_default_strategy, registered_strategies
from dist_ckpt.backends.torch_common.strategy import OBJECTS_CHECKSUMS_FNAME, OBJECTS_DIR, TorchCommonSaveStrategy
from dist_ckpt.collectives.distributed import get_world_size
from dist_ckpt.engine.checks.compatibility import verify_checkpoint_and_load_strategy
from dist_ckpt.engine.monitor import StepMonitor
from dist_ckpt.engine.report import CheckpointReport, Operation, ProgressCallback
from dist_ckpt.engine.steps import Step
from dist_ckpt.engine.watchdog import DEFAULT_WATCHDOG_TIMEOUT_S
from dist_ckpt.errors import (
    CheckpointExistsError,
    CheckpointingException,
    CorruptCheckpointError,
    IncompatibleStrategyError,
)
from dist_ckpt.integrity.checksums import FileDigest, bytes_digest, manifest_bytes
from dist_ckpt.model.sharded import ShardedObject, ShardedTensor
from dist_ckpt.record.commit import CheckpointingConfig, detect_config, save_config
from dist_ckpt.record.records import digest_records
from dist_ckpt.storage import Storage
from dist_ckpt.storage.location import LocationLike, require_local, resolve_location
from dist_ckpt.tools.unshard import iter_with, unsharded_metadata

__all__ = ["HF_TARGET", "ConvertResult", "convert", "resolve_target", "trusting_strategies"]

logger = logging.getLogger(__name__)

#: the ``to`` of a conversion into a HuggingFace folder
HF_TARGET = "hf"


@dataclass(frozen=True)
class ConvertResult:
    """What [`convert()`][dist_ckpt.tools.convert.convert] did.

    Attributes:
        source: the source checkpoint.
        destination: the checkpoint (or HuggingFace folder) written.
        source_backend: ``"name:version"`` of the source's tensors.
        target_backend: ``"name:version"`` written (``"hf"`` for a HuggingFace folder).
        tensors: tensors copied.
        sharded_objects: ShardedObjects copied.
        common_keys: top-level keys of the common state copied.
        dropped: what the target cannot hold and was left out (HuggingFace targets).
        report: seconds per phase, bytes, files of the destination, throughput.
    """

    source: str
    destination: str
    source_backend: str
    target_backend: str
    tensors: int
    sharded_objects: int
    common_keys: int
    dropped: Tuple[str, ...]
    report: CheckpointReport

    def to_json(self) -> Dict[str, Any]:
        """A JSON-serializable dict (``dist-ckpt convert --json``)."""
        return {
            "source": self.source,
            "destination": self.destination,
            "source_backend": self.source_backend,
            "target_backend": self.target_backend,
            "tensors": self.tensors,
            "sharded_objects": self.sharded_objects,
            "common_keys": self.common_keys,
            "dropped": list(self.dropped),
            "report": self.report.to_json(),
        }


def resolve_target(to: Union[str, Tuple[str, int]]) -> Union[str, SaveShardedStrategy]:
    """`HF_TARGET`, or the registered save strategy of ``to``: ``"NAME"`` (its newest
    version), ``"NAME:VERSION"`` or ``(name, version)``.

    Raises:
        UnknownStrategyError: no such backend (the message lists the registered ones).
        IncompatibleStrategyError: its save strategy cannot stream whole tensors.

    Example:

    ```python
    resolve_target("zarr")        # a ZarrSaveShardedStrategy
    resolve_target("hf")          # "hf"
    ```
    """
    if to == HF_TARGET:
        return HF_TARGET
    if isinstance(to, tuple):
        name, version = to
    else:
        name, sep, version_text = to.partition(":")
        versions = [
            k.version for k in registered_strategies() if k.action == StrategyAction.SAVE_SHARDED and k.backend == name
        ]
        try:
            version = int(version_text) if sep else max(versions, default=1)
        except ValueError:
            raise IncompatibleStrategyError(
                f"expected a target NAME, NAME:VERSION or {HF_TARGET!r}, got {to!r}"
            ) from None
    strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, name, version)
    assert isinstance(strategy, SaveShardedStrategy)
    if not strategy.can_stream:
        raise IncompatibleStrategyError(
            f"cannot convert to {name}:{version}: its save strategy {strategy} cannot write tensor by tensor"
        )
    return strategy


def trusting_strategies(src: LocationLike) -> Tuple[LoadShardedStrategy, LoadCommonStrategy]:
    """The load strategies of ``src``, set to unpickle what needs full pickle (``allow_pickle`` on
    those that have it): for ``dist-ckpt convert --allow-pickle``, on checkpoints you trust only.

    Example:

    ```python
    sharded, common = trusting_strategies("megatron_ckpt/iter_0001000")
    convert("megatron_ckpt/iter_0001000", "out", to="safetensors", sharded_strategy=sharded, common_strategy=common)
    ```
    """
    found = verify_checkpoint_and_load_strategy(src)
    trusting = []
    for strategy in found:
        strategy = copy.copy(strategy)  # a registered instance stays as it was
        if hasattr(strategy, "allow_pickle"):
            strategy.allow_pickle = True
        trusting.append(strategy)
    sharded, common = trusting
    assert isinstance(sharded, LoadShardedStrategy) and isinstance(common, LoadCommonStrategy)
    return sharded, common


def _check_destination(src: Storage, dst: Storage) -> None:
    if src.local_paths and dst.local_paths:
        source, target = src.local_dir.resolve(), dst.local_dir.resolve()
        inside = target == source or source in target.parents
    else:
        inside = (dst.url + "/").startswith(src.url + "/")
    if inside:
        raise CheckpointExistsError(f"the destination {dst.url!r} is (inside) the source {src.url!r}; choose another")
    if dst.local_paths:
        directory = dst.local_dir
        if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
            raise CheckpointExistsError(
                f"the destination {dst.url!r} exists and is not an empty directory; delete it or choose another"
            )
    elif dst.list():
        raise CheckpointExistsError(
            f"the destination {dst.url!r} already holds objects; delete them or choose another prefix"
        )


def convert(
    src: LocationLike,
    dst: LocationLike,
    to: Union[str, Tuple[str, int], SaveShardedStrategy],
    *,
    max_shard_size: int = 2**31,
    common_strategy: StrategySpec = None,
    sharded_strategy: StrategySpec = None,
    progress: Optional[ProgressCallback] = None,
    watchdog_timeout_s: Optional[float] = DEFAULT_WATCHDOG_TIMEOUT_S,
) -> ConvertResult:
    """Write the checkpoint ``src`` again, in backend ``to``, as ``dst`` (see the module docstring).

    Args:
        src: a committed dist_ckpt checkpoint of any backend, or a HuggingFace folder: a
            directory, an ``s3://bucket/prefix`` URL or a storage.
        dst: the new checkpoint: a directory that does not exist or is empty, or an empty
            object-store prefix when the target backend writes to object stores
            (``safetensors``; a HuggingFace folder, ``zarr`` and ``torch_dist`` are written to local directories).
        to: ``"safetensors"``, ``"zarr"``, ``"NAME:VERSION"``, ``"hf"``, or a save strategy
            object with ``can_stream`` (to choose its options).
        max_shard_size: most bytes per file of a HuggingFace target.
        common_strategy: how to read the source's common state (e.g.
            ``TorchCommonLoadStrategy(allow_pickle=True)`` for a trusted checkpoint whose
            common state needs pickle).
        sharded_strategy: how to read the source's tensors (and, for torch_dist, ShardedObjects;
            e.g. ``TorchDistLoadShardedStrategy(allow_pickle=True)`` for a trusted checkpoint).
        progress: called with a [`ProgressEvent`][dist_ckpt.engine.report.ProgressEvent] as each phase starts
            and ends, and after each tensor (with its key and the bytes done so far).
        watchdog_timeout_s: as in [`dist_ckpt.save()`][dist_ckpt.engine.save.save].

    Raises:
        CheckpointExistsError: ``dst`` is not empty, or is the source.
        IncompatibleStrategyError: the target cannot stream, cannot write to ``dst`` (an object
            store), or a process group of several ranks is initialized (run it from one process).
        CheckpointingException: the source is not a checkpoint, or is damaged.

    Example:

    ```python
    result = convert("ckpt/iter_1000", "ckpt_zarr/iter_1000", to="zarr")
    assert result.tensors == len(dc.load_tensors_metadata("ckpt/iter_1000"))
    ```
    """
    if get_world_size() > 1:
        raise IncompatibleStrategyError(
            f"convert runs in one process, but a process group of {get_world_size()} ranks is initialized; "
            f"run it from a separate process (e.g. the dist-ckpt command)"
        )
    source, destination = resolve_location(src), resolve_location(dst)
    target = to if isinstance(to, SaveShardedStrategy) else resolve_target(to)
    if isinstance(target, SaveShardedStrategy):
        if not target.can_stream:
            raise IncompatibleStrategyError(f"cannot convert with {target}: it cannot write tensor by tensor")
        target.check_location(destination)
        TorchCommonSaveStrategy().check_location(destination)
    elif not destination.local_paths:
        raise IncompatibleStrategyError(
            f"a HuggingFace folder is written to a local directory, not to {destination.url}; "
            "convert to a local folder, then upload it"
        )
    phases = [Step.OPEN_SOURCE, Step.COPY_TENSORS]
    if target != HF_TARGET:
        phases += [Step.COPY_COMMON, Step.COPY_OBJECTS, Step.COMMIT]
    _check_destination(source, destination)  # before anything that could clean it up on failure
    monitor = StepMonitor(Operation.CONVERT, destination, phases, progress, watchdog_timeout_s)
    created = destination.local_paths and not destination.local_dir.exists()
    try:
        with monitor:
            result = _convert_steps(
                monitor, source, destination, target, max_shard_size, common_strategy, sharded_strategy
            )
    except BaseException:
        _remove_written(destination, created)
        raise
    return replace(result, report=monitor.finish(result.report.nbytes))


def _remove_written(dst: Storage, created: bool) -> None:
    """Leave the destination as it was: absent, or empty (an object-store prefix: no objects;
    `_check_destination()` refused a prefix that held any)."""
    if not dst.local_paths:
        try:
            dst.delete_prefix("")
        except OSError as e:  # the original error matters more; say what is left behind
            logger.warning("could not remove the partial conversion at %s: %s", dst.url, e)
        return
    directory = dst.local_dir
    if not directory.exists():
        return
    if created:
        shutil.rmtree(directory, ignore_errors=True)
        return
    for child in directory.iterdir():
        shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)


def _convert_steps(
    monitor: StepMonitor,
    src: Storage,
    dst: Storage,
    target: Union[str, SaveShardedStrategy],
    max_shard_size: int,
    common_strategy: StrategySpec,
    sharded_strategy: StrategySpec = None,
) -> ConvertResult:
    """The numbered steps of [`convert()`][dist_ckpt.tools.convert.convert], each run through
    ``monitor``: 1. open the source; 3. copy the tensors (to a HuggingFace folder, the
    conversion ends there); 4. the common state and ShardedObjects; 5. commit.

    Long on purpose, like the steps of a save: every step runs through ``monitor`` (which times
    it and names it in errors) and shares the source's strategies, metadata and the progress
    count, so the conversion reads top to bottom in one place.
    """

    # 1. the source's strategies and tensors (2., the destination, was checked by the caller)
    def open_source() -> Tuple[LoadShardedStrategy, LoadCommonStrategy, Dict[str, ShardedTensor]]:
        sharded, common = verify_checkpoint_and_load_strategy(src, sharded_strategy, common_strategy)
        _, metadata = unsharded_metadata(src, sharded)
        return sharded, common, metadata

    sharded, common, metadata = monitor.run(Step.OPEN_SOURCE, open_source)
    config = detect_config(src)
    source_backend = f"{config.sharded_backend}:{config.sharded_backend_version}"
    keys = sorted(metadata)
    sizes = {k: math.prod(metadata[k].global_shape) * metadata[k].dtype.itemsize for k in keys}
    total = sum(sizes.values())
    done = [0]

    def tensor_done(key: str, nbytes: int) -> None:
        done[0] += nbytes
        monitor.heartbeat()  # the watchdog reports a tensor that takes too long, not a long conversion
        monitor.notify(Step.COPY_TENSORS, done=False, item=key, bytes_done=done[0], bytes_total=total)

    # 3. tensors
    if target == HF_TARGET:
        from dist_ckpt.hf.export import export

        folder = require_local(dst, "a HuggingFace folder")
        monitor.run(
            Step.COPY_TENSORS,
            lambda: export(src, folder, max_shard_size=max_shard_size, include=["*"], on_tensor=tensor_done),
        )  # every tensor: optimizer state too (export's default leaves it out)
        dropped = _dropped_by_hf(sharded, common, src)
        for note in dropped:
            logger.warning("converting %s to a HuggingFace folder drops %s", src, note)
        report = monitor.report
        report.nbytes = total
        return ConvertResult(src.url, dst.url, source_backend, HF_TARGET, len(keys), 0, 0, tuple(dropped), report)

    assert isinstance(target, SaveShardedStrategy)

    def copy_tensors() -> Optional[TensorStreamWriter]:
        """The tensors; returns the writer still open when the ShardedObjects go into it too."""
        dst.make_dir()
        writer = target.begin_stream(dst, [(k, metadata[k].dtype, tuple(metadata[k].global_shape)) for k in keys])
        try:
            for key, tensor in iter_with(sharded, metadata, keys, src):
                writer.add(key, tensor)
                del tensor  # before the next one is assembled
                tensor_done(key, sizes[key])
            if target.can_handle_sharded_objects:  # e.g. torch_dist: objects live with the tensors
                return writer
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        return None

    open_writer = monitor.run(Step.COPY_TENSORS, copy_tensors)
    # 4. common state, ShardedObjects
    common_keys = monitor.run(Step.COPY_COMMON, lambda: _copy_common(common, src, dst))
    objects = monitor.run(Step.COPY_OBJECTS, lambda: _copy_objects(sharded, common, src, dst, open_writer))
    # 5. commit
    commit = CheckpointingConfig(target.backend, target.version, "torch", 1)
    records = target.integrity_records + TorchCommonSaveStrategy.integrity_records
    monitor.run(Step.COMMIT, lambda: save_config(commit, dst, world_size=1, records=digest_records(dst, records)))
    report = monitor.report
    report.nbytes = total
    target_backend = f"{target.backend}:{target.version}"
    return ConvertResult(src.url, dst.url, source_backend, target_backend, len(keys), objects, common_keys, (), report)


def _copy_common(common: LoadCommonStrategy, src: Storage, dst: Storage) -> int:
    state = common.load_common(src)
    TorchCommonSaveStrategy().save_common(state, dst)
    return len(state)


def _object_loader(
    sharded: LoadShardedStrategy, common: LoadCommonStrategy
) -> Union[LoadShardedStrategy, LoadCommonStrategy]:
    return sharded if sharded.can_handle_sharded_objects else common


def _stored_objects(sharded: LoadShardedStrategy, common: LoadCommonStrategy, src: Storage) -> List[ShardedObject]:
    found = _object_loader(sharded, common).load_sharded_metadata(src)
    objects = [v for _, v in sorted(found.items()) if isinstance(v, ShardedObject)]
    _check_objects_complete(objects, src)
    return objects


def _check_objects_complete(objects: List[ShardedObject], src: Storage) -> None:
    """Each ShardedObject key must have every shard of its global shape: the shards are found
    by listing files, so a deleted file would otherwise vanish from the converted checkpoint."""
    by_key: Dict[str, List[ShardedObject]] = {}
    for obj in objects:
        by_key.setdefault(obj.key, []).append(obj)
    for key, shards in sorted(by_key.items()):
        shape = tuple(shards[0].global_shape)
        present = {tuple(o.global_offset) for o in shards}
        missing = sorted(set(itertools.product(*(range(n) for n in shape))) - present)
        if missing:
            shown = ", ".join(map(str, missing[:5])) + (f", ... ({len(missing) - 5} more)" if len(missing) > 5 else "")
            raise CorruptCheckpointError(
                f"{src.url}: ShardedObject {key!r} (global shape {shape}) has no stored shard at "
                f"offsets {shown}: its files are missing"
            )


def _copy_objects(
    sharded: LoadShardedStrategy,
    common: LoadCommonStrategy,
    src: Storage,
    dst: Storage,
    writer: Optional[TensorStreamWriter] = None,
) -> int:
    """Each ShardedObject read and written on its own -- into ``writer`` (then finished) when the
    target keeps objects with its tensors, else as files of ``objects/`` followed by their manifest
    (the one a save writes, from the files read back) -- so only one object is in memory at a time."""
    loader = _object_loader(sharded, common)
    saver = TorchCommonSaveStrategy(checksums=False)  # one manifest of every file, written below
    try:
        objects = _stored_objects(sharded, common, src)
        for obj in objects:
            request = {obj.unique_key: obj}
            loaded = (
                loader.load(request, src)
                if isinstance(loader, LoadShardedStrategy)
                else loader.load_sharded_objects(request, src)
            )
            if writer is not None:
                writer.add_object(obj.unique_key, loaded[obj.unique_key])
            else:
                saver.save_sharded_objects(
                    {obj.unique_key: replace(obj, data=loaded[obj.unique_key], replica_id=0)}, dst
                )
            del loaded
        if writer is not None:
            writer.finish()
            return len(objects)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    if objects:
        storage = dst.child(OBJECTS_DIR)
        digests: Dict[str, FileDigest] = {info.key: bytes_digest(storage.read(info.key)) for info in storage.list()}
        storage.write(OBJECTS_CHECKSUMS_FNAME, manifest_bytes(digests))
    return len(objects)


def _dropped_by_hf(sharded: LoadShardedStrategy, common: LoadCommonStrategy, src: Storage) -> List[str]:
    dropped = []
    try:
        state = common.load_common(src)
    except CheckpointingException as e:
        return [f"the common state (not readable: {e})"]
    if state:
        dropped.append(f"the common state ({len(state)} top-level keys: {', '.join(map(str, list(state)[:5]))})")
    objects = _stored_objects(sharded, common, src)
    if objects:
        dropped.append(f"{len(objects)} ShardedObjects ({', '.join(o.unique_key for o in objects[:3])})")
    return dropped
