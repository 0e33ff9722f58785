"""Security: what the guard writes to logs and errors, where the emulator listens, and which sockets it opens.

(a) Logs. Requests carry secrets everywhere a caller puts them: the JSON body, ``Authorization: Bearer``, a
    ``Cookie``, an ``X-Api-Key`` header, an ``api_key`` in the URL's query, and a password in the URL's user info
    (which httpx turns into a Basic ``Authorization``). Faults make every log statement of llama_guard fire: a retry
    after a written request went unanswered, after a probe was reset, answered with garbage or not at all, after a
    503, a 429 and an expired first-byte deadline; giving up after the attempts ran out; "probing disabled" for a
    server that closes after ``/health``. Records are captured at DEBUG from every logger. What is checked: no record
    from the ``llama_guard`` loggers carries any secret, in its message, its arguments, its exception text or any
    extra attribute; nor does the message or history of any `GuardError` raised or any `GuardResult` returned.
    httpx's own INFO line does log the full URL with its query: that is httpx's doing, not the guard's, and serves
    here as the proof that the capture would see a leak. Sync, asyncio and trio; httpx and httpx2; a requests
    session and an aiohttp session (each stack words its errors its own way).
(b) The emulator listens on 127.0.0.1 only by default, as a class and as ``python -m llama_guard.testing``.
(c) Sockets. An audit hook (``sys.addaudithook``, inert outside these tests: it acts only in a context where a
    context variable is set) sees every socket created and connected by the client's code. Their number equals the
    TCP connects httpcore reports through its trace events and the connections the server accepted, and the probe
    count equals the connections made: the guard opens no socket of its own, and the probe runs on the connection
    httpcore opened.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import logging
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

import llama_guard
from llama_guard.testing import Fault, LlamaServerEmulator

try:  # the httpx2 flavour too, where it is installed (it is in the dev extra)
    import httpx2

    import llama_guard.httpx2 as guard2
except ImportError:  # pragma: no cover - depends on the environment
    httpx2 = guard2 = None

CHAT = "/v1/chat/completions"
SECRETS = {
    "body": "BODYSECRET-5f2a",
    "bearer": "AUTHSECRET-81c4",
    "cookie": "COOKIESECRET-d09e",
    "header key": "HEADERKEYSECRET-77b1",
    "query key": "QUERYSECRET-3e6a",
    "password": "USERSECRET-a4f0",
}
# A password in the URL reaches the wire as Basic credentials: look for its base64 form too.
_BASIC = base64.b64encode(f"alice:{SECRETS['password']}".encode()).decode()
NEEDLES = [*SECRETS.values(), _BASIC]

FLAVORS = ["httpx-sync", "httpx-asyncio", "httpx-trio"] + (["httpx2-sync", "httpx2-asyncio"] if httpx2 else [])
#: The log scenario runs on the guard's other stacks too (the socket scenario counts httpcore's connections).
LOG_FLAVORS = [*FLAVORS, "requests", "aiohttp-asyncio"]
#: The log and socket scenarios: the emulator is on loopback, where the default closes every connection and probes
#: none; they need what only keep-alive has (the probe and its log lines, kicks, the late-answer watch's sockets).
REUSE = llama_guard.GuardPolicy(connection="reuse")


# -- clients of every flavour, behind one interface ---------------------------------------------------------------


class Client:
    """A guarded client of one flavour; `send` awaits for async clients and blocks for sync ones."""

    def __init__(self, flavor: str, base_url: str, policy: llama_guard.GuardPolicy | None = None) -> None:
        package, _, mode = flavor.partition("-")
        self.sync = mode == "sync"
        self.other: OtherStack | None = None
        if package in ("requests", "aiohttp"):
            self.other = OtherStack(package, policy)
            self.error_class = self.other.error_class
            return
        module: Any = httpx if package == "httpx" else httpx2
        guard: Any = llama_guard if package == "httpx" else guard2
        self.error_class: type[BaseException] = module.HTTPError
        transport_class = guard.GuardTransport if self.sync else guard.AsyncGuardTransport
        self.transport = transport_class(policy=policy)
        client_class = module.Client if self.sync else module.AsyncClient
        self.client = client_class(transport=self.transport, base_url=base_url, timeout=10.0)

    async def send(self, method: str, url: str, **kwargs: Any) -> Any:
        if self.other is not None:
            return await self.other.send(method, url, **kwargs)
        if self.sync:
            with self.client.stream(method, url, **kwargs) as response:
                response.read()
                return response
        async with self.client.stream(method, url, **kwargs) as response:
            await response.aread()
            return response

    async def close(self) -> None:
        if self.other is not None:
            await self.other.close()
        elif self.sync:
            self.client.close()
        else:
            await self.client.aclose()


class OtherStack:
    """A guarded requests session or aiohttp session behind `Client`'s interface: the guard's options through
    ``request_options``, its result as ``response.extensions["llama_guard"]``."""

    def __init__(self, package: str, policy: llama_guard.GuardPolicy | None) -> None:
        self.package = package
        self.policy = policy
        self.session: Any = None
        if package == "requests":
            import requests

            from llama_guard.requests import GuardAdapter

            self.error_class: type[BaseException] = requests.RequestException
            self.session = requests.Session()
            self.session.mount("http://", GuardAdapter(policy=policy))
        else:
            import aiohttp

            self.error_class = aiohttp.ClientError

    async def send(self, method: str, url: str, *, extensions: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        options = (extensions or {}).get("llama_guard") or {}
        if self.package == "requests":
            from llama_guard.requests import request_options, result_of

            with request_options(**options):
                response = self.session.request(method, url, stream=True, timeout=10.0, **kwargs)
                try:
                    response.content  # noqa: B018 (read whole)
                finally:
                    response.close()
            return _Answered(result_of(response))
        from llama_guard.aiohttp import guard_result, guarded_session
        from llama_guard.aiohttp import request_options as aiohttp_options

        if self.session is None:  # made in the event loop, as aiohttp wants
            self.session = guarded_session(policy=self.policy)
        with aiohttp_options(**options):
            async with self.session.request(method, url, **kwargs) as answer:
                await answer.read()
        return _Answered(guard_result(answer))

    async def close(self) -> None:
        if self.package == "requests":
            self.session.close()
        elif self.session is not None:
            await self.session.close()


@dataclass
class _Answered:
    result: Any

    @property
    def extensions(self) -> dict[str, Any]:
        return {"llama_guard": self.result}


def run(flavor: str, scenario: Callable[..., Any], *args: Any) -> Any:
    """Run an async scenario under the flavour's event loop (sync clients run under asyncio and block it)."""
    return anyio.run(scenario, *args, backend="trio" if flavor.endswith("trio") else "asyncio")


