"""Progress bars for long commands: library progress events drawn with tqdm, on stderr.

The library reports progress through callbacks ([`ProgressEvent`][dist_ckpt.engine.report.ProgressEvent]) and
never draws anything; this module -- imported by the CLI only, so that importing dist_ckpt never
imports tqdm -- turns the events into bars:

* a phase that counts bytes (a save's or a load's sharded tensors as they are written or
  read, a conversion's tensors) gets a bar in bytes (binary units, the rate in GiB/s like
  every other throughput the commands print), with the key of the tensor just written, if known;
* other phases advance one bar of the operation's phases.

Example:

```python
with ProgressBars(enabled=True) as bars:
    convert(src, dst, to="zarr", progress=bars)
```
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Dict, Optional, Type

from dist_ckpt.cli.common import human_bytes, human_rate
from dist_ckpt.engine.report import ProgressEvent

__all__ = ["ProgressBars", "byte_bar"]

#: a bytes bar: sizes as human_bytes writes them, the rate in GiB/s (tqdm's own unit scaling
#: would print "MB" for mebibytes)
_BYTES_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {done_of_total} [{elapsed}<{remaining}, {gib_rate}{postfix}]"


def byte_bar(total: int, desc: str, leave: bool = True) -> Any:
    """A tqdm bar counting ``total`` bytes, drawn on stderr (``.update(nbytes)`` as they pass)."""
    from tqdm import tqdm

    class _BytesBar(tqdm):  # type: ignore[misc]  # tqdm is untyped
        @property
        def format_dict(self) -> Dict[str, Any]:
            d: Dict[str, Any] = super().format_dict
            elapsed = float(d.get("elapsed") or 0.0)
            d["done_of_total"] = f"{human_bytes(int(d['n']))}/{human_bytes(int(d['total'] or 0))}"
            d["gib_rate"] = human_rate(d["n"], elapsed) if elapsed > 0 else "? GiB/s"
            return d

    return _BytesBar(total=total, desc=desc, leave=leave, dynamic_ncols=True, bar_format=_BYTES_FORMAT)


class ProgressBars:
    """A progress callback that draws tqdm bars (does nothing when ``enabled`` is False).

    Args:
        enabled: draw bars at all.
        description: label of the bar of phases.
    """

    def __init__(self, enabled: bool, description: str = "") -> None:
        self.enabled = enabled
        self.description = description
        self._phases: Any = None
        self._bytes: Dict[str, Any] = {}

    def __enter__(self) -> "ProgressBars":
        return self

    def __exit__(
        self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.close()

    def __call__(self, event: ProgressEvent) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        if event.bytes_total:
            bar = self._bytes.get(event.phase)
            if bar is None:
                bar = self._bytes[event.phase] = byte_bar(event.bytes_total, event.phase)
            bar.update(event.bytes_done - bar.n)
            if event.item is not None:
                bar.set_postfix_str(event.item, refresh=False)
            if not event.done:
                return  # the byte bar shows the step while it runs; its end advances the bar of steps too
        if self._phases is None:
            self._phases = tqdm(
                total=event.total,
                desc=self.description or event.operation.value,
                unit="step",
                leave=True,
                dynamic_ncols=True,
            )
        elif self._phases.total != event.total:  # an operation that learns how many phases it has
            self._phases.total = event.total
        if event.done:
            self._phases.update(1)
        self._phases.set_postfix_str(event.phase, refresh=True)

    def close(self) -> None:
        """Close every bar (each stays on screen in its final state)."""
        for bar in self._bytes.values():
            bar.close()
        self._bytes.clear()
        if self._phases is not None:
            self._phases.close()
            self._phases = None
