"""The sans-I/O decision core, as tables of cases."""

from __future__ import annotations

import httpx
import httpx2
import pytest

from llama_guard._core.decisions import (
    FailureKind,
    Progress,
    classify_request,
    first_attempt_goes_as_is,
    is_inference_path,
    is_streaming_response,
    parse_retry_after,
    verdict_for_failure,
    verdict_for_status,
    wants_stream,
)
from llama_guard._core.request_machine import ProgressTracker


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"stream": true}', True),
        (b'{"messages": [], "stream":true, "n_predict": 3}', True),
        (b'{"stream": false}', False),
        (b'{"stream": "true"}', False),  # llama-server streams only for a JSON boolean
        (b'{"stream": 1}', False),
        (b'{"\\u0073tream": true}', True),  # an escaped key is still the key
        (b'{"prompt": "\\"stream\\": true"}', False),  # the words inside a string are not the key
        (b'{"options": {"stream": true}}', False),  # only the top level counts
        (b'[{"stream": true}]', False),
        (b'"stream"', False),
        (b"stream", False),
        (b"", False),
        (b"\xff\xfe not json stream", False),
        (b'{"stream": true', False),  # truncated JSON: llama-server rejects it, nothing to stream
        (b"[" * 100_000 + b'"stream"' + b"]" * 100_000, False),  # deep nesting must not crash
        (b'{"stream": false, "stream": true}', True),  # duplicate keys: the last wins, as in nlohmann::json
        (b'{"stream": true, "prompt": "\\\\ud800"}', True),  # a backslash, then the letters ud800
        (b'{"stream": true, "prompt": "\\ud800"}', False),  # a lone surrogate: llama-server refuses the body
        (b'{"stream": true, "prompt": "\\ud83d\\ude00"}', True),  # a surrogate pair
    ],
)
def test_wants_stream(body: bytes, expected: bool) -> None:
    """Stream detection reads the body as llama-server does."""
    assert wants_stream(body) is expected


def test_wants_stream_large_body_without_stream_is_not_parsed() -> None:
    """A large body with no 'stream' in it is answered by the byte check alone (and correctly)."""
    body = b'{"prompt": "' + b"x" * 5_000_000 + b'"}'
    assert wants_stream(body) is False


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v1/chat/completions", True),
        ("/v1/chat/completions/", True),
        ("/completion", True),
        ("/completions", True),
        ("/v1/embeddings", True),
        ("/tokenize", True),
        ("/infill", True),
        ("/llm/v1/chat/completions", True),  # behind a reverse-proxy prefix
        ("/V1/Chat/Completions", True),
        ("/slots/0", False),  # ?action=save writes files: a side effect
        ("/props", False),
        ("/lora-adapters", False),
        ("/health", False),
        ("/v1/chat/completionsx", False),
        ("/mycompletion", False),
    ],
)
def test_inference_paths(path: str, expected: bool) -> None:
    """Inference endpoints are recognised by path; state-changing ones are not."""
    assert is_inference_path(path) is expected


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"transfer-encoding": "chunked"}, True),
        ({"content-type": "text/event-stream; charset=utf-8"}, True),
        ({"content-type": "application/json", "content-length": "12"}, False),
        ({}, False),
    ],
)
def test_streaming_response(headers: dict[str, str], expected: bool) -> None:
    assert is_streaming_response(headers) is expected
    # The fast path over httpx's and httpx2's own header lists agrees, whatever the case of names and values.
    shouted = {name.upper(): value.upper() for name, value in headers.items()}
    assert is_streaming_response(httpx.Headers(shouted)) is expected
    assert is_streaming_response(httpx2.Headers(headers)) is expected


def test_classify_request() -> None:
    """Classification combines method, path and body."""
    kind = classify_request("post", "/v1/chat/completions", b'{"stream": true}')
    assert (kind.method, kind.idempotent, kind.inference, kind.stream, kind.replayable) == (
        "POST",
        False,
        True,
        True,
        True,
    )
    one_shot = classify_request("POST", "/v1/chat/completions", None)
    assert not one_shot.stream
    assert not one_shot.replayable
    assert not classify_request("GET", "/health", b'{"stream": true}').stream  # only POST bodies stream


def _tracker(*events: str) -> ProgressTracker:
    tracker = ProgressTracker()
    for event in events:
        tracker.observe(event)
    return tracker


NEW_CONN = ("connection.connect_tcp.started", "connection.connect_tcp.complete")
WRITE = ("http11.send_request_headers.started", "http11.send_request_headers.complete")
BODY = ("http11.send_request_body.started", "http11.send_request_body.complete")