# == (a) Logs and errors ============================================================================================


def _secret_request(url: str, *, stream: bool = False, userinfo: bool = False, path: str = CHAT) -> dict[str, Any]:
    base = httpx.URL(url)
    target = base.copy_with(path=path, params={"api_key": SECRETS["query key"]})
    if userinfo:
        target = target.copy_with(username="alice", password=SECRETS["password"])
    headers = {"Cookie": f"session={SECRETS['cookie']}", "X-Api-Key": SECRETS["header key"]}
    if not userinfo:
        headers["Authorization"] = f"Bearer {SECRETS['bearer']}"
    body = {"messages": [{"role": "user", "content": f"my secret is {SECRETS['body']}"}], "stream": stream}
    return {"url": str(target), "headers": headers, "json": body}


@dataclass
class Seen:
    results: list[Any] = field(default_factory=list)  # GuardResult of each answered request
    errors: list[BaseException] = field(default_factory=list)


async def _log_scenario(flavor: str, server: LlamaServerEmulator, closing_server: LlamaServerEmulator) -> Seen:
    seen = Seen()

    async def send(faults: list[tuple[Fault, dict[str, Any]]], *, overrides: Any = None, **request: Any) -> None:
        """One request on a new client (so that a fault armed for the next connection hits this request)."""
        for fault, params in faults:
            server.inject(fault, **params)
        extensions = {} if overrides is None else {"llama_guard": overrides}
        client = Client(flavor, server.url, policy=REUSE)
        try:
            response = await client.send("POST", extensions=extensions, **request)
        except client.error_class as exc:
            seen.errors.append(exc)
        else:
            seen.results.append(response.extensions.get("llama_guard"))
        finally:
            await client.close()
        assert server.pending_faults() == [], "a fault did not fire"

    url = server.url
    # Retries: every reason the guard logs one.
    await send([(Fault.HEADERS_NEVER, {"path": CHAT, "hold": 0.0})], **_secret_request(url))
    await send([(Fault.HEADERS_NEVER, {"path": CHAT, "hold": 0.0})], **_secret_request(url, userinfo=True))
    await send([(Fault.RESET_BEFORE_READ, {})], **_secret_request(url, stream=True))
    await send([(Fault.GARBAGE, {"path": "/health", "data": b"HTTP/9 ??? " + b"x" * 300})], **_secret_request(url))
    await send([(Fault.NEVER_ANSWER_ACCEPT, {"hold": 2.0})], overrides={"probe_timeout": 0.2}, **_secret_request(url))
    await send([(Fault.STATUS_503, {"path": CHAT})], **_secret_request(url))
    await send([(Fault.STATUS_429, {"path": CHAT, "retry_after": 0})], **_secret_request(url, stream=True))
    await send(
        [(Fault.HEADERS_NEVER, {"path": CHAT, "hold": 5.0})],
        overrides={"first_byte_timeout": 0.3},
        **_secret_request(url),
    )
    # Giving up, after attempts ran out (logged), and at once when the request may not be resent (not logged,
    # but the error's message and history say why).
    await send(
        [(Fault.HEADERS_NEVER, {"path": CHAT, "hold": 0.0, "count": 2})],
        overrides={"max_attempts": 2},
        **_secret_request(url, userinfo=True),
    )
    await send([(Fault.HEADERS_NEVER, {"path": "/v1/other", "hold": 0.0})], **_secret_request(url, path="/v1/other"))
    # A stream cut after its headers: the caller's plain httpx error, never retried.
    await send([(Fault.RESET_MID_STREAM, {"path": CHAT})], **_secret_request(url, stream=True))
    # A server that closes after answering /health: "probing disabled for this origin".
    other = Client(flavor, closing_server.url, policy=REUSE)
    try:
        response = await other.send("POST", **_secret_request(closing_server.url))
        seen.results.append(response.extensions.get("llama_guard"))
    finally:
        await other.close()
    return seen


