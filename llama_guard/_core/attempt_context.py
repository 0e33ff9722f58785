"""The guarded request whose attempt runs in this thread or task, for the stacks' connection hooks.

A stack's hook on new connections (httpcore's network backend, aiohttp's connector, urllib3's connection class) is
shared by every request of its pool; it learns which request a new connection is for from this context variable,
set around the attempt (or, in httpcore, around a new connection's first request, inside which it connects). A
context variable is per thread (sync clients) and per task (asyncio, trio), as an attempt is. The value is the
request's `RequestPlan`: its machine is made when the hook first needs it (`RequestPlan.machine`)."""

from __future__ import annotations

import contextvars

from .guard import RequestPlan

__all__ = ["CURRENT_PLAN"]

CURRENT_PLAN: contextvars.ContextVar[RequestPlan | None] = contextvars.ContextVar("llama_guard_plan", default=None)
