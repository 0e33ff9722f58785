"""The ``llama_guard`` logger and what may appear in its records.

Records name the method, the origin and the path of a request, never its query string (API keys travel there),
its user info, its headers or its body.
"""

from __future__ import annotations

import logging

__all__ = ["describe_request", "logger"]

logger = logging.getLogger("llama_guard")


def describe_request(method: str, scheme: str, host: str, port: int | None, path: str) -> str:
    """``POST http://127.0.0.1:8080/v1/chat/completions``: enough to find the call, nothing secret."""
    host = f"[{host}]" if ":" in host else host
    netloc = host if port is None else f"{host}:{port}"
    return f"{method} {scheme}://{netloc}{path}"