def _texts_of(record: logging.LogRecord) -> list[str]:
    """Everything of a record that a handler or formatter could write out."""
    texts = [record.getMessage(), repr(record.args), str(record.msg)]
    if record.exc_info:
        texts.append(logging.Formatter().formatException(record.exc_info))
    texts += [str(record.exc_text), str(record.stack_info)]
    standard = set(vars(logging.makeLogRecord({})))
    texts += [repr(value) for name, value in vars(record).items() if name not in standard]
    return texts


def _leaks(texts: list[str]) -> list[str]:
    return [needle for needle in NEEDLES if any(needle in text for text in texts)]


# Seconds per flavour: the fast core runs an asyncio httpx2 client and a requests session (whose errors the guard
# words itself), the full suite every flavour.
@pytest.mark.parametrize(
    "flavor",
    [pytest.param(f, marks=() if f in ("httpx2-asyncio", "requests") else pytest.mark.slow) for f in LOG_FLAVORS],
)
def test_no_log_record_or_error_carries_a_body_credential_or_api_key(
    flavor: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.DEBUG)  # the root logger: every logger's records reach the capture
    for name in ("llama_guard", "httpx", "httpcore", "httpx2", "httpcore2"):
        caplog.set_level(logging.DEBUG, logger=name)
        # Filters other libraries installed on these loggers (litellm, imported by other tests, adds a redacting
        # one to httpx's) would hide the control's secret below; this test judges llama_guard's records alone.
        monkeypatch.setattr(logging.getLogger(name), "filters", [])
    with (
        LlamaServerEmulator(http_threads=8, pool_bug=False, n_tokens=2) as server,
        LlamaServerEmulator(keepalive_max=1, n_tokens=2) as closing_server,
    ):
        seen = run(flavor, _log_scenario, flavor, server, closing_server)
        assert server.stats().completions_started == 9  # every request but the two that were given up

    ours = [r for r in caplog.records if r.name == "llama_guard" or r.name.startswith("llama_guard.")]
    messages = [r.getMessage() for r in ours]
    # Every log statement of llama_guard fired.
    for words in ("retrying POST", "giving up on POST", "probing disabled for this origin"):
        assert any(words in message for message in messages), f"no record says {words!r}"
    # A written request the server dropped, as each stack names it.
    dropped = {"requests": "ProtocolError", "aiohttp": "ServerDisconnectedError"}.get(
        flavor.partition("-")[0], "RemoteProtocolError"
    )
    for reason in (dropped, "ProbeError", "ProbeTimeout", "HTTP 503", "HTTP 429", "FirstByteTimeout"):
        assert any(reason in message for message in messages if "retrying" in message), reason
    for record in ours:
        assert _leaks(_texts_of(record)) == [], record.getMessage()

    # Errors and results: what the guard tells the caller.
    guard_errors = [e for e in seen.errors if isinstance(e, llama_guard.GuardError)]
    assert len(guard_errors) == 2  # gave up after max_attempts; the non-inference POST not retried
    assert len(seen.errors) == 3  # and the stream cut after its headers: the caller's plain httpx error
    for error in guard_errors:
        assert _leaks([str(error), repr(error), *error.history]) == [], str(error)
    assert any(result is not None and result.history for result in seen.results)
    for result in seen.results:
        assert result is None or _leaks([repr(result), *result.history]) == [], result

    # The capture does see secrets where a logger writes them: httpx's own INFO line, urllib3's DEBUG line, have the
    # URL with its query. (aiohttp logs no URL: the other flavours prove the capture.)
    if not flavor.startswith("aiohttp"):
        others = [r for r in caplog.records if r not in ours]
        assert any(SECRETS["query key"] in r.getMessage() for r in others), "the capture saw no query string at all"


