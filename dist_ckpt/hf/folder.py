"""Reading HuggingFace checkpoint folders: which file holds which tensor, where in the file.

`open_folder()` recognises ``model.safetensors.index.json`` (sharded) or ``model.safetensors``
(single file) and returns an `HFFolder`. Its `HFFolder.tensor_index()` reads the
headers of the files that hold the wanted tensors -- and nothing else -- and describes each
tensor as one stored shard covering the whole tensor, in the same `TensorIndex` the
safetensors backend uses, so the same loader reads any slice of any of them, in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Union

from dist_ckpt.backends.safetensors import SafetensorsHeader, StoredShard, StoredTensor, TensorIndex, read_header
from dist_ckpt.backends.stored_shards import stored_key
from dist_ckpt.errors import CorruptCheckpointError, KeyMismatchError, NotACheckpointError, format_keys
from dist_ckpt.hf.index import SharingMetadataT, load_shard_index, refuse_bin, sharing_groups, validate_shard_index
from dist_ckpt.integrity.safe_json import loads
from dist_ckpt.record.commit import BIN_WEIGHTS_INDEX_NAME, BIN_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from dist_ckpt.storage import LocalStorage

__all__ = ["HFFolder", "folder_storage", "has_hf_weights", "open_folder", "single_file_metadata"]

#: header ``__metadata__`` entry of a single-file checkpoint holding the index metadata as JSON
INDEX_METADATA_KEY = "dist_ckpt.index_metadata"


def folder_storage(directory: Path) -> LocalStorage:
    """The storage a HuggingFace folder is read through: the folder, whose files may lead
    through symbolic links to nowhere else (the one link policy of every local read; see
    [`LocalStorage`][dist_ckpt.storage.local.LocalStorage]) -- except, for a snapshot of the HuggingFace hub
    cache (``models--org--name/snapshots/<revision>``), its repository's ``blobs`` directory,
    where the cache keeps the files every snapshot links to.

    Example:

    ```python
    folder_storage(Path("~/.cache/huggingface/hub/models--gpt2/snapshots/abc").expanduser())
    ```
    """
    real = Path(directory).resolve()
    blobs = (real.parent.parent / "blobs",) if real.parent.name == "snapshots" else ()
    return LocalStorage(directory, link_roots=blobs)


def has_hf_weights(directory: Union[str, Path]) -> bool:
    """Whether ``directory`` holds ``model.safetensors`` or ``model.safetensors.index.json``.

    Example:

    ```python
    has_hf_weights("Llama-3-8B")   # True
    ```
    """
    d = Path(directory)
    return (d / SAFE_WEIGHTS_INDEX_NAME).is_file() or (d / SAFE_WEIGHTS_NAME).is_file()


def single_file_metadata(header_metadata: Dict[str, str], path: Path) -> Dict[str, Any]:
    """The index metadata stored in a single file's header (``{}`` if it has none).

    Example:

    ```python
    single_file_metadata(read_header_at(path).metadata, path).get("param_sharing_metadata")
    ```
    """
    raw = header_metadata.get(INDEX_METADATA_KEY)
    if raw is None:
        return {}
    value = loads(raw.encode("utf-8"), f"{str(path)!r}: header entry {INDEX_METADATA_KEY!r}")
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{str(path)!r}: header entry {INDEX_METADATA_KEY!r} must hold a JSON object")
    return value


@dataclass
class HFFolder:
    """A HuggingFace checkpoint folder.

    Attributes:
        directory: the folder.
        weight_map: tensor name -> file name (for a single file, every name maps to it).
        metadata: the index metadata (for a single file, what its header records).
        sharded: whether the folder has an index.
        extra_aliases: tied names the caller knows of (e.g. ``{"lm_head.weight":
            "model.embed_tokens.weight"}`` for checkpoints that omit tied weights without
            recording it); merged with the groups in the metadata.
    """

    directory: Path
    weight_map: Dict[str, str]
    metadata: Dict[str, Any]
    sharded: bool
    extra_aliases: Dict[str, str] = field(default_factory=dict)

    @property
    def storage(self) -> LocalStorage:
        """The folder as a storage: its files are read through it (see `folder_storage()`)."""
        return folder_storage(self.directory)

    @property
    def sharing(self) -> SharingMetadataT:
        """Tied-parameter groups (first name stored)."""
        return sharing_groups(self.metadata)

    @property
    def aliases(self) -> Dict[str, str]:
        """Tied names that are not stored -> the stored name they share it with."""
        found = {name: group[0] for group in self.sharing for name in group[1:]}
        found.update(self.extra_aliases)
        return {a: s for a, s in found.items() if a not in self.weight_map and s in self.weight_map}

    def names(self) -> List[str]:
        """Every tensor name the folder provides, tied names included, sorted."""
        return sorted(set(self.weight_map) | set(self.aliases))

    def resolve(self, names: Iterable[str]) -> List[str]:
        """Stored names needed for ``names`` (aliases followed); raises for unknown names."""
        aliases = self.aliases
        wanted = list(dict.fromkeys(names))
        absent = [n for n in wanted if n not in self.weight_map and n not in aliases]
        if absent:
            raise KeyMismatchError(
                f"tensors {format_keys(absent)} are not in the HuggingFace checkpoint {str(self.directory)!r}",
                unexpected_keys=absent,
            )
        return list(dict.fromkeys(aliases.get(n, n) for n in wanted))

    def read_headers(self, files: Iterable[str]) -> Dict[str, SafetensorsHeader]:
        """Validated headers of ``files`` (each read once)."""
        headers = {}
        storage = self.storage
        for file in sorted(set(files)):
            path = self.directory / file
            try:
                reader = storage.open_reader(file)
            except FileNotFoundError:
                held = sorted(n for n, f in self.weight_map.items() if f == file)
                raise CorruptCheckpointError(
                    f"safetensors file {str(path)!r}, which the index says holds {format_keys(held)}, is missing"
                ) from None
            with reader:
                headers[file] = read_header(reader, path)
        return headers

    def tensor_index(self, names: Optional[Iterable[str]] = None) -> TensorIndex:
        """A `TensorIndex` of ``names`` (default: every tensor), reading only their files' headers.

        Raises:
            KeyMismatchError: a name is not in the checkpoint.
            CorruptCheckpointError: a file is missing, damaged, or lacks a tensor the index puts in it.
        """
        stored = self.resolve(self.names() if names is None else names)
        headers = self.read_headers(self.weight_map[n] for n in stored)
        tensors: Dict[str, StoredTensor] = {}
        for name in stored:
            file = self.weight_map[name]
            stored_key(name, repr(str(self.directory / file)))
            entry = headers[file].entries.get(name)
            if entry is None:
                raise CorruptCheckpointError(
                    f"tensor {name!r}: the index says it is in {str(self.directory / file)!r}, whose header does not "
                    "list it"
                )
            offset = (0,) * len(entry.shape)
            shard = StoredShard(file, name, offset, entry.shape, None, (entry.begin, entry.end))
            tensors[name] = StoredTensor(name, entry.dtype, entry.shape, [shard])
        aliases = {a: s for a, s in self.aliases.items() if s in tensors}
        return TensorIndex(self.storage, tensors, aliases, description=repr(str(self.directory)), from_headers=True)


def open_folder(directory: Union[str, Path]) -> HFFolder:
    """Open a HuggingFace checkpoint folder (index or single file).

    Raises:
        NotACheckpointError: no safetensors weights in the folder.
        CheckpointingException: only ``.bin`` (pickle) weights, which are refused.
        CorruptCheckpointError: a malformed index or header.

    Example:

    ```python
    folder = open_folder("Llama-3-8B")
    folder.weight_map["lm_head.weight"]   # 'model-00004-of-00004.safetensors'
    ```
    """
    d = Path(directory)
    if (d / SAFE_WEIGHTS_INDEX_NAME).is_file():
        index = load_shard_index(d, SAFE_WEIGHTS_INDEX_NAME)
        return HFFolder(d, dict(index["weight_map"]), dict(index["metadata"]), True)
    if (d / SAFE_WEIGHTS_NAME).is_file():
        path = d / SAFE_WEIGHTS_NAME
        with folder_storage(d).open_reader(SAFE_WEIGHTS_NAME) as reader:
            header = read_header(reader, path)
        metadata = single_file_metadata(header.metadata, path)
        validate_shard_index({"metadata": metadata, "weight_map": {}}, repr(str(path)))
        return HFFolder(d, {name: SAFE_WEIGHTS_NAME for name in header.entries}, metadata, False)
    if (d / BIN_WEIGHTS_NAME).is_file() or (d / BIN_WEIGHTS_INDEX_NAME).is_file():
        refuse_bin(False)
    if not d.is_dir():
        raise NotACheckpointError(f"{str(d)!r} does not exist")
    raise NotACheckpointError(
        f"{str(d)!r} holds no HuggingFace weights ({SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME})"
    )
