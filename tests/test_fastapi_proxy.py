"""examples/fastapi_proxy.py for real: uvicorn in a subprocess on 127.0.0.1, the emulator upstream in this process.

The emulator has both llama-server defects on (streams close their kept-alive connection 60 ms after the final
chunk; the thread pool leaves a burst of new connections unread), so a proxy without the guard loses requests, and
the control test shows that it does: on the emulator's deterministic stream close (``stream_close="on_reuse"``), it
loses exactly the requests the emulator dropped. Every figure a test asserts comes from one of three places that
do not trust each other: what the clients received, the proxy's ``/guard/stats``, and the emulator's server-side
counters.

The proxy runs as it would in production (``uvicorn examples.fastapi_proxy:app``, configured by environment), on a
port uvicorn picks (``--port 0``, read from its log), and is stopped (SIGTERM, then SIGKILL) when the test ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest

from llama_guard.testing import Fault, LlamaServerEmulator, free_port, generated_text

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fastapi_proxy.py"
CHAT = "/v1/chat/completions"
MODELS = "/v1/models"

STARTUP_TIMEOUT = 60.0  # importing FastAPI on a loaded 2-core machine takes a while
STOP_TIMEOUT = 10.0


# -- the proxy process ------------------------------------------------------------------------------------------


class ProxyProcess:
    """``uvicorn examples.fastapi_proxy:app`` in a subprocess, configured by ``env``; its log goes to a file."""

    def __init__(self, log_path: Path, env: dict[str, str], *, log_level: str = "info") -> None:
        self.log_path = log_path
        # Only the variables this test sets: the developer's own LLAMA_* settings must not leak in.
        base = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}
        self.env = {**base, **env}
        self.log_level = log_level
        self.url = ""
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ProxyProcess:
        command = [
            sys.executable,
            "-m",
            "uvicorn",
            "examples.fastapi_proxy:app",
            "--app-dir",
            str(ROOT),
            "--host",
            "127.0.0.1",
            "--port",
            "0",  # uvicorn binds a free port and logs it: no race for a port picked in advance
            "--no-access-log",
            "--log-level",
            self.log_level,
            "--timeout-graceful-shutdown",
            "3",
        ]
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if self._proc.poll() is not None:
                raise AssertionError(f"uvicorn exited with {self._proc.returncode}:\n{self.log_text()}")
            found = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", self.log_text())
            if found:
                self.url = f"http://127.0.0.1:{found.group(1)}"
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                        return
            if time.monotonic() >= deadline:
                raise AssertionError(f"uvicorn not ready after {STARTUP_TIMEOUT:.0f} s:\n{self.log_text()}")
            time.sleep(0.05)

    def stop(self) -> int | None:
        """SIGTERM (uvicorn shuts down gracefully, closing the upstream client), SIGKILL if it hangs; reaped."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT)
        return proc.returncode

    def log_text(self) -> str:
        try:
            return self.log_path.read_text("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def stats(self) -> dict[str, Any]:
        """The proxy's ``/guard/stats``: ``guarded``, ``guard`` (the transport's counters) and ``proxy``."""
        response = httpx.get(self.url + "/guard/stats", timeout=10.0)
        assert response.status_code == 200, response.text
        document: dict[str, Any] = response.json()
        return document

    def wait_stats(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0) -> dict[str, Any]:
        """Poll ``/guard/stats`` until ``predicate`` holds; fail with the last answer after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if predicate(stats):
                return stats
            if time.monotonic() >= deadline:
                raise AssertionError(f"proxy stats never matched within {timeout:g} s: {stats}")
            time.sleep(0.05)

    def assert_no_traceback(self) -> None:
        text = self.log_text()
        assert "Traceback" not in text, text[-4000:]
        assert "Exception in ASGI application" not in text, text[-4000:]


StartProxy = Callable[..., ProxyProcess]


@pytest.fixture
def start_proxy(tmp_path: Path) -> Iterator[StartProxy]:
    """Factory: ``start_proxy(upstream_url, **env)`` starts a proxy; every proxy is stopped at the end, and its log
    printed (pytest shows it when the test failed)."""
    proxies: list[ProxyProcess] = []

    def start(upstream: str, *, log_level: str = "info", **env: str) -> ProxyProcess:
        proxy = ProxyProcess(
            tmp_path / f"proxy-{len(proxies)}.log", {"LLAMA_UPSTREAM": upstream, **env}, log_level=log_level
        )
        proxies.append(proxy)
        return proxy.start()

    try:
        yield start
    finally:
        for proxy in proxies:
            code = proxy.stop()
            print(f"--- proxy log (exit code {code}) ---\n{proxy.log_text()[-6000:]}")


def faulty_emulator(**kwargs: Any) -> LlamaServerEmulator:
    """Both defects on (the defaults), and the stream close delayed 60 ms so that pooled clients reuse the dying
    connection every time rather than only under load."""
    kwargs.setdefault("stream_close_delay", 0.06)
    kwargs.setdefault("parallel", 8)
    return LlamaServerEmulator(**kwargs)


# -- checking what the clients got ------------------------------------------------------------------------------


def chat(*, stream: bool, max_tokens: int, tag: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": tag}], "max_tokens": max_tokens, "stream": stream, **extra}


def sse_events(body: bytes) -> list[str]:
    return [line[6:] for line in body.decode("utf-8", "replace").splitlines() if line.startswith("data: ")]


def stream_problem(body: bytes, max_tokens: int) -> str | None:
    """Why ``body`` is not the emulator's complete stream of ``max_tokens`` tokens, or None when it is."""
    events = sse_events(body)
    if not events or events[-1] != "[DONE]":
        return f"does not end with data: [DONE]: {events[-2:]}"
    try:
        chunks = [json.loads(event) for event in events[:-1]]
        text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
        if text != generated_text(max_tokens):
            return f"text {text!r} instead of {generated_text(max_tokens)!r}"
        if len({chunk["id"] for chunk in chunks}) != 1:
            return "chunks of more than one completion"
        if chunks[-1]["choices"][0]["finish_reason"] != "length":
            return f"finish_reason {chunks[-1]['choices'][0]['finish_reason']!r}"
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc} in {body[:200]!r}"
    return None