def test_urls_in_error_messages_lose_their_query_and_user_info() -> None:
    """The requests flavour keeps urllib3's reasons readable (a reset, a bad status line, the host), and takes out
    what may be a credential wherever a message spells a URL or a path out."""
    from llama_guard._core.log import without_url_secrets

    key, password = SECRETS["query key"], SECRETS["password"]
    assert without_url_secrets(f"Max retries exceeded with url: /v1/x?api_key={key} (Caused by X)") == (
        "Max retries exceeded with url: /v1/x?<redacted> (Caused by X)"
    )
    assert without_url_secrets(f"url='http://alice:{password}@h:8080/v1?k={key}'") == (
        "url='http://<redacted>@h:8080/v1?<redacted>'"
    )
    kept = "('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer')) at http://h:8080/v1"
    assert without_url_secrets(kept) == kept


def test_a_refused_header_value_does_not_end_up_in_the_guards_error() -> None:
    with (
        LlamaServerEmulator() as server,
        httpx.Client(transport=llama_guard.GuardTransport(), base_url=server.url) as client,
        pytest.raises(httpx.LocalProtocolError) as info,
    ):
        client.post(CHAT, json={"messages": []}, headers={"Authorization": f"Bearer {SECRETS['bearer']}\n"})
    assert isinstance(info.value, llama_guard.GuardError)
    assert _leaks([str(info.value), *info.value.history]) == []


