"""The named steps of a save, a load and a conversion: one definition of each name.

Reports ([`CheckpointReport`][dist_ckpt.engine.report.CheckpointReport]), progress events and watchdog
warnings show these names, and callers look phases up by them, so they are an enum rather than
strings typed at each call: a misspelt step is an AttributeError, not a new, empty phase.

Example:

```python
result = save_with_report(sd, "ckpt/iter_10")
result.report.phase_seconds(Step.SAVE_SHARDED)
```
"""

from __future__ import annotations

from enum import Enum


class Step(str, Enum):
    """A step of [`save()`][dist_ckpt.engine.save.save], [`load()`][dist_ckpt.engine.load.load] or
    [`convert()`][dist_ckpt.tools.convert.convert].

    The value is the name reports and progress events show; a member compares equal to it.
    """

    # save
    PREPARE_SAVE = "preparing the save"
    CHECK_STATE = "checking the state to save"
    VALIDATE_SHARDING = "validating the sharding"
    SAVE_COMMON = "saving the common state"
    SAVE_SHARDED = "saving sharded tensors"
    PREPARE_ASYNC = "preparing the async save"
    WRITE_IN_BACKGROUND = "writing in the background (until finalized)"
    FINALIZE_SHARDED = "finalizing the sharded tensors"
    COMMIT = "committing metadata.json"
    WRITE_INTEGRITY = "writing integrity.json"
    # load
    OPEN_CHECKPOINT = "opening the checkpoint"
    VERIFY_INTEGRITY = "verifying integrity.json"
    LOAD_COMMON = "loading the common state"
    MATCH_KEYS = "matching the requested keys"
    LOAD_SHARDED = "loading sharded tensors"
    ASSEMBLE = "assembling the state"
    # convert
    OPEN_SOURCE = "opening the source"
    COPY_TENSORS = "copying tensors"
    COPY_COMMON = "copying the common state"
    COPY_OBJECTS = "copying ShardedObjects"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


__all__ = ["Step"]