def completion_problem(body: bytes, max_tokens: int) -> str | None:
    try:
        document = json.loads(body)
        text = document["choices"][0]["message"]["content"]
        if text != generated_text(max_tokens) or document["usage"]["completion_tokens"] != max_tokens:
            return f"text {text!r}, usage {document['usage']}"
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc} in {body[:200]!r}"
    return None


def models_problem(body: bytes) -> str | None:
    try:
        if json.loads(body)["data"][0]["id"] == "":
            return "empty model id"
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc} in {body[:200]!r}"
    return None


def openai_error(body: bytes) -> dict[str, Any]:
    """The ``error`` object of an OpenAI-style error body (fails the test if it is not one)."""
    document = json.loads(body)
    error: dict[str, Any] = document["error"]
    assert isinstance(error["message"], str), document
    assert error["message"], document
    assert isinstance(error["type"], str), document
    assert error["type"], document
    return error


# -- the load: many concurrent clients, each with its own connection to the proxy --------------------------------


@dataclass
class Sent:
    kind: str  # "stream", "full" or "models"
    max_tokens: int
    status: int | None = None
    body: bytes = b""
    error: str | None = None

    def problem(self) -> str | None:
        if self.error is not None:
            return self.error
        if self.status != 200:
            return f"HTTP {self.status}: {self.body[:200]!r}"
        if self.kind == "stream":
            return stream_problem(self.body, self.max_tokens)
        if self.kind == "full":
            return completion_problem(self.body, self.max_tokens)
        return models_problem(self.body)


@dataclass
class LoadRun:
    sent: list[Sent] = field(default_factory=list)
    peak_in_flight: int = 0
    seconds: float = 0.0

    def count(self, kind: str) -> int:
        return sum(1 for s in self.sent if s.kind == kind)

    def problems(self, check: Callable[[Sent], str | None] = Sent.problem) -> Counter[str]:
        """What was wrong with the responses, by kind (empty when every response was complete and right)."""
        return Counter(p[:90] for s in self.sent if (p := check(s)) is not None)


def plan(index: int) -> tuple[str, int]:
    """Request ``index`` of a load: 10% /v1/models, 20% non-streamed, 70% streamed; 1 to 12 tokens."""
    slot = index % 10
    kind = "models" if slot == 0 else "full" if slot in (1, 2) else "stream"
    return kind, 1 + index % 12


