"""Origins (scheme, host, port) and the registry that says which of them are llama-server.

Sans-I/O: nothing here knows about httpx; transports hand in the parts of a URL and the response headers.
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple
from urllib.parse import urlsplit

__all__ = ["LOOPBACK_HOSTS", "Origin", "OriginRegistry", "parse_origin"]

_DEFAULT_PORTS = {"http": 80, "https": 443}
#: Spellings of this machine's loopback that one local server answers to: ``localhost`` resolves to one of the
#: others. An origin listed with one of them matches requests that use another (same scheme and port).
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


class Origin(NamedTuple):
    """Where requests go: the part of a URL that selects a server."""

    scheme: str
    host: str
    port: int

    @classmethod
    def of(cls, scheme: str, host: str, port: int | None) -> Origin:
        scheme = scheme.lower()
        return cls(scheme, host.lower().strip("[]"), port if port is not None else _DEFAULT_PORTS.get(scheme, 0))

    @classmethod
    def of_url(cls, url: Any) -> Origin:
        """The origin of an httpx or httpx2 ``URL`` (anything with ``scheme``, ``host`` and ``port``)."""
        return cls.of(url.scheme, url.host, url.port)

    def same_server_key(self) -> Origin:
        """The key under which origins that reach the same server compare equal: the loopback spellings
        (``localhost``, ``127.0.0.1``, ``[::1]``) of one scheme and port are one server."""
        return self._replace(host="localhost") if self.host in LOOPBACK_HOSTS else self

    def __str__(self) -> str:
        if not self.scheme:  # a placeholder named by its host (stats' OTHER_ORIGINS: "other")
            return self.host
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_origin(text: object) -> Origin:
    """``"http://127.0.0.1:8080"`` -> `Origin`; anything that is not a bare http(s) origin raises `ValueError`."""
    if not isinstance(text, str):
        raise ValueError(f"an origin is a string such as 'http://127.0.0.1:8080'; got {text!r}")
    stripped = text.strip()
    if any(char.isspace() or not char.isprintable() for char in stripped):
        # urlsplit() would silently drop a tab or a newline from the middle ("http://exa\tmple" -> "example").
        raise ValueError(
            f"{text!r} is not a valid origin: it holds a space or a control character; "
            "expected 'http://host[:port]' or 'https://host[:port]'"
        )
    if "://" not in stripped and stripped:  # "localhost:8080": the scheme decides TLS, so it is not guessed
        raise ValueError(
            f"{text!r} is not an origin: it has no scheme; expected 'http://host[:port]' or 'https://host[:port]' "
            f"(did you mean 'http://{stripped}'?)"
        )
    try:
        parts = urlsplit(stripped)
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a valid origin ({exc})") from None
    if parts.scheme.lower() not in _DEFAULT_PORTS or not parts.hostname:
        raise ValueError(f"{text!r} is not an origin; expected 'http://host[:port]' or 'https://host[:port]'")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{text!r} is not an origin: give only scheme, host and port, e.g. 'http://127.0.0.1:8080'")
    _check_host(text, parts.hostname)
    return Origin.of(parts.scheme, parts.hostname, _port(text, parts.netloc.rpartition("]")[2]))


def _check_host(text: str, host: str) -> None:
    """A DNS name or an IPv4 address: letters, digits, '-', '_' and '.'; or an IPv6 address in brackets."""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{text!r} is not a valid origin: {host!r} is not an IPv6 address") from None
    elif not all(char.isalnum() or char in "-_." for char in host):
        raise ValueError(
            f"{text!r} is not a valid origin: the host {host!r} may hold only letters, digits, '-', '_' and '.' "
            "(or be an IPv6 address in brackets)"
        )


def _port(text: str, after_host: str) -> int | None:
    """The port after the host (``":8080"``), None when absent; from 1 to 65535 (0 is no port a server listens on)."""
    _, colon, digits = after_host.rpartition(":")
    if not colon or not digits:
        return None
    port = int(digits) if digits.isascii() and digits.isdigit() else -1
    if not 1 <= port <= 65535:
        raise ValueError(
            f"{text!r} is not a valid origin: the port must be a whole number from 1 to 65535, not {digits!r}"
        )
    return port


def identifies_as_llama_server(headers: Mapping[str, str]) -> bool:
    """llama-server names itself in every response: ``Server: llama.cpp``."""
    return headers.get("server", "").lower().startswith("llama.cpp")


class OriginRegistry:
    """Which origins a transport treats as llama-server, learning them in ``"auto"`` mode.

    Thread-safe: sync transports are shared between threads. Reads take no lock (a set lookup is atomic in
    CPython and a stale miss only delays protection by one response).
    """

    def __init__(self, setting: str | Sequence[str | Origin]) -> None:
        """``setting`` is a policy's normalised ``origins``: "all", "auto", or origins."""
        # Read for every request: a plain attribute rather than a property.
        self.every_origin = setting == "all"
        self._auto = setting == "auto"
        self._known: set[Origin] = set()
        if not isinstance(setting, str):
            self._known = {item if isinstance(item, Origin) else parse_origin(item) for item in setting}
        # Loopback origins under their shared key, so that "localhost" guards requests to "127.0.0.1" too.
        self._loopback = {origin.same_server_key() for origin in self._known if origin.host in LOOPBACK_HOSTS}
        self._lock = threading.Lock()

    @property
    def learns(self) -> bool:
        """True when origins are learnt from responses (``"auto"``)."""
        return self._auto

    def is_llama(self, origin: Origin) -> bool:
        return (
            self.every_origin
            or origin in self._known
            or (origin.host in LOOPBACK_HOSTS and origin.same_server_key() in self._loopback)
        )

    def learn(self, origin: Origin, headers: Mapping[str, str]) -> bool:
        """Record an origin that identified itself as llama-server; True if this response showed it."""
        if not identifies_as_llama_server(headers):
            return False
        if origin not in self._known:
            with self._lock:
                self._known.add(origin)
                if origin.host in LOOPBACK_HOSTS:
                    self._loopback.add(origin.same_server_key())
        return True

    def known(self) -> frozenset[Origin]:
        with self._lock:
            return frozenset(self._known)
