"""`GuardError`: the mixin of every error llama_guard raises, shared by the httpx and httpx2 flavours."""

from __future__ import annotations

__all__ = ["GuardError"]


class GuardError(Exception):
    """Mixin of every error raised by llama_guard. ``except httpx.<Class>`` still catches them.

    Attributes:
        attempts: attempts made for the request, the first included.
        elapsed: seconds from the first attempt to the error.
        history: one line per failed attempt: what failed and what the guard decided.
    """

    attempts: int = 1
    elapsed: float = 0.0
    history: tuple[str, ...] = ()
