"""What ``doctor`` measured: plain data, shared by the checks (which fill it), the verdicts and the report."""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass, field, replace
from typing import Literal

from ..load import LoadRow

__all__ = [
    "AFFECTED",
    "COULD_NOT_TELL",
    "NOT_AFFECTED",
    "REUSE_CLOSED",
    "REUSE_RESET",
    "BurstCheck",
    "BurstRound",
    "DoctorError",
    "DoctorRun",
    "Finding",
    "Identity",
    "KeepAliveCheck",
    "Status",
    "Target",
    "base_candidates",
    "parse_target",
    "redact_url",
]

Status = Literal["affected", "not_affected", "could_not_tell"]
AFFECTED: Status = "affected"
NOT_AFFECTED: Status = "not_affected"
COULD_NOT_TELL: Status = "could_not_tell"


class DoctorError(Exception):
    """doctor cannot examine this server; the message is one line that says what was wrong (exit status 2)."""


@dataclass(frozen=True)
class Target:
    """Where the server is: ``http://HOST:PORT`` and an optional path prefix (llama-server's ``--api-prefix``,
    or a reverse proxy's)."""

    host: str
    port: int
    prefix: str = ""

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.prefix}"

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def path(self, path: str) -> str:
        return self.prefix + path


_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(?!\d)")


_NO_USER = "no user or password allowed (doctor sends none; a server's --api-key goes in --api-key or LLAMA_API_KEY)"


def _password(url: str) -> tuple[int, int] | None:
    """Where the password of ``url``'s userinfo is (``user:PASSWORD@``), or None. The userinfo ends at the last
    ``@``: a password may hold ``/``, ``?``, ``#`` or ``@`` unescaped, and must not show through a wrong split."""
    start = url.find("://") + 3 if "://" in url else 0
    at = url.rfind("@")
    colon = url.find(":", start, at) if at > start else -1
    return (colon + 1, at) if colon >= 0 else None


def redact_url(url: str) -> str:
    """``url`` safe to print: a password in it shown as ``***`` (``http://user:***@host:8080``)."""
    where = _password(url)
    return url if where is None else url[: where[0]] + "***" + url[where[1] :]


def parse_target(url: str) -> Target:
    """``http://127.0.0.1:8080`` (a bare ``HOST:PORT`` too) -> Target; DoctorError naming what is accepted, with
    any password in the URL shown as ``***``."""
    where = _password(url)
    return _parse_target(url, redact_url(url), url[where[0] : where[1]] if where is not None else "")


def _parse_target(url: str, shown: str, secret: str) -> Target:
    accepted = "expected http://HOST[:PORT][/PATH], e.g. http://127.0.0.1:8080"
    text = url.strip()
    scheme = _SCHEME.match(text)
    # "localhost:8080" is a host and a port; "htp://..." or "http:/x" is a scheme with a typo around it.
    if scheme is not None:
        name = scheme.group(1)
        if name.lower() == "https":
            raise DoctorError(
                f"bad URL {shown!r}: only http:// is supported (the checks watch llama-server's own plain-HTTP "
                f"connections; run doctor against the server, not a TLS proxy); {accepted}"
            )
        if name.lower() != "http":
            raise DoctorError(f"bad URL {shown!r}: unknown scheme {name + ':'!r} (did you mean 'http:'?); {accepted}")
        if not text[scheme.end() :].startswith("//"):
            raise DoctorError(f"bad URL {shown!r}: malformed, 'http:' must be followed by '//'; {accepted}")
    elif "://" in text:
        raise DoctorError(f"bad URL {shown!r}: malformed scheme before '://'; {accepted}")
    else:
        text = "http://" + text
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError as exc:
        if secret:  # urllib quotes the port it could not read: in "http://user:pw/x@host", the password's head
            raise DoctorError(f"bad URL {shown!r}: {_NO_USER}; {accepted}") from None
        raise DoctorError(f"bad URL {shown!r}: {exc}; {accepted}") from None
    if not parts.hostname:
        raise DoctorError(f"bad URL {shown!r}: no host; {accepted}")
    if parts.username is not None or parts.password is not None:
        raise DoctorError(f"bad URL {shown!r}: {_NO_USER}; {accepted}")
    if parts.query or parts.fragment:
        raise DoctorError(f"bad URL {shown!r}: no query or fragment allowed; {accepted}")
    return Target(parts.hostname, port if port is not None else 80, parts.path.rstrip("/"))


