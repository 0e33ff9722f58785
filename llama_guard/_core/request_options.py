"""Per-request options where the HTTP library's requests carry no extensions (aiohttp, requests): they ride on the
calling task's or thread's context, set by `request_options` and read by the stack's driver (`current_options`).
httpx requests carry theirs in ``request.extensions["llama_guard"]``."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

from .policy import GuardPolicy, per_request_fields

__all__ = ["current_options", "request_options"]

_OPTIONS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("llama_guard_options", default=None)


def request_options(**overrides: Any) -> contextlib.AbstractContextManager[None]:
    """Options for the guarded requests this task (asyncio) or thread sends inside the block (``GuardPolicy``
    fields, as httpx's ``request.extensions["llama_guard"]``)::

        with request_options(first_byte_timeout=2.0):
            response = await session.post(...)  # aiohttp; session.post(...) with requests

    Blocks nest (the inner one's fields win). Unknown fields (or ``origins``, which belongs to the guard) and bad
    values raise `ValueError` at this call, naming what is accepted.
    """
    _check(overrides)
    return _options_block(overrides)


def _check(overrides: dict[str, Any]) -> None:
    allowed = per_request_fields()
    unknown = sorted(key for key in overrides if key not in allowed)
    if unknown:
        fields = {field.name for field in dataclasses.fields(GuardPolicy)}
        guard_wide = [key for key in unknown if key in fields]
        note = f" ({', '.join(guard_wide)}: the guard's own, set on its GuardPolicy)" if guard_wide else ""
        raise ValueError(
            f"request_options() got unknown or transport-wide keys {unknown}{note}; it takes the GuardPolicy fields "
            f"a request may set: {', '.join(sorted(allowed))}"
        )
    try:
        GuardPolicy().merged(overrides)
    except ValueError as exc:
        raise ValueError(f"request_options(): {exc}") from None


@contextlib.contextmanager
def _options_block(overrides: dict[str, Any]) -> Iterator[None]:
    token = _OPTIONS.set({**(_OPTIONS.get() or {}), **overrides})
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def current_options() -> dict[str, Any] | None:
    """The options of the `request_options` blocks around this call, or None outside any."""
    return _OPTIONS.get()
