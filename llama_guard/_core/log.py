"""The ``llama_guard`` logger and what may appear in its records.

Records name the method, the origin and the path of a request, never its query string (API keys travel there),
its user info, its headers or its body.

As the Python docs advise for a library, the logger has a `logging.NullHandler` and no other: an application
that configures logging sees the guard's records; one that does not is not written to. A burst of stalled
connections is one WARNING per origin and episode (``_runtime/stall_log.py``); each rescue or reconnect is a DEBUG
record. A condition that lasts is one WARNING per process (`WarnOnce`, the process's in its `ProcessState`).
"""

from __future__ import annotations

import logging
import re
import threading

__all__ = [
    "WarnOnce",
    "describe_request",
    "logger",
    "without_quoted_values",
    "without_url_secrets",
]

logger = logging.getLogger("llama_guard")
logger.addHandler(logging.NullHandler())


class WarnOnce:
    """A WARNING logged the first time only (the process's is ``ProcessState.warnings``): for a condition that holds
    for as long as the process runs (a library version, a transport that gives no socket), which the stats then keep
    showing."""

    def __init__(self) -> None:
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def warning(self, message: str) -> bool:
        """Log ``message`` unless it was logged before; True if it was logged now."""
        with self._lock:
            if message in self._said:
                return False
            self._said.add(message)
        logger.warning("%s", message)
        return True

    def warn_if(self, reason: str | None) -> str | None:
        """Log ``reason`` once, if there is one (a version gate's answer); return it."""
        if reason is not None:
            self.warning(reason)
        return reason

    def forget(self) -> None:
        """Say every message again once (tests)."""
        with self._lock:
            self._said.clear()


def describe_request(method: str, scheme: str, host: str, port: int | None, path: str) -> str:
    """``POST http://127.0.0.1:8080/v1/chat/completions``: enough to find the call, nothing secret."""
    host = f"[{host}]" if ":" in host else host
    netloc = host if port is None else f"{host}:{port}"
    return f"{method} {scheme}://{netloc}{path}"


_QUOTED = re.compile(r"b?'(?:[^'\\]|\\.)*'" + r'|b?"(?:[^"\\]|\\.)*"')


# In an error message: a URL's user info, and the query string of a URL or of a path (``url: /v1/x?key=...``).
_USER_INFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^\s/'\"@]*@")
_QUERY = re.compile(r"(?P<url>(?:\b[a-zA-Z][a-zA-Z0-9+.-]*://|(?<![\w/.])/)[^\s?'\"]*)\?[^\s'\")]*")


def without_url_secrets(text: str) -> str:
    """``... url: http://user:pw@h:8080/v1/x?key=sk-1`` -> ``... url: http://<redacted>@h:8080/v1/x?<redacted>``:
    where an error message spells a URL out, its user info and query string (API keys travel there)."""
    return _QUERY.sub(r"\g<url>?<redacted>", _USER_INFO.sub(r"\g<scheme><redacted>@", text))


def without_quoted_values(text: str) -> str:
    """``Illegal header value b'Bearer sk-...\\n'`` -> ``Illegal header value <redacted>``.

    h11 quotes the header it refuses to send, value included; that value may be a credential, and the guard's
    error messages and history repeat the message.
    """
    return _QUOTED.sub("<redacted>", text)