def base_candidates(target: Target) -> list[Target]:
    """Where llama-server's base may be behind the URL given: its path, then each shorter prefix down to the
    root (``/v1`` -> ``/v1``, root; ``/proxy/v1/`` -> ``/proxy/v1``, ``/proxy``, root)."""
    parts = [part for part in target.prefix.split("/") if part]
    return [
        replace(target, prefix="".join(f"/{part}" for part in parts[:count])) for count in range(len(parts), -1, -1)
    ]


@dataclass(frozen=True)
class Identity:
    """Who answered: ``GET /health`` and ``GET /props``."""

    server_header: str | None
    build_info: str | None
    build_number: int | None
    model: str | None
    total_slots: int | None


AfterResponse = Literal["eof", "reset", "open", "data"]

#: ``KeepAliveCheck.reuse`` when the server dropped the second request on a kept connection: the words the
#: verdicts quote ("then the server closed the connection without answering the second request").
REUSE_CLOSED = "closed the connection without answering the second request"
REUSE_RESET = "reset the connection without answering the second request"


@dataclass(frozen=True)
class KeepAliveCheck:
    """One completion on a fresh raw connection, and what the connection did after the response."""

    stream: bool
    #: Why there is no complete response (connect failure, timeout, broken HTTP); None when there is one.
    error: str | None = None
    status: int | None = None
    #: The server's own error message for a non-200 answer (llama-server's ``{"error":{"message":...}}``).
    server_message: str | None = None
    connection_header: str | None = None
    keep_alive_header: str | None = None
    chunked: bool = False
    first_byte: float | None = None
    complete: float | None = None
    #: After the response: the server closed (``eof``/``reset``), kept it ``open``, or sent more (``data``).
    after: AfterResponse | None = None
    #: Seconds from the response's last byte to the close, when it closed.
    closed_after: float | None = None
    #: The second request on the same connection, when it stayed open: "answered 200", ``REUSE_CLOSED`` or
    #: ``REUSE_RESET`` (dropped unanswered), or why else it failed.
    reuse: str | None = None

    @property
    def announced_close(self) -> bool:
        return "close" in (self.connection_header or "").lower()

    @property
    def answered(self) -> bool:
        return self.error is None and self.status == 200


@dataclass(frozen=True)
class BurstRound:
    """``connections`` connections opened at once, then ``GET /health`` on each."""

    #: Seconds to each connection's first byte, in connect order; None: none within ``window``.
    first_bytes: tuple[float | None, ...]
    window: float

    @property
    def stalled(self) -> int:
        return sum(1 for value in self.first_bytes if value is None)


@dataclass(frozen=True)
class BurstCheck:
    connections: int
    rounds: tuple[BurstRound, ...] = ()
    #: Why the burst could not be made (e.g. connections refused); None when it ran.
    error: str | None = None

    @property
    def stalled_round(self) -> BurstRound | None:
        return next((item for item in self.rounds if item.stalled), None)


@dataclass(frozen=True)
class Finding:
    """The verdict on one defect, why, and what to do about it."""

    defect: str
    title: str
    status: Status
    evidence: tuple[str, ...]
    fix: str | None


@dataclass
class DoctorRun:
    """Everything one run of doctor saw and concluded; filled in as the checks go."""

    target: Target
    started: float
    #: The URL as given, when the server's base was found at another path (``/v1`` -> the root).
    given_url: str | None = None
    identity: Identity | None = None
    stream: KeepAliveCheck | None = None
    nonstream: KeepAliveCheck | None = None
    plain: LoadRow | None = None
    guard: LoadRow | None = None
    burst: BurstCheck | None = None
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0
