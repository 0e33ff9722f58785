"""An OpenAI-compatible proxy in front of llama-server: FastAPI, and one guarded httpx.AsyncClient upstream.

    python examples/fastapi_proxy.py                         # serves on :8000 until Ctrl-C, emulated llama-server
    python examples/fastapi_proxy.py http://127.0.0.1:8080   # your llama-server (or set LLAMA_UPSTREAM/LLAMA_URL)
    python examples/fastapi_proxy.py --demo                  # 64 streaming clients through the proxy, then exit
    LLAMA_UPSTREAM=http://127.0.0.1:8080 uvicorn examples.fastapi_proxy:app --port 8000

Routes: POST /v1/chat/completions and /v1/completions (streamed when the body says "stream": true), GET /v1/models,
GET /health (the proxy itself), GET /guard/stats (the guard's counters and the proxy's own, JSON) and GET /metrics
(the guard's counters in Prometheus' text format, per origin: llama_guard.metrics; needs prometheus_client).

The whole app shares one httpx.AsyncClient, made in the lifespan and closed at shutdown, whose transport is a
llama_guard.AsyncGuardTransport. Without the guard, a proxy like this one loses requests: llama-server closes the
connection of every streamed response right after the final chunk although it announced keep-alive, and the next
request that the pool sends on it fails (see docs/how-it-works.md).

- Streams are relayed as they come: each upstream chunk is read only when the previous one has been handed to the
  client's connection, so a slow client slows the upstream read (backpressure) and nothing piles up in memory.
- A client that goes away cancels its upstream request: the upstream response is closed, llama-server sees the
  connection close and stops generating. The same holds while the proxy waits for the upstream headers, or for a
  non-streamed answer.
- An upstream failure that the guard could not recover becomes a 502 (504 for a timeout) with an OpenAI-style JSON
  error body; a stream that breaks after its headers were relayed ends with an SSE error event and no [DONE].

Settings (environment, read when the module is imported, so that uvicorn can load `app`):

    LLAMA_UPSTREAM               llama-server's base URL (else LLAMA_URL, as the other examples; else
                                 http://127.0.0.1:8080)
    LLAMA_UPSTREAM_API_KEY       send "Authorization: Bearer <key>" upstream (llama-server --api-key)
    LLAMA_FORWARD_AUTHORIZATION  1: pass the client's Authorization header upstream (default: drop it)
    LLAMA_PROXY_MAX_CONNECTIONS  upstream connection pool size (default 16)
    LLAMA_PROXY_TIMEOUT          upstream read/write/pool timeout in seconds (default 600, llama-server's own)
    LLAMA_GUARD_DISABLE          1: plain httpx upstream, no guard (to see what the guard is for)

Secrets are never logged: the proxy's log lines name the error class and the path, never a header.

Needs the examples extra (FastAPI and uvicorn): ``pip install -e '.[examples]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import anyio
import httpx

import llama_guard
from llama_guard.metrics import PrometheusCollector

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.types import Receive, Scope, Send
except ModuleNotFoundError as error:  # not examples/_llama_url.missing_extra: uvicorn imports this as a package module
    print(
        f"fastapi_proxy.py needs the 'examples' extra ({error.name} is not installed): pip install -e '.[examples]'",
        file=sys.stderr,
    )
    raise SystemExit(2) from None
try:  # /metrics only: the proxy runs without it
    import prometheus_client
except ModuleNotFoundError:
    prometheus_client = None  # type: ignore[assignment]

__all__ = ["ProxyConfig", "ProxyStats", "app", "config_from_env", "create_app"]

log = logging.getLogger("llama_guard.fastapi_proxy")

T = TypeVar("T")

DEFAULT_UPSTREAM = "http://127.0.0.1:8080"
#: Requests larger than this are refused with 413 before anything is sent upstream.
MAX_REQUEST_BYTES = 32 * 1024 * 1024
#: Upstream response headers worth relaying; hop-by-hop ones (Connection, Keep-Alive, Transfer-Encoding) and the
#: length (the ASGI server sets its own) are not.
RELAYED_HEADERS = ("content-type", "retry-after")
#: How long closing an upstream response may take once the client is gone (it is never more than a socket close).
CLOSE_TIMEOUT = 5.0


@dataclass(frozen=True)
class ProxyConfig:
    """Everything create_app() needs; config_from_env() reads it from the environment."""

    upstream: str = DEFAULT_UPSTREAM
    guarded: bool = True
    policy: llama_guard.GuardPolicy | None = None
    # keepalive_expiry below llama-server's 5 s keep-alive timeout, so an idle connection is let go first.
    limits: httpx.Limits = field(
        default_factory=lambda: httpx.Limits(max_connections=16, max_keepalive_connections=16, keepalive_expiry=4.0)
    )
    # llama-server sends the headers of a non-streamed completion when generation is over: allow for it.
    timeout: httpx.Timeout = field(default_factory=lambda: httpx.Timeout(600.0, connect=5.0))
    api_key: str | None = field(default=None, repr=False)
    forward_authorization: bool = False


@dataclass
class ProxyStats:
    """The proxy's own counters (the event loop is single-threaded: plain integers are enough)."""

    requests: int = 0
    streams_started: int = 0
    streams_completed: int = 0
    #: Requests whose client went away before the answer was complete: their upstream request was cancelled.
    client_disconnects: int = 0
    #: Upstream failures that reached the proxy, after the guard's retries: 502/504 answers and broken streams.
    upstream_errors: int = 0
    upstream_error_kinds: dict[str, int] = field(default_factory=dict)

    def upstream_error(self, exc: BaseException) -> None:
        self.upstream_errors += 1
        kind = error_kind(exc)
        self.upstream_error_kinds[kind] = self.upstream_error_kinds.get(kind, 0) + 1


