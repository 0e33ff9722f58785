"""How the public modules (``llama_guard``, ``.httpx2``, ``.aiohttp``, ``.requests``, ``.metrics``) present the
classes they export."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["present_as_public"]


def present_as_public(namespace: Mapping[str, Any]) -> None:
    """The classes a public module exports (``namespace``: its globals, with ``__all__``) that live in private
    modules show as ``<public module>.X`` in reprs, tracebacks and docs, as httpx's do. A class another public
    module presents already (`llama_guard.GuardError`, exported again by every flavour) keeps its name."""
    for name in namespace["__all__"]:
        value = namespace[name]
        if isinstance(value, type) and value.__module__.startswith("llama_guard._"):
            value.__module__ = namespace["__name__"]
