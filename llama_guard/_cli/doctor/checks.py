"""The I/O half of ``doctor``: each check talks to the server and returns what it saw (``_doctor_model``).

The identity check raises ``DoctorError`` when the server cannot be examined at all (unreachable, not a
llama-server, loading, wants an API key); the later checks record their failures instead, so one failed check
gives a "could not tell" and the others still run.

Every completion is tiny (``max_tokens``), and the identity requests say ``Connection: close``: an idle
keep-alive connection would hold one of the server's few HTTP threads for seconds.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from dataclasses import replace
from typing import TextIO

import httpx

from ..._burst import open_burst
from ..._core.llama_server import build_number
from ..._core.policy import GuardPolicy
from ..._httpx.sync_transport import GuardTransport
from ..load import LoadRow, proxy_load
from .model import (
    REUSE_CLOSED,
    REUSE_RESET,
    BurstCheck,
    BurstRound,
    DoctorError,
    Identity,
    KeepAliveCheck,
    Target,
    base_candidates,
)
from .progress import SILENT, Waits
from .wire import (
    ClosedUnanswered,
    NotHttp,
    RawConnection,
    RawResponse,
    WireError,
    connect,
    read_first_bytes,
    shown_bytes,
)

__all__ = [
    "BURST_WINDOW",
    "LOAD_CONNECTIONS",
    "LOAD_WORKERS",
    "burst_check",
    "burst_window",
    "locate",
    "keepalive_check",
    "load_check",
    "stuck_bound",
]

CHAT = "/v1/chat/completions"
#: How long to wait for the close after a stream's final chunk. llama-server closes within microseconds; a
#: server that keeps the connection this long is then asked a second request on it.
STREAM_CLOSE_WAIT = 1.0
#: How long a non-streamed response's connection must stay open before the second request on it.
NONSTREAM_OPEN_WAIT = 0.3
#: A connection of the burst whose ``GET /health`` gets no byte within this (or ``--timeout``, if shorter) is
#: stalled: a server thread answers /health in milliseconds, and llama-server's keep-alive timeout (5 s) would free
#: a thread soon after.
BURST_WINDOW = 3.0
#: Bursts until one stalls: the defect is a race, and a burst in which every connection is served ends at once.
BURST_ROUNDS = 3
#: Between bursts: cpp-httplib's dynamic threads wait 3 s for more work before they exit. Idle, they serve the
#: next burst without a stall, so the next burst comes once the pool is back to its base threads.
BURST_PAUSE = 3.5
#: The pooled load: threads sharing one client, and its pool size.
LOAD_WORKERS = 8
LOAD_CONNECTIONS = 4
#: No new request of the load after this many seconds, whatever ``--requests`` says.
LOAD_BUDGET = 30.0
#: A request of the load with no answer within ``STUCK_FACTOR`` times the slowest completion of the keep-alive
#: checks (at least ``STUCK_FLOOR`` s, at most ``--timeout``) counts as stuck instead of being waited out.
STUCK_FACTOR = 10.0
STUCK_FLOOR = 1.0


def stuck_bound(completions: list[float | None], timeout: float) -> float:
    """Seconds after which a request of the pooled load counts as stuck: ``STUCK_FACTOR`` times the slowest
    completion the server gave doctor alone, at least ``STUCK_FLOOR``, at most ``timeout``."""
    slowest = max((value for value in completions if value is not None), default=None)
    if slowest is None:
        return timeout
    return round(min(timeout, max(STUCK_FLOOR, STUCK_FACTOR * slowest)), 1)


def chat_body(*, stream: bool, max_tokens: int) -> dict[str, object]:
    return {
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": max_tokens,
        "stream": stream,
        "temperature": 0.0,
    }


def _auth(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("Authorization", f"Bearer {api_key}"),) if api_key else ()


class _ConnectTimeout(TimeoutError):
    """The connect itself timed out (as opposed to the wait for an answer)."""


def describe_error(exc: BaseException, target: Target, what: str, timeout: float) -> str:
    """One line for a failed exchange; the exception types are those of ``_doctor_wire``."""
    where = target.host_header
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host {target.host!r}: {exc.strerror}"
    if isinstance(exc, ConnectionRefusedError):
        return f"cannot connect to {where}: connection refused (is llama-server running and listening there?)"
    if isinstance(exc, _ConnectTimeout):
        return f"cannot connect to {where}: no answer to the connection attempt within {timeout:g} s"
    if isinstance(exc, TimeoutError):
        return f"{where} accepted the connection but sent no complete answer to {what} within {timeout:g} s"
    if isinstance(exc, ClosedUnanswered):
        return f"{where} closed the connection without answering {what}"
    if isinstance(exc, NotHttp):
        tls = " (a TLS record: is it an https:// server?)" if exc.first[:1] in (b"\x15", b"\x16") else ""
        return (
            f"{where} answered {what}, but not in HTTP: {shown_bytes(exc.first)}{tls} (an HTTP answer starts with "
            "'HTTP/'); is that port llama-server's?"
        )
    if isinstance(exc, WireError):
        return f"{where} did not answer {what} in HTTP/1.1: {exc}"
    if isinstance(exc, OSError):
        return f"{what} to {where} failed: {exc.strerror or exc}"
    return f"{what} to {where} failed: {exc}"


def _open(target: Target, timeout: float, waits: Waits) -> RawConnection:
    try:
        with waits.waiting(f"{target.host_header} to accept the connection", timeout):
            sock = connect(target.host, target.port, timeout)
    except TimeoutError as exc:
        raise _ConnectTimeout(str(exc)) from exc
    return RawConnection(sock, target.host_header)


def _server_message(response: RawResponse) -> str | None:
    """llama-server's error message (``{"error":{"message":...}}``), short; never anything else of a body."""
    try:
        document = json.loads(response.body)
    except ValueError:
        return None
    error = document.get("error") if isinstance(document, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message[:200] if isinstance(message, str) else None


def _get(target: Target, path: str, timeout: float, api_key: str | None, waits: Waits) -> RawResponse:
    what = f"GET {target.path(path)}"
    try:
        with _open(target, timeout, waits) as conn, waits.waiting(f"an answer to {what}", timeout):
            headers = (("Connection", "close"), *_auth(api_key))
            return conn.request("GET", target.path(path), timeout=timeout, headers=headers)
    except (OSError, WireError) as exc:
        raise DoctorError(describe_error(exc, target, what, timeout)) from None


def _props_document(props: RawResponse) -> dict[str, object]:
    document: object = None
    if props.status == 200:
        with contextlib.suppress(ValueError):
            document = json.loads(props.body)
    return document if isinstance(document, dict) else {}


def locate(
    target: Target, timeout: float, api_key: str | None, *, key_from: str | None = None, waits: Waits = SILENT
) -> tuple[Target, Identity]:
    """Find llama-server behind the URL given: ``GET /health`` and ``GET /props`` under its path, then under each
    shorter prefix down to the root (a ``/v1`` base URL is the root's). The base found, and who is there;
    DoctorError when it cannot be examined, naming every path tried. ``key_from`` names where ``api_key`` came
    from (``--api-key``, ``LLAMA_API_KEY``), for the error when the server rejects it."""
    tried: list[str] = []
    for candidate in base_candidates(target):
        health = _get(candidate, "/health", timeout, api_key, waits)
        server = health.header("Server")
        is_llama_header = (server or "").lower().startswith("llama.cpp")
        if health.status == 503 and is_llama_header:
            message = _server_message(health) or "unavailable"
            raise DoctorError(
                f"{candidate.url} is not ready (GET {candidate.path('/health')} answered 503: {message}); "
                "run doctor again once it answers 200"
            )
        props = _get(candidate, "/props", timeout, api_key, waits)
        if props.status in (401, 403) and (is_llama_header or health.status == 200) and api_key:
            # The key was sent and refused: a wrong key, not a missing one. The server's words, never the key.
            said = (_server_message(props) or "").replace(api_key, "***")
            raise DoctorError(
                f"{candidate.url} rejected the API key given with {key_from or '--api-key'} (GET "
                f"{candidate.path('/props')} answered {props.status}{': ' + said if said else ''}); give the key "
                "the server was started with (its --api-key)"
            )
        if props.status in (401, 403) and (is_llama_header or health.status == 200):
            raise DoctorError(
                f"{candidate.url} wants an API key (GET {candidate.path('/props')} answered {props.status}); "
                "pass --api-key KEY or set LLAMA_API_KEY"
            )
        info = _props_document(props)
        llama_props = "build_info" in info or "default_generation_settings" in info
        if health.status == 200 and (llama_props or (is_llama_header and props.status == 200)):
            return candidate, _identity(server, info)
        tried.append(
            f"GET {candidate.path('/health')} answered {health.status}, GET {candidate.path('/props')} answered "
            f"{props.status}{' with llama-server fields' if llama_props else ''}"
        )
    raise DoctorError(
        f"found no llama-server behind {target.url}: {'; '.join(tried)} (llama-server answers 200 to both, "
        f"with its build in /props; the Server header was not 'llama.cpp' either). Give the server's own URL, "
        "e.g. http://127.0.0.1:8080"
    )


def _identity(server: str | None, info: dict[str, object]) -> Identity:
    build = info.get("build_info")
    build_text = build if isinstance(build, str) else None
    model = info.get("model_alias") or info.get("model_path")
    slots = info.get("total_slots")
    return Identity(
        server_header=server,
        build_info=build_text,
        build_number=build_number(build_text),
        model=model if isinstance(model, str) else None,
        total_slots=slots if isinstance(slots, int) and not isinstance(slots, bool) else None,
    )


def keepalive_check(
    target: Target,
    *,
    stream: bool,
    timeout: float,
    max_tokens: int,
    api_key: str | None,
    waits: Waits = SILENT,
) -> KeepAliveCheck:
    """A completion on a fresh connection asking for keep-alive; then: does the server close, or serve a second
    request on it?"""
    what = f"{'streamed ' if stream else ''}POST {target.path(CHAT)}"
    try:
        conn = _open(target, timeout, waits)
    except OSError as exc:
        return KeepAliveCheck(stream, error=describe_error(exc, target, what, timeout))
    with conn:
        try:
            body = chat_body(stream=stream, max_tokens=max_tokens)
            with waits.waiting(f"the complete answer to {what}", timeout):
                response = conn.request("POST", target.path(CHAT), timeout=timeout, body=body, headers=_auth(api_key))
        except (OSError, WireError) as exc:
            return KeepAliveCheck(stream, error=describe_error(exc, target, what, timeout))
        check = KeepAliveCheck(
            stream,
            status=response.status,
            server_message=None if response.status == 200 else _server_message(response),
            connection_header=response.header("Connection"),
            keep_alive_header=response.header("Keep-Alive"),
            chunked="chunked" in (response.header("Transfer-Encoding") or "").lower(),
            first_byte=response.first_byte,
            complete=response.complete,
        )
        if not check.answered or check.announced_close:
            return check
        after, when = conn.wait_closed(min(STREAM_CLOSE_WAIT if stream else NONSTREAM_OPEN_WAIT, timeout))
        if after != "open":
            closed_after = when - response.ended_at if after in ("eof", "reset") else None
            return replace(check, after=after, closed_after=closed_after)
        second = f"GET {target.path('/health')} on the same connection"
        try:
            # "Connection: close" on the second: the server must still read and answer it; then it lets go.
            with waits.waiting(f"an answer to {second}", timeout):
                answer = conn.request(
                    "GET", target.path("/health"), timeout=timeout, headers=(("Connection", "close"),)
                )
        except ClosedUnanswered:
            return replace(check, after="open", reuse=REUSE_CLOSED)
        except (ConnectionResetError, BrokenPipeError):
            return replace(check, after="open", reuse=REUSE_RESET)
        except (OSError, WireError) as exc:
            return replace(check, after="open", reuse=describe_error(exc, target, second, timeout))
        return replace(check, after="open", reuse=f"answered {answer.status}")


def burst_window(timeout: float) -> float:
    """How long a connection of the burst may take to answer before it counts as stalled."""
    return min(BURST_WINDOW, timeout)


def burst_check(target: Target, connections: int, timeout: float, waits: Waits = SILENT) -> BurstCheck:
    """Open ``connections`` connections at once, send ``GET /health`` on each, and time every first byte; up to
    ``BURST_ROUNDS`` bursts, stopping at the first in which a connection stalls."""
    request = f"GET {target.path('/health')} HTTP/1.1\r\nHost: {target.host_header}\r\n\r\n".encode()
    window = burst_window(timeout)
    rounds: list[BurstRound] = []
    for number in range(BURST_ROUNDS):
        if number:
            waits.say(
                f"burst {number} of up to {BURST_ROUNDS}: every connection answered; next burst in {BURST_PAUSE:g} s "
                "(the server's extra threads must exit first) ..."
            )
            time.sleep(BURST_PAUSE)
        try:
            with waits.waiting(f"{target.host_header} to accept {connections} connections", timeout):
                socks = open_burst(target.host, target.port, connections, timeout=timeout)
        except (OSError, TimeoutError) as exc:
            return BurstCheck(connections, tuple(rounds), error=f"could not open {connections} connections: {exc}")
        try:
            for sock in socks:
                sock.sendall(request)
            sent_at = time.monotonic()
            what = f"the first byte of an answer to GET {target.path('/health')} on each of {connections} connections"
            with waits.waiting(what, window, "the burst's window"):
                first_bytes = read_first_bytes(socks, sent_at, sent_at + window)
        except OSError as exc:
            return BurstCheck(connections, tuple(rounds), error=f"the burst's connections failed: {exc}")
        finally:
            for sock in socks:
                sock.close()
        rounds.append(BurstRound(tuple(first_bytes), window))
        if rounds[-1].stalled:
            break
    return BurstCheck(connections, tuple(rounds))


def load_check(
    target: Target,
    *,
    guarded: bool,
    requests: int,
    timeout: float,
    max_tokens: int,
    api_key: str | None,
    progress: TextIO | None = None,
    stuck_after: float | None = None,
) -> LoadRow:
    """The proxy-like load: ``LOAD_WORKERS`` threads share one client with ``LOAD_CONNECTIONS`` connections,
    every second request streamed; with plain httpx or with the guard. A request with no answer within
    ``stuck_after`` seconds counts as stuck."""
    row = LoadRow("pooled load", "guard" if guarded else "plain httpx")
    # Idle connections expire before llama-server's 5 s keep-alive timeout, so that plain httpx's losses are the
    # stream defect's, not the ordinary race with an idle timeout.
    limits = httpx.Limits(
        max_connections=LOAD_CONNECTIONS, max_keepalive_connections=LOAD_CONNECTIONS, keepalive_expiry=4.0
    )
    inner = httpx.HTTPTransport(limits=limits)
    transport: httpx.BaseTransport = GuardTransport(inner, policy=GuardPolicy(origins="all")) if guarded else inner
    headers = dict(_auth(api_key))
    with httpx.Client(transport=transport, base_url=target.url, timeout=timeout, headers=headers) as client:
        proxy_load(
            client,
            row,
            requests=requests,
            workers=LOAD_WORKERS,
            path=CHAT,
            body_for=lambda index: chat_body(stream=index % 2 == 1, max_tokens=max_tokens),
            deadline=time.monotonic() + LOAD_BUDGET,
            progress=progress,
            stuck_after=stuck_after,
        )
    return row
