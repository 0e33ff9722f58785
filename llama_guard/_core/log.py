"""The ``llama_guard`` logger and what may appear in its records.

Records name the method, the origin and the path of a request, never its query string (API keys travel there),
its user info, its headers or its body.
"""

from __future__ import annotations

import logging
import re

__all__ = ["describe_request", "logger", "without_quoted_values"]

logger = logging.getLogger("llama_guard")


def describe_request(method: str, scheme: str, host: str, port: int | None, path: str) -> str:
    """``POST http://127.0.0.1:8080/v1/chat/completions``: enough to find the call, nothing secret."""
    host = f"[{host}]" if ":" in host else host
    netloc = host if port is None else f"{host}:{port}"
    return f"{method} {scheme}://{netloc}{path}"


_QUOTED = re.compile(r"b?'(?:[^'\\]|\\.)*'" + r'|b?"(?:[^"\\]|\\.)*"')


def without_quoted_values(text: str) -> str:
    """``Illegal header value b'Bearer sk-...\\n'`` -> ``Illegal header value <redacted>``.

    h11 quotes the header it refuses to send, value included; that value may be a credential, and the guard's
    error messages and history repeat the message.
    """
    return _QUOTED.sub("<redacted>", text)
