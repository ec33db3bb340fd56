"""One scale for the tests' wall-clock limits, so that a busy machine does not fail them.

A test that waits for something to happen (a kill point, a subprocess, a thread, a server's
start) bounds the wait only so that a hang fails instead of blocking the run; the bound must not
decide the outcome when the machine is merely slow. Each such bound is written as
``scaled(seconds)``, ``seconds`` being what an idle 2-core machine needs with a margin; the scale
comes from ``DIST_CKPT_TEST_TIME_SCALE`` and defaults to a generous 3. A working test never
waits out its bound, so a large scale only lengthens the wait for a hang.

Timeouts that a test waits out on purpose (a writer that must time out, a watchdog that must
fire) are not bounds of this kind and are not scaled.

Example:

```python
deadline = time.monotonic() + scaled(60)
proc.communicate(timeout=scaled(120))
```
"""

from __future__ import annotations

import os

#: the environment variable that sets the scale (a positive number)
SCALE_ENV = "DIST_CKPT_TEST_TIME_SCALE"
DEFAULT_SCALE = 3.0


def time_scale() -> float:
    """The factor every test deadline is multiplied by (``DIST_CKPT_TEST_TIME_SCALE``, default 3).

    Raises:
        ValueError: the variable is set to something other than a positive number.
    """
    raw = os.environ.get(SCALE_ENV, "").strip()
    if not raw:
        return DEFAULT_SCALE
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"{SCALE_ENV}={raw!r}: expected a positive number of times the idle-machine deadlines")
    return scale


def scaled(seconds: float) -> float:
    """``seconds`` (enough on an idle machine) times `time_scale()`."""
    return seconds * time_scale()