async def run_load(
    proxy_url: str,
    *,
    clients: int,
    requests: int,
    plan: Callable[[int], tuple[str, int]] = plan,
    body: Callable[..., dict[str, Any]] = chat,
    deadline: float = 100.0,
) -> LoadRun:
    """``requests`` requests from ``clients`` concurrent clients (an httpx.AsyncClient each, one connection each)
    through the proxy; every response read to its end. No request starts after ``deadline`` seconds."""
    run = LoadRun()
    numbers = iter(range(requests))
    in_flight = 0
    started = time.monotonic()
    stop_at = started + deadline

    async def one_client() -> None:
        nonlocal in_flight
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=proxy_url, limits=limits, timeout=60.0) as client:
            for index in numbers:
                if time.monotonic() > stop_at:
                    return
                kind, max_tokens = plan(index)
                sent = Sent(kind, max_tokens)
                run.sent.append(sent)
                in_flight += 1
                run.peak_in_flight = max(run.peak_in_flight, in_flight)
                try:
                    if kind == "models":
                        response = await client.get(MODELS)
                    else:
                        payload = body(stream=kind == "stream", max_tokens=max_tokens, tag=f"request {index}")
                        response = await client.post(CHAT, json=payload)
                    sent.status, sent.body = response.status_code, response.content
                except httpx.HTTPError as exc:
                    sent.error = f"{type(exc).__name__}: {exc}"
                finally:
                    in_flight -= 1

    await asyncio.gather(*(one_client() for _ in range(clients)))
    run.seconds = time.monotonic() - started
    return run


# -- the load ---------------------------------------------------------------------------------------------------

LOAD_CLIENTS = 64
LOAD_REQUESTS = 1_024
PROXY_POOL = "16"  # upstream connections: 64 clients share 16, as a proxy's clients do


@pytest.mark.slow
def test_64_streaming_clients_1024_requests_through_the_guarded_proxy(start_proxy: StartProxy) -> None:
    with faulty_emulator() as server:
        proxy = start_proxy(server.url, LLAMA_PROXY_MAX_CONNECTIONS=PROXY_POOL)
        run = asyncio.run(run_load(proxy.url, clients=LOAD_CLIENTS, requests=LOAD_REQUESTS))
        stats = proxy.stats()
        upstream = server.stats()
    streamed, full, models = run.count("stream"), run.count("full"), run.count("models")
    print(
        f"{len(run.sent)} requests ({streamed} streamed, {full} not, {models} /v1/models) from {LOAD_CLIENTS} clients "
        f"in {run.seconds:.1f} s; peak in flight {run.peak_in_flight}; proxy {stats['proxy']}; "
        f"guard retries={stats['guard']['retries']} errors={stats['guard']['errors']} "
        f"probes={stats['guard']['probes_sent']}"
    )
    assert len(run.sent) == LOAD_REQUESTS
    assert run.peak_in_flight == LOAD_CLIENTS, "the clients never were all in flight at once"
    # Every response complete and right, as the clients saw it.
    assert run.problems() == Counter()
    # No upstream error reached the proxy (the guard recovered whatever failed), and it relayed every stream whole.
    assert stats["guarded"] is True
    assert stats["proxy"]["upstream_errors"] == 0, stats["proxy"]
    assert stats["proxy"]["requests"] == LOAD_REQUESTS
    assert stats["proxy"]["streams_started"] == stats["proxy"]["streams_completed"] == streamed
    assert stats["proxy"]["client_disconnects"] == 0
    # Everything went through the guard, and it had something to do: the stream connections it dropped.
    assert stats["guard"]["requests"] == LOAD_REQUESTS
    assert stats["guard"]["stream_connections_closed"] == streamed
    # The server ran each completion exactly once: none lost, none sent twice.
    assert upstream.completions_started == upstream.completions_finished == streamed + full
    assert upstream.completions_cancelled == 0
    assert upstream.requests_to(MODELS) == models
    assert upstream.errors == ()
    proxy.assert_no_traceback()


CONTROL_REQUESTS = 256


