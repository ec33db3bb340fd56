"""Requests that perform a save in the background, and their finalization.

An :class:`AsyncRequest` separates a save into the part that can run without collectives
(``async_fn(*async_fn_args)``, the writing) and the collective ``finalize_fns`` that run on
every rank once the writing is done (e.g. committing ``metadata.json``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, List, Optional, Tuple

from ..errors import CheckpointingException


@dataclass(frozen=True)
class AsyncRequest:
    """A save split into background work and collective finalization.

    Args:
        async_fn: the background work (may be None if there is nothing to write).
        async_fn_args: positional arguments of ``async_fn``.
        finalize_fns: called in order, on every rank, after ``async_fn`` finished everywhere.
        is_frozen: a frozen request accepts no more finalize functions.
    """

    async_fn: Optional[Callable[..., Any]]
    async_fn_args: Tuple[Any, ...]
    finalize_fns: List[Callable[[], Any]] = field(default_factory=list)
    is_frozen: bool = False

    def add_finalize_fn(self, fn: Callable[[], Any]) -> None:
        """Append a finalization step (only before the request is frozen)."""
        if self.is_frozen:
            raise CheckpointingException("cannot add a finalize function to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def execute_sync(self) -> None:
        """Run the whole request in the calling process (the synchronous fallback)."""
        if self.async_fn is not None:
            self.async_fn(*self.async_fn_args)
        for fn in self.finalize_fns:
            fn()

    def freeze(self) -> "AsyncRequest":
        """A frozen copy, ready to be scheduled."""
        return replace(self, finalize_fns=list(self.finalize_fns), is_frozen=True)