def error_kind(exc: BaseException) -> str:
    """The httpx exception's name: ``ConnectError`` for the guard's ``GuardedConnectError`` too."""
    for cls in type(exc).__mro__:
        if issubclass(cls, httpx.HTTPError) and not issubclass(cls, llama_guard.GuardError):
            return cls.__name__
    return type(exc).__name__


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def upstream_from_env() -> str | None:
    return os.environ.get("LLAMA_UPSTREAM") or os.environ.get("LLAMA_URL") or None


def config_from_env(upstream: str | None = None) -> ProxyConfig:
    """The configuration the module docstring lists, from the environment (upstream: overrides LLAMA_UPSTREAM)."""
    size = int(os.environ.get("LLAMA_PROXY_MAX_CONNECTIONS", "16"))
    seconds = float(os.environ.get("LLAMA_PROXY_TIMEOUT", "600"))
    return ProxyConfig(
        upstream=upstream or upstream_from_env() or DEFAULT_UPSTREAM,
        guarded=not _env_flag("LLAMA_GUARD_DISABLE"),
        limits=httpx.Limits(max_connections=size, max_keepalive_connections=size, keepalive_expiry=4.0),
        timeout=httpx.Timeout(seconds, connect=min(seconds, 5.0)),
        api_key=os.environ.get("LLAMA_UPSTREAM_API_KEY") or None,
        forward_authorization=_env_flag("LLAMA_FORWARD_AUTHORIZATION"),
    )


def error_body(status: int, message: str, error_type: str) -> dict[str, Any]:
    """An OpenAI-style error document (llama-server's own errors have this shape too)."""
    return {"error": {"code": status, "message": message, "type": error_type}}


def upstream_failure(exc: httpx.HTTPError) -> JSONResponse:
    """502, or 504 for a timeout: what a client gets when the upstream request failed for good."""
    status = 504 if isinstance(exc, httpx.TimeoutException) else 502
    message = f"llama-server upstream failed: {error_kind(exc)}"
    return JSONResponse(error_body(status, message, "upstream_error"), status_code=status)