@pytest.mark.slow  # 256 requests through a uvicorn subprocess
def test_without_the_guard_the_same_proxy_loses_requests(start_proxy: StartProxy) -> None:
    """The control: the same proxy with ``LLAMA_GUARD_DISABLE=1`` under the same load (smaller) loses requests to
    the connections llama-server closes after a stream. Its clients get 502s, never a traceback."""
    # Deterministic: every request the proxy writes to a connection a stream left is dropped, whatever the load.
    with faulty_emulator(stream_close_delay=0.0, stream_close="on_reuse") as server:
        proxy = start_proxy(server.url, LLAMA_PROXY_MAX_CONNECTIONS=PROXY_POOL, LLAMA_GUARD_DISABLE="1")
        run = asyncio.run(run_load(proxy.url, clients=LOAD_CLIENTS, requests=CONTROL_REQUESTS))
        stats = proxy.stats()
        upstream = server.stats()
    failed = [s for s in run.sent if s.status == 502]
    dropped = upstream.requests_dropped_after_stream
    print(
        f"plain httpx upstream: {len(failed)} of {len(run.sent)} requests got 502, {dropped} dropped by the server "
        f"after streams; proxy {stats['proxy']}"
    )
    assert stats["guarded"] is False
    assert stats["guard"] is None
    assert len(run.sent) == CONTROL_REQUESTS
    assert dropped > 0, "the proxy's pool reuses the connections streams leave"
    # Exactly the requests the server dropped failed: the proxy counted each, and its client got a 502 for each.
    assert stats["proxy"]["upstream_errors"] == len(failed) == dropped
    assert set(stats["proxy"]["upstream_error_kinds"]) == {"RemoteProtocolError"}
    for sent in failed:
        assert openai_error(sent.body)["type"] == "upstream_error"
    # Every other request ran on the server, once: the dropped ones never did.
    assert upstream.completions_started + upstream.requests_to(MODELS) == CONTROL_REQUESTS - dropped
    assert upstream.streams_closed_after_done > 0
    # Whatever did not fail is complete.
    assert all(s.problem() is None for s in run.sent if s.status != 502)
    proxy.assert_no_traceback()


