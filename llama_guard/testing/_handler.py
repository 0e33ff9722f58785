"""One connection's life on a pool thread: cpp-httplib's keep-alive loop.

``serve_connection`` is ``Server::process_and_close_socket``: it serves up to
``keepalive_max`` requests, waiting at most ``keepalive_timeout`` for each next
one (``detail::keep_alive``), and stops as soon as a request handler reports
failure.  A streamed completion always "fails" in b11434: llama-server's
chunked content provider returns ``false`` after ``sink.done()``, which
cpp-httplib treats as a cancelled write -- so the connection is closed right
after the terminating ``0\\r\\n\\r\\n`` although the head promised
``Keep-Alive: timeout=5, max=100`` (defect 1).  With ``stream_close="on_reuse"``
the emulator makes that loss deterministic: it sends no FIN, waits for the
client's next request on the connection, reads it, and closes unanswered.

Requests are parsed with h11 (one ``h11.Connection`` per request, so h11's own
keep-alive rules never interfere with cpp-httplib's); responses are written as
raw bytes so framing is exactly the server's, including the faulty variants.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any, NoReturn

import h11

from . import _responses as R
from ._config import MAX_TOKENS, EmulatorConfig
from ._faults import Fault, FaultInjector, FaultRule
from ._slots import SlotPool
from ._stats import StatsRecorder
from ._wire import PeerGone, Stopping, Wire

__all__ = ["ServerContext", "serve_connection"]

#: Largest request head h11 will buffer (cpp-httplib rejects long header
#: lines with 400; the exact limit differs but only the outcome matters).
MAX_HEAD_BYTES = 64 * 1024
#: Largest request body read (cpp-httplib: CPPHTTPLIB_PAYLOAD_MAX_LENGTH).
MAX_BODY_BYTES = 100 * 1024 * 1024


class ConnectionFinished(Exception):
    """A fault (or a handler) already closed the socket: just unwind."""


@dataclass
class ServerContext:
    """Everything a handler needs from the emulator, and nothing more."""

    config: EmulatorConfig
    stats: StatsRecorder
    faults: FaultInjector
    slots: SlotPool
    stop_event: threading.Event
    loading: Callable[[], tuple[bool, str | None]]
    created: int = field(default_factory=R.now)


@dataclass
class Request:
    method: str
    target: str
    path: str
    http_version: str
    headers: list[tuple[str, str]]
    body: bytes = b""

    def header(self, name: str) -> str:
        """First value of ``name``, or "" (cpp-httplib's ``get_header_value``)."""
        for key, value in self.headers:
            if key == name:
                return value
        return ""

    @property
    def connection_closed(self) -> bool:
        """Does cpp-httplib close after this request (``connection_closed``)?"""
        connection = self.header("connection")
        if connection == "close":
            return True
        return self.http_version == "1.0" and connection != "Keep-Alive"


def serve_connection(ctx: ServerContext, wire: Wire) -> None:
    """cpp-httplib's ``process_server_socket_core`` for one connection.

    The caller closes the socket afterwards (``shutdown`` + ``close``).
    """
    buffered = b""
    remaining = ctx.config.keepalive_max
    try:
        while remaining > 0:
            if not buffered and not wire.wait_readable(ctx.config.keepalive_timeout):
                return  # keep-alive timeout: cpp-httplib closes the connection
            exchange = _Exchange(ctx, wire, close_connection=remaining == 1)
            keep, buffered = exchange.run(buffered)
            if not keep:
                return
            remaining -= 1
    except (Stopping, PeerGone, ConnectionFinished):
        return


class _Responder:
    """Writes one response, applying any write-time fault on the way."""

    def __init__(self, ctx: ServerContext, wire: Wire, request: Request, close_connection: bool) -> None:
        self.ctx = ctx
        self.wire = wire
        self.request = request
        self.close_connection = close_connection
        self.fault: FaultRule | None = None
        self.announced_keep_alive = False
        self._events_sent = 0
        self._streaming = False

    # -- headers ------------------------------------------------------------------

    def _base_headers(self, status: int, *, cors: bool) -> list[tuple[str, str]]:
        headers = [("Server", "llama.cpp")]
        if cors:
            headers.append(("Access-Control-Allow-Origin", self.request.header("origin")))
        if self.close_connection or self.request.header("connection") == "close" or status >= 400:
            headers.append(("Connection", "close"))
        else:
            headers.append(("Keep-Alive", self.ctx.config.keep_alive_header))
            self.announced_keep_alive = True
        if self.request.method == "HEAD":
            headers.append(("Accept-Ranges", "bytes"))
        if self._fault_is(Fault.HUGE_HEADER):
            assert self.fault is not None
            headers.append(("X-Emulator-Padding", "a" * int(self.fault.params["size"])))
        return headers

    def _fault_is(self, fault: Fault) -> bool:
        return self.fault is not None and self.fault.fault is fault

    # -- full (Content-Length) responses --------------------------------------------

    def send_full(
        self,
        status: int,
        body: bytes,
        content_type: str | None = R.JSON_TYPE,
        *,
        extra: tuple[tuple[str, str], ...] = (),
        cors: bool = True,
    ) -> None:
        headers = self._base_headers(status, cors=cors)
        if body and content_type is None:
            content_type = "text/plain"
        if content_type is not None:
            headers.append(("Content-Type", content_type))
        headers.extend(extra)
        if self._fault_is(Fault.TRUNCATED_CHUNK):
            headers.append(("Transfer-Encoding", "chunked"))
            self.ctx.stats.response(status)
            self.wire.send(R.build_head(status, headers))
            self._truncated_chunk()
        headers.append(("Content-Length", str(len(body))))
        head = R.build_head(status, headers)
        if self.request.method == "HEAD":
            body = b""
        self.ctx.stats.response(status)
        if self._fault_is(Fault.RESET_AFTER_HEADERS):
            self.wire.send(head)
            self._reset()
        if self._fault_is(Fault.RESET_MID_STREAM) or self._fault_is(Fault.BODY_STALL):
            assert self.fault is not None
            cut = self.fault.params["after_bytes"]
            cut = len(body) // 2 if cut is None else min(int(cut), len(body))
            self.wire.send(head + body[:cut])
            self._interrupt()
        self.wire.send(head + body)

    # -- chunked (SSE) responses ---------------------------------------------------

    def start_stream(self) -> None:
        headers = self._base_headers(200, cors=True)
        headers += [
            ("Content-Type", R.SSE_TYPE),
            ("Transfer-Encoding", "chunked"),
            ("X-Accel-Buffering", "no"),
        ]
        self.ctx.stats.response(200)
        self._streaming = True
        self.wire.send(R.build_head(200, headers))
        if self._fault_is(Fault.RESET_AFTER_HEADERS):
            self._reset()

    def stream_event(self, data: bytes) -> None:
        self._maybe_interrupt_stream()
        self.wire.send(R.chunk(data))
        self._events_sent += 1

    def end_stream(self) -> None:
        # A mid-stream fault whose chunk count was never reached fires here, so
        # the terminating chunk never arrives.
        if self.fault is not None and self.fault.fault in _MID_STREAM_FAULTS:
            self._fire_stream_fault()
        self.wire.send(R.LAST_CHUNK)

    def _maybe_interrupt_stream(self) -> None:
        if self.fault is None or self.fault.fault not in _MID_STREAM_FAULTS:
            return
        if self._events_sent >= int(self.fault.params["after_chunks"]):
            self._fire_stream_fault()

    def _fire_stream_fault(self) -> NoReturn:
        if self._fault_is(Fault.TRUNCATED_CHUNK):
            self._truncated_chunk()
        self._interrupt()

    # -- fault endings ---------------------------------------------------------------

    def _reset(self) -> NoReturn:
        self.wire.reset()
        raise ConnectionFinished

    def _interrupt(self) -> NoReturn:
        """RESET_MID_STREAM resets; BODY_STALL goes silent, then closes."""
        assert self.fault is not None
        if self.fault.fault is Fault.BODY_STALL:
            self.wire.hold(self.fault.params["hold"])
            self.wire.close()
            raise ConnectionFinished
        self._reset()

    def _truncated_chunk(self) -> NoReturn:
        assert self.fault is not None
        size_line = bytes(self.fault.params["size_line"])
        payload = bytes(self.fault.params["payload"])
        self.wire.send(size_line + b"\r\n" + payload)
        self.wire.close()
        raise ConnectionFinished


_MID_STREAM_FAULTS = frozenset({Fault.RESET_MID_STREAM, Fault.BODY_STALL, Fault.TRUNCATED_CHUNK})


@dataclass(frozen=True, slots=True)
class _Exchange:
    """One request/response cycle (cpp-httplib's ``Server::process_request``)."""

    ctx: ServerContext
    wire: Wire
    _: KW_ONLY
    close_connection: bool

    def run(self, buffered: bytes) -> tuple[bool, bytes]:
        """Serve one request; return (keep the connection?, unread bytes)."""
        parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        if buffered:  # (receive_data(b"") would mean EOF to h11)
            parser.receive_data(buffered)
        try:
            head = self._read_head(parser, got_bytes=bool(buffered))
            if head is None:
                return False, b""
            request = head
            self.ctx.stats.request(request.method, request.path)
            self.wire.requests_read += 1
            if self.wire.stalled and self.wire.requests_read == 2:  # its client still waited when a thread took it
                self.ctx.stats.count("stalled_used_after_release")
            if request.header("expect").lower() == "100-continue":
                self.wire.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.body = self._read_body(parser)
        except h11.RemoteProtocolError:
            self._bad_request()
            return False, b""
        except _BodyTooLarge:
            responder = _Responder(self.ctx, self.wire, request, True)
            responder.send_full(413, b"", None, cors=False)
            return False, b""
        leftover = parser.trailing_data[0]

        responder = _Responder(self.ctx, self.wire, request, self.close_connection)
        rule = self.ctx.faults.take_request_fault(request.method, request.path)
        if rule is not None:
            self.ctx.stats.fault(rule.fault)
            responder.fault = rule
            outcome = self._preempting_fault(rule, responder)
            if outcome is not None:
                return outcome and not request.connection_closed, leftover
        keep = _Router(self.ctx, self.wire, request, responder).dispatch()
        return keep and not request.connection_closed, leftover

    # -- reading ------------------------------------------------------------------

    def _read_head(self, parser: h11.Connection, *, got_bytes: bool) -> Request | None:
        while True:
            event = parser.next_event()
            if event is h11.NEED_DATA:
                data = self.wire.recv()
                if not data and not got_bytes:
                    return None  # the client closed an idle keep-alive connection
                if not data:
                    raise PeerGone("EOF inside a request head")
                got_bytes = True
                parser.receive_data(data)
                continue
            if isinstance(event, h11.Request):
                target = event.target.decode("latin-1")
                raw_path = target.split("?", 1)[0].split("#", 1)[0]
                return Request(
                    method=event.method.decode("latin-1"),
                    target=target,
                    path=urllib.parse.unquote(raw_path),
                    http_version=event.http_version.decode("latin-1"),
                    headers=[
                        (name.decode("latin-1").lower(), value.decode("latin-1")) for name, value in event.headers
                    ],
                )
            if isinstance(event, h11.ConnectionClosed):
                return None
            raise h11.RemoteProtocolError(f"unexpected {event!r}", 400)

    def _read_body(self, parser: h11.Connection) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            event = parser.next_event()
            if event is h11.NEED_DATA:
                data = self.wire.recv()
                if not data:
                    raise PeerGone("EOF inside a request body")
                parser.receive_data(data)
            elif isinstance(event, h11.Data):
                size += len(event.data)
                if size > MAX_BODY_BYTES:
                    raise _BodyTooLarge
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(parts)
            else:
                raise h11.RemoteProtocolError(f"unexpected {event!r}", 400)

    def _bad_request(self) -> None:
        """400 without CORS header: pre-routing never ran (as in cpp-httplib)."""
        request = Request("GET", "", "", "1.1", [])
        _Responder(self.ctx, self.wire, request, True).send_full(400, b"", None, cors=False)

    # -- faults that replace the answer -------------------------------------------------

    def _preempting_fault(self, rule: FaultRule, responder: _Responder) -> bool | None:
        """Apply a fault that replaces the answer.

        Returns whether the connection stays open, or None when the fault acts
        while the normal answer is written (the responder fires it).
        """
        fault = rule.fault
        if fault is Fault.HEADERS_NEVER:
            self.wire.hold(rule.params["hold"])
            return False
        if fault is Fault.GARBAGE:
            self.wire.send(bytes(rule.params["data"]))
            self.wire.close()
            return False
        if fault in (Fault.STATUS_503, Fault.STATUS_429):
            code = 503 if fault is Fault.STATUS_503 else 429
            error_type = "unavailable_error" if code == 503 else "rate_limit_error"
            retry_after = rule.params["retry_after"]
            extra = () if retry_after is None else (("Retry-After", str(retry_after)),)
            responder.fault = None
            body = R.error_body(code, str(rule.params["message"]), error_type)
            responder.send_full(code, body, extra=extra)
            # Like any >= 400 answer: "Connection: close" is announced, but
            # cpp-httplib keeps reading until the client really closes.
            return True
        return None


class _BodyTooLarge(Exception):
    pass


class _ErrorAnswer(Exception):
    """Raised by a route's helper: answer the request with llama-server's error body instead."""

    def __init__(self, code: int, message: str, error_type: str) -> None:
        super().__init__(code, message, error_type)
        self.code = code
        self.message = message
        self.error_type = error_type


@dataclass(frozen=True, slots=True)
class _Router:
    """llama-server's pre-routing middleware and route table."""

    ctx: ServerContext
    wire: Wire
    request: Request
    responder: _Responder

    def dispatch(self) -> bool:
        """Serve the request; False when the connection must close."""
        request = self.request
        if request.method == "OPTIONS":
            self.responder.send_full(
                200,
                b"",
                "text/html",
                extra=(
                    ("Access-Control-Allow-Credentials", "true"),
                    ("Access-Control-Allow-Methods", "GET, POST"),
                    ("Access-Control-Allow-Headers", "*"),
                ),
            )
            return True
        loading, retry_after = self.ctx.loading()
        if loading:
            extra = () if retry_after is None else (("Retry-After", retry_after),)
            body = R.error_body(503, "Loading model", "unavailable_error")
            self.responder.send_full(503, body, extra=extra)
            return True
        method = "GET" if request.method == "HEAD" else request.method
        route = _ROUTES.get((method, request.path))
        if route is None:
            body = R.error_body(404, "File Not Found", "not_found_error")
            self.responder.send_full(404, body)
            return True
        try:
            return route(self)
        except _ErrorAnswer as answer:
            return self._error(answer.code, answer.message, answer.error_type)

    # -- simple endpoints ----------------------------------------------------------

    def health(self) -> bool:
        self.responder.send_full(200, R.health_body())
        return True

    def models(self) -> bool:
        self.responder.send_full(200, R.models_body(self.ctx.config.model, self.ctx.created))
        return True

    def props(self) -> bool:
        cfg = self.ctx.config
        body = R.props_body(model=cfg.model, build=cfg.build, total_slots=cfg.parallel, n_predict=cfg.n_tokens)
        self.responder.send_full(200, body)
        return True

    def slots(self) -> bool:
        body = R.slots_body(self.ctx.slots.views(), self.ctx.config.n_tokens)
        self.responder.send_full(200, body)
        return True

    def metrics(self) -> bool:
        message = "This server does not support metrics endpoint. Start it with `--metrics`"
        self.responder.send_full(501, R.error_body(501, message, "not_supported_error"))
        return True

    def lora_adapters(self) -> bool:
        # No adapter is loaded (no --lora): the list is empty.
        self.responder.send_full(200, b"[]")
        return True

    def apply_lora_adapters(self) -> bool:
        """``POST /lora-adapters``: set adapter scales. Not inference: it changes the server's state, so it is the
        emulator's non-idempotent, non-inference endpoint. With no adapter loaded only ``[]`` is valid."""
        body = self._json_body()
        if not isinstance(body, list):
            return self._error(400, "Request body must be an array", "invalid_request_error")
        if body:
            return self._error(400, "invalid adapter id", "invalid_request_error")
        self.responder.send_full(200, b'{"success":true}')
        return True

    def chat(self) -> bool:
        return self._completion("chat")

    def oai_completion(self) -> bool:
        return self._completion("oai")

    def native_completion(self) -> bool:
        return self._completion("native")

    # -- completions -----------------------------------------------------------------

    def _error(self, code: int, message: str, error_type: str) -> bool:
        self.responder.send_full(code, R.error_body(code, message, error_type))
        return True

    def _json_body(self) -> Any:
        """The request's body as JSON (none: null). Not JSON: llama-server answers 500 with nlohmann's parse error,
        raised as `_ErrorAnswer` for `dispatch` to send."""
        try:
            return json.loads(self.request.body or b"null")
        except ValueError as exc:
            raise _ErrorAnswer(500, f"[json.exception.parse_error.101] {exc}", "server_error") from exc

    def _completion(self, kind: str) -> bool:
        body = self._json_body()
        if not isinstance(body, dict):
            return self._error(400, "request body must be a JSON object", "invalid_request_error")
        if kind == "chat" and not isinstance(body.get("messages"), list):
            return self._error(400, "'messages' is required", "invalid_request_error")
        if kind != "chat" and "prompt" not in body:
            return self._error(400, '"prompt" must be provided', "invalid_request_error")
        n_tokens, limited = _requested_tokens(body, self.ctx.config.n_tokens)
        completion = R.Completion(
            kind=kind,
            model=str(body.get("model") or self.ctx.config.model),
            build=self.ctx.config.build,
            n_tokens=n_tokens,
            prompt_tokens=_prompt_tokens(body),
            limited=limited,
            slot_id=-1,
            stream=body.get("stream") is True,
            id=("chatcmpl-" if kind == "chat" else "cmpl-") + R.random_id(),
            created=R.now(),
        )
        acquired = self.ctx.slots.acquire(self.wire.peer_closed, n_tokens)
        if acquired is None:
            if self.ctx.stop_event.is_set():
                raise Stopping
            return False  # client went away while waiting: task dropped, never run
        slot_id, _task_id = acquired
        completion = replace(completion, slot_id=slot_id)
        run = _InferenceRun(self.ctx, self.wire, slot_id)
        self.ctx.stats.count("completions_started")
        try:
            if completion.stream:
                return self._stream(completion, run)
            return self._full(completion, run)
        finally:
            run.end()

    def _full(self, completion: R.Completion, run: _InferenceRun) -> bool:
        started = time.monotonic()
        for index in range(completion.n_tokens):
            run.next_token(index, check_peer=True)
        run.finish()
        self.responder.send_full(200, completion.body(time.monotonic() - started))
        return True

    def _stream(self, completion: R.Completion, run: _InferenceRun) -> bool:
        started = time.monotonic()
        # Headers go out only with the first result (llama-server awaits it to
        # turn an early error into a plain JSON error response).
        if completion.n_tokens > 0:
            run.next_token(0, check_peer=False)
        self.responder.start_stream()
        for event in completion.opening_events():
            self.responder.stream_event(event)
        for index in range(completion.n_tokens):
            if index > 0:
                run.next_token(index, check_peer=False)
            self.responder.stream_event(completion.token_event(index))
        run.finish()
        for event in completion.closing_events(time.monotonic() - started):
            self.responder.stream_event(event)
        self.responder.end_stream()
        if not self.ctx.config.close_after_stream:
            return True
        # Defect 1: the provider returned false after sink.done(); cpp-httplib
        # closes the socket right away, whatever the head announced.
        if self.responder.announced_keep_alive:
            self.ctx.stats.count("streams_closed_after_done")
            if self.ctx.config.stream_close == "on_reuse":
                self._give_up_on_reuse()
                return False
        self.wire.sleep(self.ctx.config.stream_close_delay)
        return False

    def _give_up_on_reuse(self) -> None:
        """``stream_close="on_reuse"``: keep the given-up connection open (no FIN) until the client writes its next
        request on it, then close it unread -- what a client that reused it sees on the real server, whatever the
        timing. The keep-alive timeout, or the client closing first, ends it quietly."""
        if not self.wire.wait_readable(self.ctx.config.keepalive_timeout):
            return
        if self.wire.peer_closed():
            return
        self.ctx.stats.count("requests_dropped_after_stream")
        # Read the whole request (and throw it away) before closing: the close is then a FIN with nothing unread,
        # so the client has written all of it and sees "disconnected without a response", never a half-written
        # body (which some clients report differently, e.g. trio's unfinished body generator).
        _discard_request(self.wire)


def _discard_request(wire: Wire) -> None:
    """Read one request to its end (or to EOF / a framing error) without serving it."""
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    try:
        while True:
            event = parser.next_event()
            if event is h11.NEED_DATA:
                data = wire.recv()
                parser.receive_data(data)
                if not data:
                    return
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return
    except h11.RemoteProtocolError:
        return


_ROUTES: dict[tuple[str, str], Callable[[_Router], bool]] = {
    ("GET", "/health"): _Router.health,
    ("GET", "/v1/health"): _Router.health,
    ("GET", "/models"): _Router.models,
    ("GET", "/v1/models"): _Router.models,
    ("GET", "/props"): _Router.props,
    ("GET", "/slots"): _Router.slots,
    ("GET", "/metrics"): _Router.metrics,
    ("GET", "/lora-adapters"): _Router.lora_adapters,
    ("POST", "/lora-adapters"): _Router.apply_lora_adapters,
    ("POST", "/completion"): _Router.native_completion,
    ("POST", "/completions"): _Router.native_completion,
    ("POST", "/v1/completions"): _Router.oai_completion,
    ("POST", "/chat/completions"): _Router.chat,
    ("POST", "/v1/chat/completions"): _Router.chat,
}


class _InferenceRun:
    """Slot bookkeeping for one completion: progress, finish, cancel."""

    def __init__(self, ctx: ServerContext, wire: Wire, slot_id: int) -> None:
        self.ctx = ctx
        self.wire = wire
        self.slot_id = slot_id
        self.finished = False
        self.released = False

    def next_token(self, index: int, *, check_peer: bool) -> None:
        """Spend ``token_interval`` on one token; non-streamed runs poll the peer."""
        self.wire.sleep(self.ctx.config.token_interval)
        if check_peer and self.ctx.config.token_interval > 0 and self.wire.peer_closed():
            raise PeerGone("client disconnected during generation")
        self.ctx.slots.progress(self.slot_id, index + 1)

    def finish(self) -> None:
        self.finished = True
        self.ctx.stats.count("completions_finished")
        self._release()

    def end(self) -> None:
        if not self.finished:
            self.ctx.stats.count("completions_cancelled")
        self._release()

    def _release(self) -> None:
        if not self.released:
            self.released = True
            self.ctx.slots.release(self.slot_id)


def _requested_tokens(body: dict[str, object], default: int) -> tuple[int, bool]:
    """``max_completion_tokens`` / ``max_tokens`` / ``n_predict``, clamped."""
    for key in ("max_completion_tokens", "max_tokens", "n_predict"):
        value = body.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if value < 0:  # -1: "until EOS" -- the emulator's default length
            return default, False
        return min(value, MAX_TOKENS), True
    return default, False


def _prompt_tokens(body: dict[str, object]) -> int:
    """A rough word count of the prompt; only used for usage/timings."""
    texts: list[str] = []
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        texts.append(prompt)
    elif isinstance(prompt, list):
        texts.extend(str(p) for p in prompt)
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                texts.append(str(message.get("content", "")))
    return max(1, sum(len(text.split()) for text in texts))