# == (b) Where the emulator listens =================================================================================


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of listening TCP sockets on ``port``, from /proc/net/tcp and tcp6 (IPv4 and IPv6)."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as lines:
            next(lines)
            for line in lines:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.partition(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(_decode_proc_address(address))
    return found


def _decode_proc_address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def _outside_address() -> str | None:
    """An address of this machine that is not loopback (the one of its default route), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 9))  # UDP: nothing is sent
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def _refused_from_outside(port: int) -> None:
    outside = _outside_address()
    if outside is None:
        return  # no other interface to try: the listening table above is the proof
    with socket.socket() as sock:
        sock.settimeout(2.0)
        assert sock.connect_ex((outside, port)) != 0, f"the emulator answered on {outside}:{port}"


def test_the_emulator_listens_on_loopback_only_by_default() -> None:
    with LlamaServerEmulator() as server:
        assert server.host == "127.0.0.1"
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert _listening_addresses(server.port) == {"127.0.0.1"}
        _refused_from_outside(server.port)
        with httpx.Client() as client:
            assert client.get(f"{server.url}/health").status_code == 200  # while loopback answers


def test_the_emulator_command_listens_on_loopback_only_by_default() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "llama_guard.testing", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert process.stdout is not None
        line = _read_line(process, timeout=20.0)
        match = re.search(r"listening on http://(\S+):(\d+)", line)
        assert match is not None, line
        host, port = match.group(1), int(match.group(2))
        assert host == "127.0.0.1"
        assert _listening_addresses(port) == {"127.0.0.1"}
        _refused_from_outside(port)
    finally:
        process.terminate()
        try:
            process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()


def _read_line(process: subprocess.Popen[str], *, timeout: float) -> str:
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    assert lines, f"the emulator printed nothing within {timeout} s"
    return lines[0]


# == (c) Sockets ===================================================================================================

_AUDIT: contextvars.ContextVar[list[tuple[str, Any]] | None] = contextvars.ContextVar("socket_audit", default=None)
_hook_installed = False


def _audit_hook(event: str, args: tuple[Any, ...]) -> None:
    if event.startswith("socket."):
        log = _AUDIT.get()
        if log is not None:
            log.append((event, args[1:] if event == "socket.connect" else ()))


@contextlib.contextmanager
def socket_audit() -> Iterator[list[tuple[str, Any]]]:
    """Record the socket events raised in this context (and in tasks it starts): an audit hook cannot be removed,
    so it is installed once and does nothing where the context variable is unset."""
    global _hook_installed
    if not _hook_installed:
        sys.addaudithook(_audit_hook)
        _hook_installed = True
    log: list[tuple[str, Any]] = []
    token = _AUDIT.set(log)
    try:
        yield log
    finally:
        _AUDIT.reset(token)


async def _socket_scenario(flavor: str, server: LlamaServerEmulator) -> tuple[list[tuple[str, Any]], list[str], Any]:
    trace_events: list[str] = []
    if flavor.endswith("sync"):

        def trace(event: str, info: dict[str, Any]) -> None:
            trace_events.append(event)

    else:

        async def trace(event: str, info: dict[str, Any]) -> None:  # type: ignore[misc]
            trace_events.append(event)

    body = {"messages": [{"role": "user", "content": "hi"}]}
    with socket_audit() as log:
        client = Client(
            flavor,
            server.url,
            policy=llama_guard.GuardPolicy(connection="reuse", probe_timeout=0.3, probe_learning=False, backoff=0.01),
        )
        try:
            # (fault, its parameters, streamed?): a stream closes its connection, so the next request connects
            steps: list[tuple[Fault | None, dict[str, Any], bool]] = [
                (None, {}, False),  # a new connection, probed
                (None, {}, False),  # the pooled one again
                (None, {}, True),  # the pooled one, closed after the stream
                (Fault.RESET_BEFORE_READ, {}, False),  # a new one, reset; then another
                (None, {}, True),
                (Fault.GARBAGE, {"path": "/health"}, False),  # a new one, its probe answered with garbage
                (None, {}, True),
                (Fault.NEVER_ANSWER_ACCEPT, {"hold": 1.0}, False),  # a new one, never read: its probe times out
                (Fault.HEADERS_NEVER, {"path": CHAT, "hold": 0.0}, True),  # the pooled one, closed unanswered
                (Fault.STATUS_503, {"path": CHAT}, False),  # a new one; the 503 closes it; then another
            ]
            for fault, params, stream in steps:
                if fault is not None:
                    server.inject(fault, **params)
                response = await client.send("POST", CHAT, json={**body, "stream": stream}, extensions={"trace": trace})
                assert response.status_code == 200
                assert server.pending_faults() == [], f"{fault} did not fire"
        finally:
            await client.close()
    return log, trace_events, client.transport.stats.snapshot()


@pytest.mark.parametrize("flavor", FLAVORS)
def test_the_guard_opens_no_socket_besides_httpcores_connections(flavor: str) -> None:
    with LlamaServerEmulator(http_threads=8, pool_bug=False, n_tokens=2) as server:
        log, trace_events, stats = run(flavor, _socket_scenario, flavor, server)
        connects_started = trace_events.count("connection.connect_tcp.started")
        connects_made = trace_events.count("connection.connect_tcp.complete")
        connects_failed = trace_events.count("connection.connect_tcp.failed")
        kicks = stats.probe_kicks
        accepted = server.wait_for(lambda s: s.connections_accepted >= connects_started + kicks).connections_accepted

    events = [event for event, _ in log]
    assert set(events) <= {"socket.__new__", "socket.connect", "socket.getaddrinfo"}, set(events)
    connects = [address for event, address in log if event == "socket.connect"]
    assert all(address[0][1] == server.port for address in connects), connects
    # Every socket created in the client's code was one of httpcore's connections or a kick (a connection to the
    # same server, closed at once: GuardPolicy.probe_kick), and the server saw each one; besides them, one socket
    # object per probe given up: the duplicate of that connection's descriptor that watches it for a late answer
    # (_core/late_answers.py), no new connection.
    assert stats.probes_given_up == 1  # F
    assert kicks >= 2  # F's probe kicked at a quarter and half of its deadline (learning is off); a slow one may too
    assert len(connects) == events.count("socket.__new__") - stats.probes_given_up == connects_started + kicks
    assert connects_started + kicks == accepted
    # A; B (reset) and C; D (garbage) and E; F (never read) and G; H (the retried stream); I (503) and J.
    assert connects_started == 10
    # The probe ran once on each connection that httpcore made (one whose probe failed is reported to the trace as
    # a failed connect), and opened nothing of its own. The reset may also fail the connect itself, before a probe.
    assert connects_started == connects_made + connects_failed == 10
    assert connects_failed == 3  # reset, garbage, never answered
    assert stats.probes_sent == connects_made + stats.probes_failed
    assert stats.probes_failed >= 2  # garbage, never answered (and the reset, when it lets the connect complete)