@pytest.mark.slow  # the script's whole demo in a subprocess
def test_the_script_runs_its_own_demo() -> None:
    """``python examples/fastapi_proxy.py --demo``: the emulator, the proxy and 64 clients in one process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--demo", "--requests", "128"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "128 streamed completions" in done.stdout, done.stdout
    assert "128 complete, 0 failed" in done.stdout, done.stdout


# -- client disconnects cancel the upstream request -------------------------------------------------------------

SLOW_TOKEN = 0.05  # seconds per token: 400 tokens take 20 s, far beyond every deadline below
SLOW_TOKENS = 400


def test_a_client_that_leaves_a_stream_cancels_the_upstream_completion(start_proxy: StartProxy) -> None:
    with faulty_emulator(token_interval=SLOW_TOKEN) as server:
        proxy = start_proxy(server.url)
        with httpx.Client(base_url=proxy.url, timeout=10.0) as client:
            body = chat(stream=True, max_tokens=SLOW_TOKENS)
            with client.stream("POST", CHAT, json=body) as response:
                assert response.status_code == 200
                chunks = response.iter_raw()  # kept: a discarded iterator would close the response at once
                first = next(chunks)
                assert first.startswith(b"data: ")
                assert server.stats().completions_started == 1
                left = time.monotonic()
            # Leaving the block closes the unfinished response, and with it the client's connection to the proxy.
        stats = server.wait_for(lambda s: s.completions_cancelled == 1, timeout=5.0)
        cancelled_after = time.monotonic() - left
        assert stats.completions_finished == 0
        server.wait_for(lambda s: s.connections_active == 0, timeout=5.0)  # the upstream connection is gone
        proxy_stats = proxy.wait_stats(lambda s: s["proxy"]["client_disconnects"] == 1)
    print(f"upstream completion cancelled {cancelled_after * 1000:.0f} ms after the client left")
    assert cancelled_after < 5.0
    assert proxy_stats["proxy"]["streams_completed"] == 0
    assert proxy_stats["proxy"]["upstream_errors"] == 0
    proxy.assert_no_traceback()


def send_request(
    proxy: ProxyProcess, body: bytes, *, rcvbuf: int | None = None
) -> tuple[socket.socket, h11.Connection]:
    """POST ``body`` to the proxy's chat endpoint on a raw socket of our own, so the test decides when the client
    reads and when it leaves. Returns the socket (the caller closes it) and the h11 state to read the answer."""
    sock = socket.socket()
    try:
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(30.0)
        sock.connect(("127.0.0.1", int(proxy.url.rsplit(":", 1)[1])))
        conn = h11.Connection(h11.CLIENT)
        headers = [("Host", "proxy"), ("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        request = conn.send(h11.Request(method="POST", target=CHAT, headers=headers))
        sock.sendall(request + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
    except BaseException:
        sock.close()
        raise
    return sock, conn


def test_a_client_that_leaves_a_non_streamed_request_cancels_the_upstream_completion(start_proxy: StartProxy) -> None:
    """llama-server sends a non-streamed answer when generation is over: the proxy must watch the client while it
    waits, or an abandoned request keeps its slot until the end."""
    with faulty_emulator(token_interval=SLOW_TOKEN) as server:
        proxy = start_proxy(server.url)
        sock, _ = send_request(proxy, json.dumps(chat(stream=False, max_tokens=SLOW_TOKENS)).encode())
        with sock:
            server.wait_for(lambda s: s.completions_started == 1, timeout=10.0)
        left = time.monotonic()
        stats = server.wait_for(lambda s: s.completions_cancelled == 1, timeout=5.0)
        cancelled_after = time.monotonic() - left
        assert stats.completions_finished == 0
        proxy.wait_stats(lambda s: s["proxy"]["client_disconnects"] == 1)
    print(f"upstream completion cancelled {cancelled_after * 1000:.0f} ms after the client left")
    proxy.assert_no_traceback()


def test_a_client_that_leaves_while_queued_for_a_slot_never_runs(start_proxy: StartProxy) -> None:
    """One slot, busy: the second stream waits (no headers yet). Its client leaves; the proxy drops the upstream
    request, and the server never runs it."""
    with faulty_emulator(token_interval=SLOW_TOKEN, parallel=1) as server:
        proxy = start_proxy(server.url)
        busy = httpx.Client(base_url=proxy.url, timeout=10.0)
        with busy, busy.stream("POST", CHAT, json=chat(stream=True, max_tokens=SLOW_TOKENS)) as running:
            chunks = running.iter_raw()  # kept: a discarded iterator would close the response at once
            next(chunks)
            sock, _ = send_request(proxy, json.dumps(chat(stream=True, max_tokens=4)).encode())
            with sock:
                server.wait_for(lambda s: s.slots_waiting == 1, timeout=10.0)
            stats = server.wait_for(lambda s: s.slots_waiting == 0, timeout=5.0)
            assert stats.completions_started == 1  # only the running one
            proxy.wait_stats(lambda s: s["proxy"]["client_disconnects"] == 1)
        server.wait_for(lambda s: s.completions_cancelled == 1, timeout=5.0)
        assert server.stats().completions_started == 1
    proxy.assert_no_traceback()


# -- backpressure -----------------------------------------------------------------------------------------------


def slot_progress(server: LlamaServerEmulator) -> int:
    """Tokens generated so far by the emulator's busy slot (its ``GET /slots``, on a connection of its own)."""
    response = httpx.get(server.url + "/slots", headers={"Connection": "close"}, timeout=5.0)
    return max(int(slot["next_token"]["n_decoded"]) for slot in response.json())


