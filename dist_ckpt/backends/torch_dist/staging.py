"""Where a ``torch_dist`` save writes DCP's data files until its commit.

DCP's ``FileSystemWriter`` creates each ``__<rank>_<n>.distcp`` file under its final name and
fills it in place, so a save that failed or was killed would leave partial data files where a
checkpoint's files belong. Instead every rank writes its files into the hidden staging directory
``.partial-distcp`` of the checkpoint, under the names DCP gives them (the names ``.metadata``
records: relative to the checkpoint, so nothing in the format changes); at the commit, once every
rank's files are complete and durable, rank 0 renames them into the checkpoint directory
(`publish_staged()`), removes the empty staging directory, and only then writes ``.metadata``.
A save that fails before leaves its files under the staging name only, which the save's cleanup
removes (the directory is one of the strategy's ``owned_paths``); a save killed during the
renames leaves whole files only.

Example:

```python
names = staged_names(staging_dir(ckpt), rank=0)    # ["__0_0.distcp", "__0_1.distcp"]
publish_staged(ckpt, names)                         # every rank's names, at the commit
```
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Sequence, Union

from dist_ckpt.errors import CheckpointingException
from dist_ckpt.storage import fsync_dir

__all__ = ["STAGING_DIR", "publish_staged", "staged_names", "staging_dir"]

#: the directory, inside the checkpoint, that DCP's files are written into until the commit
STAGING_DIR = ".partial-distcp"


def staging_dir(checkpoint: Union[str, Path]) -> Path:
    """The staging directory of ``checkpoint`` (created if missing: every rank calls this)."""
    path = Path(checkpoint) / STAGING_DIR
    path.mkdir(parents=True, exist_ok=True)
    return path


def staged_names(staging: Path, rank: int) -> List[str]:
    """The DCP files rank ``rank`` wrote into ``staging`` (empty ones included: DCP creates a
    file per writer thread even when it has no item to put in it)."""
    return sorted(p.name for p in staging.glob(f"__{rank}_*.distcp"))


def publish_staged(checkpoint: Union[str, Path], names: Sequence[str]) -> None:
    """Rank 0, at the commit: rename the staged files ``names`` into ``checkpoint``, make the
    renames durable and remove the staging directory (which must then be empty).

    Raises:
        CheckpointingException: a file of ``names`` is missing from the staging directory
            (another process removed it), or the directory holds files not in ``names``.
    """
    directory = Path(checkpoint)
    staging = directory / STAGING_DIR
    missing = [name for name in names if not (staging / name).is_file()]
    if missing:  # checked before any rename: nothing is published
        raise CheckpointingException(
            f"{[str(staging / n) for n in missing]} missing at the commit: a rank wrote them, but they are gone (was "
            f"the checkpoint directory changed by another process?); the save is not committed"
        )
    for name in names:
        os.replace(staging / name, directory / name)
    fsync_dir(directory)
    try:
        staging.rmdir()
    except FileNotFoundError:
        pass
    except OSError as e:
        left = sorted(p.name for p in staging.iterdir())
        raise CheckpointingException(
            f"{staging} still holds {left} after its files were published: files no rank reported writing; "
            f"the save is not committed"
        ) from e
    fsync_dir(directory)
