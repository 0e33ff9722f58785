"""Per-request options where the HTTP library's requests carry no extensions (aiohttp, requests): they ride on the
calling task's or thread's context, set by `request_options` and read by the stack's driver (`current_options`).
httpx requests carry theirs in ``request.extensions["llama_guard"]``."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from .policy import GuardPolicy

__all__ = ["current_options", "request_options"]

_OPTIONS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("llama_guard_options", default=None)


@contextlib.contextmanager
def request_options(**overrides: Any) -> Iterator[None]:
    """Options for the guarded requests this task (asyncio) or thread sends inside the block (``GuardPolicy``
    fields, as httpx's ``request.extensions["llama_guard"]``)::

        with request_options(first_byte_timeout=2.0):
            response = await session.post(...)  # aiohttp; session.post(...) with requests

    Blocks nest (the inner one's fields win). Unknown fields (or ``origins``, which belongs to the guard) raise
    `ValueError` here, naming what is allowed.
    """
    GuardPolicy().merged(overrides)  # validates now, where the mistake is
    token = _OPTIONS.set({**(_OPTIONS.get() or {}), **overrides})
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def current_options() -> dict[str, Any] | None:
    """The options of the `request_options` blocks around this call, or None outside any."""
    return _OPTIONS.get()