@pytest.mark.slow  # fills socket buffers against a slow reader
@pytest.mark.parametrize("then", ["reads-on", "leaves"])
def test_a_slow_client_slows_the_upstream_instead_of_filling_the_proxy(start_proxy: StartProxy, then: str) -> None:
    """A client that stops reading: the proxy stops reading upstream, and llama-server stops generating once the
    socket buffers on the way are full, far from the end. A proxy that read ahead into memory (``aread()``, an
    unbounded queue) would let the generation run to its end.

    Then the client either reads on (the stream completes, whole) or leaves while the proxy is blocked writing to
    it (the upstream completion is cancelled)."""
    tokens = 4096
    # The emulator repeats the request's model name in every event: 8 kB each, 33 MB in all, well above what the
    # kernel's socket buffers on the way hold (7 to 11 MB were measured here).
    body = json.dumps(chat(stream=True, max_tokens=tokens, model="m" * 8000)).encode()
    with faulty_emulator() as server:
        proxy = start_proxy(server.url)
        sock, conn = send_request(proxy, body, rcvbuf=4096)  # a slow client's small window
        with sock:
            received = bytearray()
            response: h11.Response | None = None
            while response is None:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(sock.recv(4096))
                elif isinstance(event, h11.Response):
                    response = event
                elif isinstance(event, h11.Data):
                    received += event.data
            assert response.status_code == 200
            # Now read nothing, and wait until the generation stands still (three equal reads 0.5 s apart).
            deadline = time.monotonic() + 30.0
            readings = [slot_progress(server)]
            while len(readings) < 3 or len(set(readings[-3:])) > 1:
                assert time.monotonic() < deadline, f"generation never stalled: {readings}"
                time.sleep(0.5)
                readings.append(slot_progress(server))
            stalled_at = readings[-1]
            print(f"generation stalled at {stalled_at} of {tokens} tokens while the client did not read")
            assert server.stats().completions_finished == 0
            assert 0 < stalled_at < tokens, readings
            while then == "reads-on":
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = sock.recv(1 << 20)
                    assert data, "the proxy closed the connection before the end of the stream"
                    conn.receive_data(data)
                elif isinstance(event, h11.Data):
                    received += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
        if then == "leaves":
            stats = server.wait_for(lambda s: s.completions_cancelled == 1, timeout=5.0)
            assert stats.completions_finished == 0
            proxy.wait_stats(lambda s: s["proxy"]["client_disconnects"] == 1)
        else:
            server.wait_for(lambda s: s.completions_finished == 1, timeout=10.0)
            events = sse_events(bytes(received))
            assert events[-1] == "[DONE]"
            assert sum(1 for e in events if '"content":"' in e) == tokens
            assert proxy.stats()["proxy"]["streams_completed"] == 1
    proxy.assert_no_traceback()


# -- upstream failures ------------------------------------------------------------------------------------------


def test_a_stream_that_breaks_upstream_ends_with_an_error_event(start_proxy: StartProxy) -> None:
    with faulty_emulator() as server:
        proxy = start_proxy(server.url)
        rule = server.inject(Fault.RESET_MID_STREAM, path=CHAT, after_chunks=3)
        with httpx.Client(base_url=proxy.url, timeout=10.0) as client:
            response = client.post(CHAT, json=chat(stream=True, max_tokens=8))
            # The next request is fine.
            after = client.post(CHAT, json=chat(stream=True, max_tokens=8))
        stats = proxy.stats()
    assert rule.triggered == 1
    assert response.status_code == 200  # the headers were relayed before the upstream broke
    events = sse_events(response.content)
    assert "[DONE]" not in events
    assert openai_error(events[-1].encode())["type"] == "upstream_error"
    assert json.loads(events[0])["object"] == "chat.completion.chunk"  # what came before was relayed
    assert stream_problem(after.content, 8) is None
    assert stats["proxy"]["upstream_errors"] == 1
    assert stats["proxy"]["streams_started"] == 2
    assert stats["proxy"]["streams_completed"] == 1
    proxy.assert_no_traceback()


def test_an_upstream_failure_the_guard_cannot_recover_is_a_502(start_proxy: StartProxy) -> None:
    """Headers then a reset: the completion ran, so the guard does not send it again; the proxy answers 502."""
    with faulty_emulator() as server:
        proxy = start_proxy(server.url)
        rule = server.inject(Fault.RESET_AFTER_HEADERS, path=CHAT)
        with httpx.Client(base_url=proxy.url, timeout=10.0) as client:
            response = client.post(CHAT, json=chat(stream=False, max_tokens=8))
            after = client.post(CHAT, json=chat(stream=False, max_tokens=8))
        stats = proxy.stats()
        upstream = server.stats()
    assert rule.triggered == 1
    assert response.status_code == 502
    assert response.headers["content-type"] == "application/json"
    assert openai_error(response.content)["type"] == "upstream_error"
    assert completion_problem(after.content, 8) is None
    assert upstream.completions_started == 2  # no duplicate
    assert stats["proxy"]["upstream_errors"] == 1
    proxy.assert_no_traceback()