@pytest.mark.parametrize(
    ("events", "progress", "reused", "new"),
    [
        ((), Progress.NOTHING, False, False),
        (("connection.connect_tcp.started",), Progress.NOTHING, False, True),
        (NEW_CONN, Progress.CONNECTED, False, True),
        ((*NEW_CONN, *WRITE), Progress.WRITING, False, True),
        ((*NEW_CONN, *WRITE, *BODY), Progress.WRITTEN, False, True),
        ((*WRITE, *BODY), Progress.WRITTEN, True, False),
        ((*WRITE, *BODY, "http11.receive_response_headers.started"), Progress.WRITTEN, True, False),
        ((*WRITE, *BODY, "http11.receive_response_headers.complete"), Progress.HEADERS, True, False),
        (("http2.send_request_headers.started",), Progress.WRITING, True, False),
    ],
)
def test_progress_tracker(events: tuple[str, ...], progress: Progress, reused: bool, new: bool) -> None:
    """Trace events place an attempt; no connect before the write means a pooled connection."""
    tracker = _tracker(*events)
    assert tracker.progress is progress
    assert tracker.reused_connection is reused
    assert tracker.new_connection is new


def test_progress_without_events_assumes_written() -> None:
    """A transport that emits no trace events gives no proof that nothing was sent."""
    assert ProgressTracker().effective_progress() is Progress.WRITTEN


CHAT = classify_request("POST", "/v1/chat/completions", b'{"stream": true}')
HEALTH = classify_request("GET", "/health", b"")
SAVE = classify_request("POST", "/slots/0", b'{"filename": "a.bin"}')
ONE_SHOT = classify_request("POST", "/v1/chat/completions", None)
K = FailureKind
P = Progress


@pytest.mark.parametrize(
    ("kind", "progress", "reused", "body_started", "request_kind", "non_idem", "retry"),
    [
        # nothing sent: always
        (K.CONNECT, P.NOTHING, False, False, SAVE, False, True),
        (K.PROBE, P.CONNECTED, False, False, SAVE, False, True),
        (K.NETWORK, P.CONNECTED, False, False, SAVE, False, True),
        (K.CONNECT, P.NOTHING, False, False, ONE_SHOT, False, True),
        # the keep-alive race: reused connection died before the response
        (K.NETWORK, P.WRITTEN, True, True, CHAT, False, True),
        (K.NETWORK, P.WRITTEN, True, True, HEALTH, False, True),
        (K.NETWORK, P.WRITTEN, True, True, SAVE, False, False),
        (K.NETWORK, P.WRITTEN, True, True, SAVE, True, True),
        (K.NETWORK, P.WRITING, True, True, ONE_SHOT, True, False),  # a generator body is never sent twice
        # a new connection failing after the write
        (K.NETWORK, P.WRITTEN, False, True, CHAT, False, True),
        (K.NETWORK, P.WRITTEN, False, True, SAVE, False, False),
        # the first-byte deadline
        (K.FIRST_BYTE_TIMEOUT, P.WRITTEN, False, True, CHAT, False, True),
        (K.FIRST_BYTE_TIMEOUT, P.WRITTEN, False, True, SAVE, False, False),
        # the caller's own limits and local errors: never
        (K.CALLER_TIMEOUT, P.WRITTEN, False, True, HEALTH, True, False),
        (K.CALLER_TIMEOUT, P.NOTHING, False, False, HEALTH, True, False),
        (K.LOCAL, P.NOTHING, False, False, HEALTH, True, False),
        # after the response began: never
        (K.NETWORK, P.HEADERS, True, True, HEALTH, True, False),
    ],
)
def test_verdict_for_failure(kind, progress, reused, body_started, request_kind, non_idem, retry) -> None:
    """Whether a failed attempt is retried depends on how far it got and what the request is."""
    verdict = verdict_for_failure(
        kind,
        progress=progress,
        reused_connection=reused,
        body_started=body_started,
        request=request_kind,
        retry_non_idempotent=non_idem,
    )
    assert verdict.retry is retry, verdict.reason
    assert verdict.reason


def test_dead_pooled_connection_is_retried_at_once() -> None:
    """The keep-alive race is the connection's fault, not the server's load: no backoff."""
    verdict = verdict_for_failure(
        K.NETWORK,
        progress=P.WRITTEN,
        reused_connection=True,
        body_started=True,
        request=CHAT,
        retry_non_idempotent=False,
    )
    assert verdict.retry
    assert not verdict.backoff


def test_stalled_connections_back_off() -> None:
    """Stalled connections reconnect with jittered backoff, so they do not form a new burst."""
    verdict = verdict_for_failure(
        K.FIRST_BYTE_TIMEOUT,
        progress=P.WRITTEN,
        reused_connection=False,
        body_started=True,
        request=CHAT,
        retry_non_idempotent=False,
    )
    assert verdict.retry
    assert verdict.backoff


