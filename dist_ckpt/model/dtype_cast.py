"""Loading a tensor in another dtype than the stored one: the one rule every loader follows.

Megatron-Core and ``torch.distributed.checkpoint`` fill the requested tensor whatever the stored
dtype: fp32 master weights load into a bf16 model, an int64 counter into a float32 request.
dist_ckpt does the same by default. Every loader reads each stored piece in its stored dtype --
into a scratch buffer of at most that piece (a bounce buffer, a decoded chunk) -- and copies it
into the requested tensor's view with `copy_cast()`, ``Tensor.copy_``, which converts. A
request in the stored dtype is read straight into the destination, as before; the checksums of
a load are always computed over the stored bytes.

The rule (`cast_refusal()`):

* any real or integer dtype, and ``bool``, to any other: as ``Tensor.copy_`` converts
  (``Tensor.to`` gives the same values). Floats round to nearest; a float becomes an integer by
  truncation toward zero (a value outside the integer's range, NaN or inf gives whatever torch
  gives: do not rely on it); any value becomes ``bool`` as ``value != 0``; ``bool`` becomes 0 or 1;
* real to complex: the imaginary part is 0;
* complex to real is refused, even when casting is allowed: it would silently drop the
  imaginary part (torch only warns). Request a complex dtype.

With ``allow_dtype_cast=False`` (a load option; see [`dist_ckpt.load()`][dist_ckpt.engine.load.load]) any difference is
refused, as before casting existed: the loader raises
[`LoadMismatchError`][dist_ckpt.errors.LoadMismatchError] naming the key, the rank, the checkpoint and both
dtypes before reading anything.

Example:

```python
cast_refusal(torch.float32, torch.bfloat16, allow=True)      # None: allowed
cast_refusal(torch.complex64, torch.float32, allow=True)     # "... would drop the imaginary part ..."
copy_cast(bf16_view, fp32_piece)                              # converts while copying
```
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["cast_refusal", "copy_cast", "describe_cast"]


def cast_refusal(stored: torch.dtype, requested: torch.dtype, allow: bool) -> Optional[str]:
    """Why a tensor stored as ``stored`` cannot be loaded as ``requested`` (None if it can).

    ``allow`` is the load's ``allow_dtype_cast``. The reason is phrased to follow the key in a
    message (``"'w' is stored as ..."``) and says how to fix it.

    Example:

    ```python
    cast_refusal(torch.float32, torch.float16, allow=False)
    # "is stored as torch.float32, requested as torch.float16 (allow_dtype_cast=False; ...)"
    ```
    """
    if stored == requested:
        return None
    if stored.is_complex and not requested.is_complex:
        return (
            f"is stored as {stored}, requested as {requested}: casting would drop the imaginary part; "
            "request a complex dtype"
        )
    if not allow:
        return (
            f"is stored as {stored}, requested as {requested} (allow_dtype_cast=False; "
            "allow the cast or request the stored dtype)"
        )
    return None


def describe_cast(key: str, stored: torch.dtype, requested: torch.dtype) -> str:
    """``"'key' (float32 -> bfloat16)"``: one entry of a load's log of its casts."""
    return f"{key!r} ({str(stored).replace('torch.', '')} -> {str(requested).replace('torch.', '')})"


def copy_cast(destination: torch.Tensor, stored: torch.Tensor) -> None:
    """Copy ``stored`` (a piece read in its stored dtype) into ``destination`` (a view of the
    requested tensor, any device), converting to the destination's dtype as `cast_refusal()`
    describes. No copy beyond the destination's is made: ``copy_`` converts element by element
    (a piece on another device than the destination is moved first, by torch).

    Example:

    ```python
    copy_cast(dest[0:2], torch.tensor([1.5, 2.5]))   # dest is bfloat16: holds 1.5, 2.5
    ```
    """
    destination.copy_(stored)