def test_a_dead_upstream_gives_502s_after_the_guards_retries(start_proxy: StartProxy) -> None:
    proxy = start_proxy(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with httpx.Client(base_url=proxy.url, timeout=30.0) as client:
        models = client.get(MODELS)
        streamed = client.post(CHAT, json=chat(stream=True, max_tokens=4))
    stats = proxy.stats()
    for response in (models, streamed):
        assert response.status_code == 502
        assert openai_error(response.content)["type"] == "upstream_error"
    assert stats["proxy"]["upstream_errors"] == 2
    assert stats["proxy"]["upstream_error_kinds"] == {"ConnectError": 2}
    assert stats["guard"]["attempts"] == 2 * 4, stats["guard"]  # max_attempts: the guard tried before giving up
    proxy.assert_no_traceback()


def test_status_and_content_type_are_relayed(start_proxy: StartProxy) -> None:
    with faulty_emulator() as server:
        proxy = start_proxy(server.url)
        with httpx.Client(base_url=proxy.url, timeout=10.0) as client:
            invalid = client.post(CHAT, json={"stream": True})  # no messages: llama-server's 400
            streamed = client.post(CHAT, json=chat(stream=True, max_tokens=2))
            full = client.post(CHAT, json=chat(stream=False, max_tokens=2))
            models = client.get(MODELS)
            # A Retry-After longer than the guard's max_retry_after (30 s): the guard hands the 503 back at once.
            server.inject(Fault.STATUS_503, path=CHAT, retry_after=120, message="Busy")
            busy = client.post(CHAT, json=chat(stream=True, max_tokens=2))
    assert invalid.status_code == 400
    assert openai_error(invalid.content)["type"] == "invalid_request_error"
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert full.headers["content-type"].startswith("application/json")
    assert models.headers["content-type"].startswith("application/json")
    assert json.loads(models.content)["object"] == "list"
    assert busy.status_code == 503
    assert busy.headers["retry-after"] == "120"
    assert openai_error(busy.content)["message"] == "Busy"
    assert proxy.stats()["proxy"]["upstream_errors"] == 0  # answers, not failures
    proxy.assert_no_traceback()


# -- the Authorization header -----------------------------------------------------------------------------------


class RecordingUpstream:
    """A tiny HTTP/1.1 server on 127.0.0.1 that records the Authorization header of each request it gets."""

    def __init__(self) -> None:
        seen: list[tuple[str, str | None]] = []
        self.seen = seen

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as llama-server: the guard probes each new connection

            def do_GET(self) -> None:
                seen.append((self.path, self.headers.get("Authorization")))
                body = b'{"status":"ok"}' if self.path == "/health" else b'{"object":"list","data":[{"id":"m"}]}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> RecordingUpstream:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5.0)

    def authorization_of(self, path: str) -> list[str | None]:
        return [auth for seen_path, auth in self.seen if seen_path == path]


SECRET = "sk-upstream-secret-0123456789"
CLIENT_TOKEN = "Bearer client-token-9876543210"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"LLAMA_FORWARD_AUTHORIZATION": "1"}, CLIENT_TOKEN),
        ({"LLAMA_UPSTREAM_API_KEY": SECRET}, f"Bearer {SECRET}"),
        ({"LLAMA_UPSTREAM_API_KEY": SECRET, "LLAMA_FORWARD_AUTHORIZATION": "1"}, f"Bearer {SECRET}"),
    ],
    ids=["dropped", "forwarded", "api-key", "api-key-wins"],
)
def test_authorization_goes_upstream_only_when_configured_and_is_never_logged(
    start_proxy: StartProxy, env: dict[str, str], expected: str | None
) -> None:
    with RecordingUpstream() as upstream:
        proxy = start_proxy(upstream.url, log_level="debug", **env)
        response = httpx.get(proxy.url + MODELS, headers={"Authorization": CLIENT_TOKEN}, timeout=10.0)
    assert response.status_code == 200
    assert upstream.authorization_of(MODELS) == [expected]
    log = proxy.log_text()
    assert SECRET not in log
    assert "client-token" not in log