def relayed_headers(upstream: httpx.Response) -> dict[str, str]:
    return {name: upstream.headers[name] for name in RELAYED_HEADERS if name in upstream.headers}


async def close_quietly(response: httpx.Response) -> None:
    """Close an upstream response even while this task is being cancelled (a client went away): closing an unread
    response closes its connection, which is what tells llama-server to stop generating."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
        await response.aclose()


async def until_disconnected(request: Request) -> None:
    """Return when the client has gone away (call it once the request body has been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    """The client disconnected while the proxy waited for llama-server."""


async def unless_disconnected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work()``; if the client disconnects first, cancel it (and with it the upstream request) and raise
    ClientGone."""
    result: list[T] = []
    failure: list[Exception] = []
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            await until_disconnected(request)
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            result.append(await work())
        except Exception as exc:  # raised outside the group, which would wrap it in an ExceptionGroup
            failure.append(exc)
        finally:
            group.cancel_scope.cancel()
    if failure:
        raise failure[0]
    if not result:
        raise ClientGone
    return result[0]


class RelayResponse(StreamingResponse):
    """A StreamingResponse that closes its upstream response however the relay ends: the stream finished, the
    client went away (Starlette cancels the relay), or an error. Its body pulls one upstream chunk per chunk sent."""

    def __init__(self, upstream: httpx.Response, stats: ProxyStats) -> None:
        self.upstream = upstream
        self.stats = stats
        self.finished = False
        self.failed = False
        self.relay = self._relay()
        super().__init__(self.relay, status_code=upstream.status_code, headers=relayed_headers(upstream))
        # Tell buffering reverse proxies (nginx) in front of this one to pass events on at once.
        self.headers["cache-control"] = "no-cache"
        self.headers["x-accel-buffering"] = "no"

    async def _relay(self) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in self.upstream.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            # The headers are out: no status code can tell the client any more. An error event can (OpenAI's
            # clients raise on it), and the missing [DONE] says the answer is incomplete.
            self.failed = True
            self.stats.upstream_error(exc)
            log.warning("upstream stream broke: %s", error_kind(exc))
            message = f"llama-server upstream failed mid-stream: {error_kind(exc)}"
            yield b"data: " + json.dumps(error_body(502, message, "upstream_error")).encode() + b"\n\n"
            return
        finally:
            await close_quietly(self.upstream)
        self.finished = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # A client that left while Starlette was in send() leaves the relay suspended at its yield: close it,
            # which closes the upstream response (so llama-server stops), whatever happened.
            with anyio.CancelScope(shield=True):
                await self.relay.aclose()
                await close_quietly(self.upstream)
            if self.finished:
                self.stats.streams_completed += 1
            elif not self.failed:
                self.stats.client_disconnects += 1


async def read_body(request: Request) -> bytes | None:
    """The request body, or None when it is larger than MAX_REQUEST_BYTES."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_REQUEST_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def wants_stream(body: bytes) -> bool:
    try:
        document = json.loads(body)
    except ValueError:
        return False  # llama-server answers it with its own error
    return isinstance(document, dict) and document.get("stream") is True


def create_app(
    upstream_url: str,
    *,
    policy: llama_guard.GuardPolicy | None = None,
    guarded: bool = True,
    limits: httpx.Limits | None = None,
    timeout: httpx.Timeout | None = None,
    api_key: str | None = None,
    forward_authorization: bool = False,
) -> FastAPI:
    """The proxy app for the llama-server at ``upstream_url``. ``guarded=False`` uses plain httpx upstream."""
    defaults = ProxyConfig()
    config = ProxyConfig(
        upstream=upstream_url,
        guarded=guarded,
        policy=policy,
        limits=limits or defaults.limits,
        timeout=timeout or defaults.timeout,
        api_key=api_key,
        forward_authorization=forward_authorization,
    )
    return app_for(config)


def app_for(config: ProxyConfig) -> FastAPI:
    stats = ProxyStats()
    upstream: dict[str, Any] = {}  # filled by the lifespan: "client", and "transport" when guarded

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        plain = httpx.AsyncHTTPTransport(limits=config.limits)
        transport: httpx.AsyncBaseTransport = plain
        if config.guarded:
            transport = llama_guard.AsyncGuardTransport(plain, policy=config.policy)
        headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        async with httpx.AsyncClient(
            base_url=config.upstream, transport=transport, timeout=config.timeout, headers=headers
        ) as client:
            upstream["client"] = client
            upstream["transport"] = transport if config.guarded else None
            if config.guarded and prometheus_client is not None:
                # The registry /metrics serves: this app's guard only (prometheus_client.REGISTRY would be the
                # process's, with every guard in it: llama_guard.metrics.register_prometheus()).
                registry = prometheus_client.CollectorRegistry()
                registry.register(PrometheusCollector(sources=[transport]))
                upstream["registry"] = registry
            app.state.guard_stats = llama_guard.stats_of(client) if config.guarded else None
            log.info("proxying to %s (%s)", config.upstream, "guarded" if config.guarded else "NOT guarded")
            yield
            upstream.clear()

    app = FastAPI(title="llama-server proxy", lifespan=lifespan)

    def client() -> httpx.AsyncClient:
        found: httpx.AsyncClient = upstream["client"]
        return found

    def auth_headers(request: Request) -> dict[str, str]:
        if config.api_key is None and config.forward_authorization and "authorization" in request.headers:
            return {"authorization": request.headers["authorization"]}
        return {}

    async def completion(request: Request, path: str) -> Response:
        stats.requests += 1
        body = await read_body(request)
        if body is None:
            limit = f"request body over {MAX_REQUEST_BYTES} bytes"
            return JSONResponse(error_body(413, limit, "invalid_request_error"), status_code=413)
        headers = {"content-type": request.headers.get("content-type", "application/json"), **auth_headers(request)}
        outgoing = client().build_request("POST", path, content=body, headers=headers)
        stream = wants_stream(body)

        async def send() -> httpx.Response:
            response = await client().send(outgoing, stream=True)
            if stream and response.status_code == 200:
                return response  # relayed chunk by chunk below
            try:
                await response.aread()  # a JSON answer, or llama-server's error: whole, then relayed
            finally:
                await close_quietly(response)
            return response

        try:
            response = await unless_disconnected(request, send)
        except ClientGone:
            stats.client_disconnects += 1
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        except httpx.HTTPError as exc:
            stats.upstream_error(exc)
            log.warning("upstream request failed: POST %s: %s", path, error_kind(exc))
            return upstream_failure(exc)
        if not response.is_closed:
            stats.streams_started += 1
            return RelayResponse(response, stats)
        return Response(response.content, status_code=response.status_code, headers=relayed_headers(response))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await completion(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion(request, "/v1/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        stats.requests += 1
        try:
            response = await client().get("/v1/models", headers=auth_headers(request))
        except httpx.HTTPError as exc:
            stats.upstream_error(exc)
            log.warning("upstream request failed: GET /v1/models: %s", error_kind(exc))
            return upstream_failure(exc)
        return Response(response.content, status_code=response.status_code, headers=relayed_headers(response))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/guard/stats")
    async def guard_stats() -> dict[str, Any]:
        transport = upstream.get("transport")
        guard = transport.stats.snapshot().as_dict() if isinstance(transport, llama_guard.AsyncGuardTransport) else None
        return {"guarded": config.guarded, "guard": guard, "proxy": asdict(stats)}

    @app.get("/metrics")
    async def metrics() -> Response:
        if prometheus_client is None:
            message = "/metrics needs prometheus_client: pip install -e '.[examples]' (or 'llama-guard[prometheus]')\n"
            return PlainTextResponse(message, status_code=501)
        registry = upstream.get("registry")
        text = prometheus_client.generate_latest(registry) if registry is not None else b""
        return Response(text, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    return app


#: For ``uvicorn examples.fastapi_proxy:app``; configured from the environment.
app = app_for(config_from_env())


# -- python examples/fastapi_proxy.py ---------------------------------------------------------------------------


@contextmanager
def llama_server(url: str | None) -> Iterator[str]:
    """The upstream to use: the given URL, else LLAMA_UPSTREAM or LLAMA_URL, else an emulator started here."""
    url = url or upstream_from_env()
    if url:
        yield url
        return
    from llama_guard.testing import LlamaServerEmulator

    # The emulator closes a stream's connection 60 ms after the final chunk (llama-server does it at once), so
    # that on loopback the pool reuses the connection before it dies, as it does under load.
    with LlamaServerEmulator(stream_close_delay=0.06, parallel=8) as server:
        print(f"emulated llama-server at {server.url}", flush=True)
        yield server.url


async def demo(config: ProxyConfig, clients: int, requests: int) -> int:
    """Serve the proxy on a free port, send ``requests`` streamed completions from ``clients`` clients through it,
    check every stream ended with [DONE], print the counters, and stop."""
    server = uvicorn.Server(uvicorn.Config(app_for(config), host="127.0.0.1", port=0, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            return 1
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    proxy = f"http://127.0.0.1:{port}"
    numbers = iter(range(requests))
    complete = failed = 0

    async def one_client() -> None:
        nonlocal complete, failed
        async with httpx.AsyncClient(base_url=proxy, timeout=60.0) as http:
            for index in numbers:
                body = {"messages": [{"role": "user", "content": f"hello {index}"}], "max_tokens": 8, "stream": True}
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    text = (await response.aread()).decode()
                if response.status_code == 200 and text.rstrip().endswith("data: [DONE]"):
                    complete += 1
                else:
                    failed += 1

    async def progress() -> None:
        # On stderr, like llama-guard's own progress: the demo takes tens of seconds and should not look stuck.
        print(f"sending {requests} streamed completions from {clients} clients through {proxy} ...", file=sys.stderr)
        while True:
            await asyncio.sleep(2.0)
            elapsed = time.monotonic() - started
            print(f"  {elapsed:3.0f} s: {complete + failed} of {requests} done, {failed} failed", file=sys.stderr)

    started = time.monotonic()
    reporter = asyncio.create_task(progress())
    try:
        await asyncio.gather(*(one_client() for _ in range(clients)))
        async with httpx.AsyncClient(base_url=proxy) as http:
            counters = (await http.get("/guard/stats")).json()
    finally:
        reporter.cancel()
        server.should_exit = True
        await serving
    seconds = time.monotonic() - started
    print(
        f"{clients} clients, {requests} streamed completions in {seconds:.1f} s: {complete} complete, {failed} failed"
    )
    print(f"proxy: {counters['proxy']}")
    print(f"guard: {counters['guard']}")
    return 0 if complete == requests and counters["proxy"]["upstream_errors"] == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description="OpenAI-compatible proxy to llama-server through llama_guard")
    parser.add_argument("upstream", nargs="?", help="llama-server's URL (default: LLAMA_UPSTREAM, else an emulator)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--demo", action="store_true", help="send 64 streaming clients through the proxy and exit")
    parser.add_argument("--requests", type=int, default=640, help="streamed completions the demo sends")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    with llama_server(args.upstream) as url:
        config = config_from_env(url)
        if args.demo:
            return asyncio.run(demo(config, clients=64, requests=args.requests))
        body = '{"messages": [], "stream": true}'
        print(f"try: curl -N http://{args.host}:{args.port}/v1/chat/completions -d '{body}'", flush=True)
        uvicorn.run(app_for(config), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