@pytest.mark.parametrize(
    ("reused", "read", "stall"),
    [
        (False, False, True),  # a new connection nothing proved the server reads: may be the pool's stall
        (False, True, False),  # its probe was answered: a thread serves it, the server is busy or slow
        (True, True, False),  # a pooled connection, served before
    ],
)
def test_a_first_byte_timeout_is_a_stall_only_on_a_connection_the_server_may_not_read(
    reused: bool, read: bool, stall: bool
) -> None:
    """Defect 2 leaves a new connection unread; a connection whose probe was answered, or a reused one, has a
    thread: a first-byte timeout there is a slow answer (busy slots, a long prompt), retried but not logged and
    counted as a stalled connection replaced."""
    verdict = verdict_for_failure(
        K.FIRST_BYTE_TIMEOUT,
        progress=P.WRITTEN,
        reused_connection=reused,
        connection_read=read,
        body_started=True,
        request=CHAT,
        retry_non_idempotent=False,
    )
    assert verdict.retry
    assert verdict.stall is stall
    assert ("stalled connection" in verdict.reason) is stall, verdict.reason


@pytest.mark.parametrize(
    ("status", "headers", "request_kind", "retry", "delay"),
    [
        (200, {}, CHAT, None, None),
        (500, {}, CHAT, None, None),
        (503, {}, CHAT, True, None),
        (503, {"retry-after": "2"}, CHAT, True, 2.0),
        (503, {"retry-after": "3600"}, CHAT, False, None),  # longer than max_retry_after
        (503, {}, SAVE, False, None),
        (429, {}, CHAT, False, None),  # no Retry-After: no retry
        (429, {"retry-after": "1"}, CHAT, True, 1.0),
        (429, {"retry-after": "soon"}, CHAT, False, None),
        (503, {}, ONE_SHOT, False, None),
    ],
)
def test_verdict_for_status(status, headers, request_kind, retry, delay) -> None:
    """503 (loading) and 429 with Retry-After are retried for requests that may be sent twice."""
    verdict = verdict_for_status(
        status, headers, request=request_kind, retry_non_idempotent=False, max_retry_after=30.0
    )
    if retry is None:
        assert verdict is None
    else:
        assert verdict is not None
        assert verdict.retry is retry, verdict.reason
        if retry:
            assert verdict.delay == delay


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("5", 5.0),
        (" 0 ", 0.0),
        ("-1", None),
        ("1.5", None),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0),  # in the past: now
        ("Thu, 01 Jan 1970 00:01:40 GMT", 60.0),
        ("garbage", None),
    ],
)
def test_parse_retry_after(value: str | None, expected: float | None) -> None:
    assert parse_retry_after(value, now=40.0 if value and "1970" in value else None) == expected


def test_probe_deadlines() -> None:
    """A second stall gets the same short deadline; later ones double up to the cap."""
    from llama_guard._core.probes import probe_deadline

    assert [probe_deadline(n, first=0.5, cap=4.0) for n in range(6)] == [0.5, 0.5, 1.0, 2.0, 4.0, 4.0]


def test_a_tracker_fed_by_connection_hooks_assumes_the_worst_after_connecting() -> None:
    """Hooks see connects only: a failure on a connection that was up may have sent the request."""
    reused = ProgressTracker(hooked=True)
    assert reused.reused_connection
    assert reused.effective_progress() is Progress.WRITTEN
    connecting = ProgressTracker(hooked=True)
    connecting.connecting()
    assert not connecting.reused_connection
    assert connecting.effective_progress() is Progress.NOTHING  # connect or probe failed: nothing sent
    connecting.connected()
    assert connecting.effective_progress() is Progress.WRITTEN


@pytest.mark.parametrize(
    ("body", "overrides", "deadline", "hooks_follow", "as_is"),
    [
        (b"{}", False, False, True, True),  # the usual request: no per-request state
        (None, False, False, True, False),  # a one-shot body must be kept for a retry
        (b"{}", True, False, True, False),  # per-request options
        (b"{}", False, True, True, False),  # a first-byte deadline to arm
        (b"{}", False, False, False, False),  # the adapter cannot see the attempt's connection
        (b"", False, False, True, True),  # an empty body is a body
    ],
)
def test_first_attempt_goes_as_is(body, overrides, deadline, hooks_follow, as_is) -> None:
    """Connection: close is no reason for per-request state: it goes on a copy of the caller's headers."""
    assert (
        first_attempt_goes_as_is(body, has_overrides=overrides, adds_deadline=deadline, hooks_follow=hooks_follow)
        is as_is
    )
