"""``llama-guard doctor``: the verdict rules as tables, then the command against the emulator in its faulty and
fixed modes (verdicts, exit codes, JSON, report), and against bad input (one line, exit 2, no traceback)."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import re
import socket
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator

import pytest

from llama_guard._cli.doctor.checks import BURST_WINDOW, STREAM_CLOSE_WAIT
from llama_guard._cli.doctor.command import DoctorOptions, run_doctor
from llama_guard._cli.doctor.model import (
    AFFECTED,
    COULD_NOT_TELL,
    NOT_AFFECTED,
    REUSE_CLOSED,
    REUSE_RESET,
    BurstCheck,
    BurstRound,
    DoctorError,
    Identity,
    KeepAliveCheck,
    Target,
    base_candidates,
    parse_target,
    redact_url,
)
from llama_guard._cli.doctor.verdict import (
    LoadShape,
    client_finding,
    exit_code,
    load_evidence,
    nonstream_finding,
    pool_finding,
    stream_finding,
)
from llama_guard._cli.doctor.wire import shown_bytes
from llama_guard._cli.load import LoadRow
from llama_guard._cli.main import main
from llama_guard.testing import LlamaServerEmulator, free_port

# -- the rules, as tables --------------------------------------------------------------------------------------------

#: A doctor timeout that an answer "at once" must not wait out: the test then bounds its time by half of it.
SLOW_TIMEOUT = 30.0
KEEP = {"status": 200, "keep_alive_header": "timeout=5, max=100", "connection_header": None}


@pytest.mark.parametrize(
    ("check", "status", "phrase"),
    [
        pytest.param(
            KeepAliveCheck(True, chunked=True, after="eof", closed_after=0.00003, **KEEP),
            AFFECTED,
            "closed the connection within 0.1 ms after the last byte",
            id="keep-alive announced, closed at once: the defect",
        ),
        pytest.param(
            KeepAliveCheck(True, chunked=True, after="reset", closed_after=0.002, **KEEP),
            AFFECTED,
            "reset the connection 2.0 ms",
            id="a reset counts as a close",
        ),
        pytest.param(
            KeepAliveCheck(True, after="open", reuse="answered 200", **KEEP),
            NOT_AFFECTED,
            "second request on it was answered 200",
            id="kept and reused: fixed",
        ),
        pytest.param(
            KeepAliveCheck(True, after="open", reuse="GET /health failed: reset", **KEEP),
            AFFECTED,
            "a second request on it failed",
            id="kept a while, then lost the next request",
        ),
        pytest.param(
            KeepAliveCheck(True, after="open", reuse=REUSE_CLOSED, **KEEP),
            AFFECTED,
            "stayed open a while; then the server closed the connection without answering the second request on it",
            id="kept a while, then closed unanswered: said so, not in h11's words",
        ),
        pytest.param(
            KeepAliveCheck(True, after="open", reuse=REUSE_RESET, **KEEP),
            AFFECTED,
            "then the server reset the connection without answering the second request on it",
            id="kept a while, then reset unanswered",
        ),
        pytest.param(
            KeepAliveCheck(True, status=200, connection_header="close", after=None),
            NOT_AFFECTED,
            "'Connection: close'",
            id="an honest close",
        ),
        pytest.param(
            KeepAliveCheck(True, error="cannot connect to h:1: connection refused"),
            COULD_NOT_TELL,
            "connection refused",
            id="no answer",
        ),
        pytest.param(
            KeepAliveCheck(True, status=401, server_message="Invalid API Key"),
            COULD_NOT_TELL,
            "answered 401 (Invalid API Key)",
            id="an error answer",
        ),
        pytest.param(
            KeepAliveCheck(True, after="data", **KEEP),
            COULD_NOT_TELL,
            "belong to no request",
            id="stray bytes",
        ),
    ],
)
def test_stream_verdicts(check, status, phrase):
    finding = stream_finding(check, ("pooled load: ...",))
    assert finding.status == status
    assert phrase in finding.evidence[0]
    assert finding.evidence[-1] == "pooled load: ..."
    assert (finding.fix is not None) == (status == AFFECTED)
    if status == AFFECTED:
        assert "llama_guard.GuardTransport" in finding.fix


@pytest.mark.parametrize(
    ("check", "status"),
    [
        (KeepAliveCheck(False, after="open", reuse="answered 200", **KEEP), NOT_AFFECTED),
        (KeepAliveCheck(False, after="eof", closed_after=0.001, **KEEP), AFFECTED),
        (KeepAliveCheck(False, after="open", reuse="timed out", **KEEP), AFFECTED),
        (KeepAliveCheck(False, after="open", reuse=REUSE_CLOSED, **KEEP), AFFECTED),
        (KeepAliveCheck(False, status=200, connection_header="close"), NOT_AFFECTED),
        (KeepAliveCheck(False, error="timeout"), COULD_NOT_TELL),
    ],
)
def test_nonstream_verdicts(check, status):
    finding = nonstream_finding(check)
    assert finding.status == status
    if check.reuse == REUSE_CLOSED:
        assert finding.evidence[0].endswith(
            "then the server closed the connection without answering the second request on the same connection"
        )


def _identity(build):
    from llama_guard._core.llama_server import build_number

    return Identity("llama.cpp", build, build_number(build), "m", 4)


STALL = BurstRound((0.001, 0.002, None, None), window=3.0)
CLEAN = BurstRound((0.001, 0.002, 0.003, 0.004), window=3.0)
SILENT = BurstRound((None, None, None, None), window=3.0)


@pytest.mark.parametrize(
    ("build", "burst", "status", "phrase"),
    [
        ("b11434-abc", None, AFFECTED, "predates the thread-pool fix"),
        ("b11800-abc", None, NOT_AFFECTED, "includes the thread-pool fix"),
        ("b0-unknown", None, COULD_NOT_TELL, "--burst 32"),
        (None, None, COULD_NOT_TELL, "not reported"),
        ("b0-unknown", BurstCheck(4, (STALL,)), AFFECTED, "2 of 4 connections opened at once got no answer"),
        # A stall beats a build that predates the fix, or an unknown one. With the fix, a burst past the threads the
        # server can run stalls too: the answered connections may be its limit, and doctor cannot tell.
        ("b11434-abc", BurstCheck(4, (CLEAN, STALL)), AFFECTED, "2 of 4"),
        ("b11800-abc", BurstCheck(4, (CLEAN, STALL)), COULD_NOT_TELL, "more than the 2 it served at once"),
        ("b11800-abc", BurstCheck(4, (SILENT,)), AFFECTED, "4 of 4"),  # no connection served: not a thread limit
        # A clean burst does not rule a race out: the build decides, and an unknown one cannot.
        ("b11434-abc", BurstCheck(4, (CLEAN, CLEAN, CLEAN)), AFFECTED, "a clean burst does not rule it out"),
        ("b11800-abc", BurstCheck(4, (CLEAN, CLEAN, CLEAN)), NOT_AFFECTED, "all 4 connections of 3 burst(s)"),
        ("b0-unknown", BurstCheck(4, (CLEAN, CLEAN, CLEAN)), COULD_NOT_TELL, "assume it is affected"),
        ("b0-unknown", BurstCheck(4, (), error="refused"), COULD_NOT_TELL, "could not run: refused"),
        ("b11434-abc", BurstCheck(4, (), error="refused"), AFFECTED, "predates"),
        # b11434 patched with the fix (get_llama_server.py --fixed-pool): a clean burst clears it, a stall does not.
        ("b11434-fixedpool", BurstCheck(4, (CLEAN, CLEAN, CLEAN)), NOT_AFFECTED, "fix of b11737 applied"),
        ("b11434-fixedpool", None, NOT_AFFECTED, "fix of b11737 applied"),
        ("b11434-fixedpool", BurstCheck(4, (CLEAN, STALL)), COULD_NOT_TELL, "--burst below 2 to tell"),
        ("b11434-fixedpoolx", BurstCheck(4, (CLEAN, CLEAN, CLEAN)), AFFECTED, "predates"),
    ],
)
def test_pool_verdicts(build, burst, status, phrase):
    finding = pool_finding(_identity(build), burst)
    assert finding.status == status
    assert any(phrase in line for line in finding.evidence), finding.evidence
    if status == AFFECTED:
        assert "b11737" in finding.fix
        assert "--threads-http" in finding.fix


def test_exit_code_is_1_only_when_something_is_affected():
    healthy = stream_finding(KeepAliveCheck(True, after="open", reuse="answered 200", **KEEP))
    unknown = pool_finding(_identity("b0-unknown"), None)
    sick = stream_finding(KeepAliveCheck(True, after="eof", closed_after=0.0, **KEEP))
    assert exit_code([healthy]) == 0
    assert exit_code([healthy, unknown]) == 3  # not examined is not healthy
    assert exit_code([healthy, unknown, sick]) == 1


def test_load_evidence_tells_httpcores_own_race_from_the_server():
    plain = LoadRow("pooled load", "plain httpx")
    guard = LoadRow("pooled load", "guard")
    for _ in range(3):
        guard.record(0.01)
        plain.record(0.01)
    plain.record(None, "RemoteProtocolError: Server disconnected without sending a response")
    plain.record(None, "ReadError: [Errno 9] Bad file descriptor")
    (line,) = load_evidence(plain, guard, LoadShape(8, 4))
    assert "plain httpx lost 2 of 5 (40.0%): 1 ReadError: [Errno 9] Bad file descriptor, 1 RemoteProtocolError" in line
    assert "the guard lost 0 of 3 (0.0%)" in line
    assert "httpcore's own race" in line
    plain.error_kinds.pop("ReadError: [Errno 9] Bad file descriptor")
    assert "httpcore" not in load_evidence(plain, guard, LoadShape(8, 4))[0]
    assert load_evidence(None, guard, LoadShape(8, 4)) == ()


def _plain_row(*kinds: str, stuck: int = 0) -> LoadRow:
    row = LoadRow("pooled load", "plain httpx", stuck_after=1.5)
    for _ in range(10):
        row.record(0.01)
    for kind in kinds:
        row.record(None, kind)
    for _ in range(stuck):
        row.record_stuck()
    return row


def _guard_row() -> LoadRow:
    row = LoadRow("pooled load", "guard")
    for _ in range(10):
        row.record(0.01)
    return row


def test_a_client_that_lost_requests_is_exposed_even_on_a_healthy_server():
    """The server's defects absent, but plain httpx lost requests to httpcore's pool race and one stayed stuck:
    the unguarded-client finding is affected, names each cause, and the exit status is 1 (a client here is
    exposed), not 0."""
    healthy_server = [
        stream_finding(KeepAliveCheck(True, after="open", reuse="answered 200", **KEEP)),
        nonstream_finding(KeepAliveCheck(False, after="open", reuse="answered 200", **KEEP)),
        pool_finding(_identity("b11737"), None),
    ]
    assert exit_code(healthy_server) == 0
    plain = _plain_row("ReadError: [Errno 9] Bad file descriptor", stuck=1)
    client = client_finding(plain, _guard_row(), stream_close=False, shape=LoadShape(8, 4))
    assert client is not None
    assert client.status == AFFECTED
    assert exit_code([*healthy_server, client]) == 1
    text = " ".join(client.evidence)
    assert "plain httpx lost 1 and 1 stuck of 12 requests" in text
    assert "1 ReadError: [Errno 9] Bad file descriptor: not the server: httpcore's own race" in text
    assert "1 stuck: no answer within 1.5 s" in text
    assert "stream-close" not in text
    assert client.fix is not None
    assert "llama_guard" in client.fix


def test_client_losses_are_told_apart_by_cause():
    """Losses to a closed connection are the stream defect's when the server has it; error answers are the
    server's; a clean plain load is not affected; no load, no finding."""
    closed = "RemoteProtocolError: Server disconnected without sending a response"
    shape = LoadShape(8, 4)
    finding = client_finding(_plain_row(closed, "HTTP 503"), _guard_row(), stream_close=True, shape=shape)
    assert finding is not None
    text = " ".join(finding.evidence)
    assert f"1 {closed}: the server's stream-close defect" in text
    assert "1 HTTP 503: error answers of the server itself" in text
    assert "httpcore" not in text
    finding = client_finding(_plain_row(closed), _guard_row(), stream_close=False, shape=shape)
    assert finding is not None
    assert "the server closed a connection the client had kept" in " ".join(finding.evidence)
    clean = client_finding(_plain_row(), _guard_row(), stream_close=True, shape=shape)
    assert clean is not None
    assert clean.status == NOT_AFFECTED
    assert client_finding(None, None, stream_close=True, shape=shape) is None


@pytest.mark.parametrize(
    ("url", "target"),
    [
        ("http://127.0.0.1:8080", Target("127.0.0.1", 8080)),
        ("http://127.0.0.1:8080/", Target("127.0.0.1", 8080)),
        ("127.0.0.1:8080", Target("127.0.0.1", 8080)),
        ("http://llm.local/api/", Target("llm.local", 80, "/api")),
        ("http://[::1]:9000", Target("::1", 9000)),
    ],
)
def test_urls(url, target):
    assert parse_target(url) == target


@pytest.mark.parametrize(
    ("url", "phrase"),
    [
        ("https://127.0.0.1:8080", "only http:// is supported"),
        ("ftp://host", "unknown scheme 'ftp:'"),
        ("htp:/bad", "unknown scheme 'htp:' (did you mean 'http:'?)"),
        ("htp://127.0.0.1:8080", "unknown scheme 'htp:'"),
        ("http:/127.0.0.1:8080", "malformed, 'http:' must be followed by '//'"),
        ("://127.0.0.1", "malformed scheme"),
        ("http://127.0.0.1:99999", "Port out of range"),
        ("http://:8080", "no host"),
        ("http://127.0.0.1:8080/?x=1", "no query or fragment"),
        ("http://user:hunter2@127.0.0.1:8080", "'http://user:***@127.0.0.1:8080': no user or password allowed"),
        # urllib would quote the "port" it could not read: here the password's head.
        ("http://user:hun/ter2@127.0.0.1:8080", "'http://user:***@127.0.0.1:8080': no user or password allowed"),
        ("https://user:hunter2@example.com", "'https://user:***@example.com': only http://"),
        ("user:hunter2@127.0.0.1:8080", "'user:***@127.0.0.1:8080'"),
    ],
)
def test_bad_urls(url, phrase):
    with pytest.raises(DoctorError, match="expected http://HOST") as info:
        parse_target(url)
    assert phrase in str(info.value)
    assert "hun" not in str(info.value)


def test_a_password_in_the_url_is_never_printed():
    """Not in the one-line error, not in the --json error document: the userinfo's password shows as ``***``."""
    url = f"http://user:hunter2@127.0.0.1:{free_port()}"
    assert redact_url(url).startswith("http://user:***@127.0.0.1:")
    for as_json in (False, True):
        code, out, err = doctor(url, json=as_json)
        _one_line_error(code, err, "bad URL 'http://user:***@127.0.0.1:")
        assert "hunter2" not in out + err
        if as_json:
            document = json.loads(out)
            assert document["url"].startswith("http://user:***@")
            assert "user:***@" in document["error"]


# -- against the emulator ---------------------------------------------------------------------------------------


def doctor(url: str, *extra: str, **options) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    options.setdefault("timeout", 5.0)
    options.setdefault("requests", 60)
    code = run_doctor(DoctorOptions(url, **options), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def by_defect(document):
    return {item["defect"]: item for item in document["findings"]}


@pytest.mark.slow  # a full doctor run
def test_the_faulty_emulator_is_affected_by_both_defects():
    # A 20 ms delay before the close (llama-server closes at once) lets plain httpx reuse the dying connection
    # often enough on loopback for the load to show losses in a short run. The burst's stall is made deterministic
    # (stall_burst): 12 of its 16 connections wait, whatever the machine's load, in the first burst that finds the
    # server idle (doctor's pause between bursts outlasts the 5 s keep-alive of anything left from the load).
    with LlamaServerEmulator(stream_close_delay=0.02, stall_burst=16) as server:
        code, out, err = doctor(server.url, json=True, burst=16, timeout=3.0)
        document = json.loads(out)
        stalled = document["burst"]["rounds"][-1]["stalled"]
        assert stalled == 16 - server.config.http_threads
        # The server's side of the story: it closed after streams, and left the burst's connections unread
        # (counted when a thread picks them up at last, which is after doctor closed them).
        stats = server.wait_for(lambda s: s.connections_waited_unread(threshold=1.0) >= stalled > 0, timeout=10)
    findings = by_defect(document)
    assert code == 1
    assert document["exit_code"] == 1
    assert findings["stream-close"]["status"] == "affected"
    assert findings["nonstream-keepalive"]["status"] == "not_affected"
    assert findings["unread-first-request"]["status"] == "affected"
    assert document["server"]["build_info"] == "b11434-emulated"
    assert document["server"]["build_has_pool_defect"] is True
    stream = document["checks"]["stream"]
    assert (stream["status"], stream["after"], stream["chunked"]) == (200, "eof", True)
    assert stream["keep_alive_header"] == "timeout=5, max=100"
    # Measured from the last byte; the close came while doctor waited for it, not after (it would then say "open").
    assert 0.0 <= stream["closed_after"] < 2 * STREAM_CLOSE_WAIT
    assert document["checks"]["nonstream"]["reuse"] == "answered 200"
    load = document["load"]
    assert load["plain"]["requests"] == load["guard"]["requests"] == 60
    # The defect, seen by a pooled client: requests written to a connection the server was closing.
    assert any(kind.startswith("RemoteProtocolError: Server disconnected") for kind in load["plain"]["error_kinds"])
    assert load["guard"]["errors"] == 0, load  # and the fix
    assert len(document["burst"]["rounds"][-1]["first_bytes"]) == 16
    assert stats.streams_closed_after_done >= 1
    assert "[6/6] burst" in err  # progress on the terminal
    # The burst's wait is bounded and said: its window, then what the stalled round waits for.
    assert "a connection with no answer within 3 s counts as stalled" in err
    assert "still waiting for the first byte of an answer to GET /health on each of 16 connections" in err
    assert "of at most 3 s, the burst's window)" in err


# What plain httpx loses to httpcore's own pool race (threads sharing one client), whatever the server does: a
# socket closed under a reader ("Bad file descriptor"), or a read that then waits for nothing until its timeout.
POOL_RACE = {"ReadError: [Errno 9] Bad file descriptor", "ReadTimeout: timed out"}


@pytest.mark.slow  # a full doctor run
def test_the_fixed_emulator_is_not_affected():
    # The emulator of a fixed build: streams keep their connection, the pool starts the threads a burst needs, and
    # it reports a build from the fix on (by default it says b11434 whatever it models).
    with LlamaServerEmulator(close_after_stream=False, pool_bug=False, build="b11737-emulated") as server:
        code, out, _ = doctor(server.url, json=True, burst=16, timeout=3.0)
    document = json.loads(out)
    findings = by_defect(document)
    client = findings.pop("unguarded-client")
    assert {item["status"] for item in findings.values()} == {"not_affected"}  # the server's defects
    # Plain httpx may still lose a request to httpcore's own pool race (a thread race, not every run): then a
    # client here is exposed, doctor says why, and the exit status says so.
    plain = document["load"]["plain"]
    exposed = plain["errors"] + plain["stuck"] > 0
    assert client["status"] == ("affected" if exposed else "not_affected"), client
    assert code == (1 if exposed else 0), findings
    if exposed:
        assert any("httpcore's own race" in line or "stuck" in line for line in client["evidence"]), client
    assert document["checks"]["stream"]["after"] == "open"
    assert document["checks"]["stream"]["reuse"] == "answered 200"
    assert set(document["load"]["plain"]["error_kinds"]) <= POOL_RACE  # nothing of the server's doing
    assert document["load"]["guard"]["errors"] == 0
    assert all(item["stalled"] == 0 for item in document["burst"]["rounds"])
    assert len(document["burst"]["rounds"]) == 3  # a clean burst is repeated: the defect is a race
    assert any("all 16 connections of 3 burst(s)" in line for line in findings["unread-first-request"]["evidence"])


def test_a_client_that_loses_requests_is_named_with_its_cause_and_the_exit_status():
    """The emulator drops every request written to a stream's connection (``stream_close="on_reuse"``, fixed pool,
    a build with the pool fix): plain httpx loses requests in the pooled load, every time. doctor's verdict has
    the unguarded-client finding with the stream defect as cause, exit status 1, the page for clients that cannot
    import the guard, and the pooled load's figures in JSON; the stuck bound keeps the run short."""
    with LlamaServerEmulator(stream_close="on_reuse", pool_bug=False, build="b11737-emulated") as server:
        started = time.monotonic()
        code, out, err = doctor(server.url, requests=40)
        seconds = time.monotonic() - started
        json_code, json_out, _ = doctor(server.url, json=True, requests=40, quiet=True)
    assert code == json_code == 1
    text = " ".join(out.split())
    assert "AFFECTED an unguarded pooled client here loses requests" in text
    assert "the server's stream-close defect (above)" in text
    assert "docs/other-clients.md" in text
    assert "result: a client here is exposed: affected: stream-close, unguarded-client (exit status 1;" in text
    assert "counts as stuck" in err  # the bound is stated before the load
    document = json.loads(json_out)
    client = by_defect(document)["unguarded-client"]
    assert client["status"] == "affected"
    plain = document["load"]["plain"]
    assert plain["errors"] > 0
    assert plain["stuck_after"] is not None
    assert plain["stuck_after"] <= 5.0
    assert document["load"]["guard"]["errors"] == document["load"]["guard"]["stuck"] == 0
    assert seconds < 2 * 5.0  # nothing waited out for the --timeout (5 s here)


def test_a_stream_connection_closed_unanswered_is_said_in_plain_words():
    """The emulator keeps a stream's connection open, then closes it unanswered when the second request arrives
    (``--faulty``'s stream defect): the evidence says exactly that, not h11's words for it."""
    with LlamaServerEmulator(stream_close="on_reuse") as server:
        code, out, _ = doctor(server.url, json=True, requests=0)
    document = json.loads(out)
    assert code == 1
    assert document["checks"]["stream"]["reuse"] == REUSE_CLOSED
    (line,) = by_defect(document)["stream-close"]["evidence"]
    assert line.endswith(
        "the connection stayed open a while; then the server closed the connection without answering the second "
        "request on it"
    )
    assert "h11" not in out
    assert "ConnectionClosed" not in out


def test_a_burst_past_a_fixed_servers_threads_is_not_called_defect_2():
    """A fixed build that can run 8 HTTP threads, a burst of 16: 8 connections wait for a free thread. That is the
    server's limit, not defect 2: "could not tell", saying so and how to tell, not "affected" next to "includes
    the fix". The burst's window is cut to --timeout (1.5 s here), as every wait for the server is."""
    with LlamaServerEmulator(
        close_after_stream=False, pool_bug=False, build="b11737-emulated", max_http_threads=8
    ) as server:
        code, out, _ = doctor(server.url, json=True, requests=0, burst=16, timeout=1.5)
    document = json.loads(out)
    finding = by_defect(document)["unread-first-request"]
    (burst,) = document["burst"]["rounds"]
    assert burst["window"] == 1.5 < BURST_WINDOW
    # 8, or one more while a thread of an earlier check is still noticing that doctor closed its connection.
    served = 16 - burst["stalled"]
    assert 1 <= served <= 8, burst
    assert finding["status"] == "could_not_tell", finding
    assert code == 3
    text = " ".join(finding["evidence"])
    assert f"{16 - served} of 16 connections opened at once got no answer to GET /health within 1.5 s" in text
    assert "build b11737 includes the thread-pool fix" in text
    assert f"may be that limit (16 connections are more than the {served} it served at once), not defect 2" in text
    assert f"--burst below {served}" in text


@pytest.mark.slow  # a full doctor run
def test_a_clean_burst_does_not_clear_a_build_that_has_the_defect():
    """The fixed pool under the build string of an affected one: the clean bursts are reported, the build wins."""
    with LlamaServerEmulator(close_after_stream=False, pool_bug=False) as server:  # says b11434-emulated
        code, out, _ = doctor(server.url, json=True, requests=0, burst=8)
    finding = by_defect(json.loads(out))["unread-first-request"]
    assert code == 1
    assert finding["status"] == "affected"
    assert any("a clean burst does not rule it out" in line for line in finding["evidence"])


@pytest.mark.parametrize(
    ("build", "status", "code"),
    [("b11800-emulated", "not_affected", 0), ("b0-unknown", "could_not_tell", 3), ("b11434-x", "affected", 1)],
)
def test_without_a_burst_the_build_decides(build, status, code):
    with LlamaServerEmulator(close_after_stream=False, pool_bug=False, build=build) as server:
        result, out, _ = doctor(server.url, json=True, requests=0)
    document = json.loads(out)
    assert result == code
    assert by_defect(document)["unread-first-request"]["status"] == status
    assert document["load"] is None
    assert document["burst"] is None


@pytest.mark.slow  # a full doctor run with its burst
def test_text_output_names_verdicts_evidence_and_fix():
    with LlamaServerEmulator() as server:
        code, out, err = doctor(server.url, requests=20, max_tokens=2)
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == f"llama-guard doctor {server.url}"
    assert lines[1].startswith("server: llama.cpp, build b11434-emulated = b11434, model emulated-model.gguf")
    assert any(line.startswith("AFFECTED        streamed responses close") for line in lines)
    assert any(line.startswith("not affected    non-streamed responses") for line in lines)
    assert "fix: wrap your client with llama_guard" in out
    # The unguarded client's own losses are a race here (the emulator's timing-faithful close): maybe listed too.
    assert lines[-1].startswith("result: a client here is exposed: affected: stream-close, unread-first-request")
    assert "(exit status 1; checks took" in lines[-1]
    assert "docs/other-clients.md" in out  # for clients that cannot import the guard
    assert err.splitlines()[0].startswith("[1/5] identity")


def test_the_api_key_is_sent_and_never_shown():
    with LlamaServerEmulator() as server:
        code, out, err = doctor(server.url, json=True, requests=4, api_key="sk-secret-123")
    assert code == 1
    assert "sk-secret-123" not in out + err


@pytest.mark.slow  # a full doctor run
def test_html_report(tmp_path):
    report = tmp_path / "doctor.html"
    with LlamaServerEmulator(stream_close_delay=0.02) as server:
        code, _, err = doctor(server.url, burst=16, report=report, timeout=3.0)
    assert code == 1
    assert f"report written to {report}" in err
    text = report.read_text("utf-8")
    assert text.startswith("<!DOCTYPE html>")
    assert text.count("<svg") == 2  # the burst and the load
    assert "affected" in text
    assert "Burst: 16 connections opened at once" in text
    svgs = [text[start : text.index("</svg>", start) + 6] for start in _all(text, "<svg")]
    for svg in svgs:
        ET.fromstring(svg)  # well-formed
    # every connection of the burst has a mark: a dot (answered) or a cross (no answer)
    burst_svg = svgs[0]
    assert burst_svg.count("<circle") - 1 + burst_svg.count("<path") >= 16  # minus the legend dot


def _all(text: str, needle: str) -> list[int]:
    found, start = [], text.find(needle)
    while start >= 0:
        found.append(start)
        start = text.find(needle, start + 1)
    return found


@pytest.mark.slow  # a full doctor run and matplotlib
def test_png_report(tmp_path):
    pytest.importorskip("matplotlib")
    report = tmp_path / "doctor.png"
    with LlamaServerEmulator() as server:
        code, _, _ = doctor(server.url, requests=10, burst=16, report=report)
    assert code == 1
    assert report.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


# -- bad input: one line, exit 2 ------------------------------------------------------------------------------------


class _NotLlama(http.server.BaseHTTPRequestHandler):
    """An ordinary web server: 404 for everything."""

    def do_GET(self) -> None:
        self.send_error(404)

    def log_message(self, *args: object) -> None:
        pass


class _LockedLlama(_NotLlama):
    """A llama-server with --api-key: /health is public, /props is not."""

    def do_GET(self) -> None:
        body = b'{"status":"ok"}' if self.path == "/health" else b'{"error":{"message":"Invalid API Key"}}'
        self.send_response(200 if self.path == "/health" else 401)
        self.send_header("Server", "llama.cpp")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def web_server(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """Accepts connections (the kernel does, from its backlog) and never reads or answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def _one_line_error(code: int, err: str, phrase: str) -> None:
    """Exit 2 and one line that says what was wrong, after the progress lines (``[1/5] ...``, and indented ones
    under them) if any."""
    assert code == 2
    *progress, last = err.splitlines()
    assert all(line.startswith(("[", "      ")) for line in progress), err
    assert last.startswith("llama-guard doctor: ")
    assert phrase in last, err
    assert "Traceback" not in err


def test_unreachable_port():
    started = time.monotonic()
    code, out, err = doctor(f"http://127.0.0.1:{free_port()}", timeout=SLOW_TIMEOUT)
    _one_line_error(code, err, "connection refused")
    assert out == ""
    assert time.monotonic() - started < SLOW_TIMEOUT / 2  # reported at once, not after waiting out the timeout


def test_not_a_llama_server():
    with web_server(_NotLlama) as url:
        code, _, err = doctor(url)
    _one_line_error(code, err, "found no llama-server behind")
    assert "GET /health answered 404, GET /props answered 404" in err


def test_a_server_that_never_answers_times_out():
    started = time.monotonic()
    with silent_server() as url:
        code, _, err = doctor(url, timeout=1.0)
    _one_line_error(code, err, "accepted the connection but sent no complete answer to GET /health within 1 s")
    # A generous multiple of its 1 s timeout: without the timeout, the silent server would keep it for ever.
    assert time.monotonic() - started < 10


def test_a_long_wait_says_what_it_waits_for_every_2_s():
    """A server that accepts and never answers: doctor does not sit silent until --timeout, it says every 2 s on
    stderr what it waits for and up to how long; -q keeps that quiet too."""
    with silent_server() as url:
        code, _, err = doctor(url, timeout=4.0)
        _, _, quiet_err = doctor(url, timeout=2.5, quiet=True)
    _one_line_error(code, err, "accepted the connection but sent no complete answer to GET /health within 4 s")
    waits = [line.strip() for line in err.splitlines() if "still waiting" in line]
    assert waits, err
    assert re.fullmatch(r"still waiting for an answer to GET /health \(\d s of at most 4 s, --timeout\)", waits[0])
    assert "still waiting" not in quiet_err
    assert len(quiet_err.splitlines()) == 1  # -q: the error line alone


@contextlib.contextmanager
def raw_server(answer: bytes) -> Iterator[str]:
    """Answers every connection's first bytes with ``answer`` at once and keeps the connection open, as a server of
    another protocol (Redis) does: no HTTP, no close."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    stop = threading.Event()
    accepted: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            accepted.append(conn)
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                conn.recv(4096)
                conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
        for conn in accepted:
            conn.close()


def test_an_answer_that_is_not_http_is_named_at_once():
    """A Redis-like server answers "-ERR ..." at once and keeps the connection: doctor says it answered, not in
    HTTP, shows the first bytes escaped, and does not wait out --timeout for an HTTP answer that cannot come."""
    started = time.monotonic()
    with raw_server(b"-ERR unknown command 'GET'\x1b[0m\r\n") as url:
        code, _, err = doctor(url, timeout=SLOW_TIMEOUT)
    _one_line_error(code, err, "answered GET /health, but not in HTTP: \"-ERR unknown command 'GET'\\x1b[0m\\r\\n\"")
    assert "accepted the connection but sent no complete answer" not in err
    assert "\x1b" not in err  # the escape byte is shown escaped, never written to the terminal
    assert time.monotonic() - started < SLOW_TIMEOUT / 2


def test_bytes_are_shown_escaped_and_cut():
    assert shown_bytes(b"-ERR x\r\n") == '"-ERR x\\r\\n"'
    assert shown_bytes(b'\x15\x03\x01"\\') == '"\\x15\\x03\\x01\\"\\\\"'
    assert shown_bytes(b"a" * 100, limit=10) == '"aaaaaaaaaa"...'


def test_a_server_that_wants_an_api_key():
    with web_server(_LockedLlama) as url:
        code, _, err = doctor(url)
    _one_line_error(code, err, "wants an API key (GET /props answered 401); pass --api-key")


class _KeyedLlama(_NotLlama):
    """A llama-server started with --api-key sekrit: /health is public, /props wants that key."""

    def do_GET(self) -> None:
        keyed = self.headers.get("Authorization") == "Bearer sekrit"
        ok = self.path == "/health" or keyed
        body = b'{"status":"ok"}' if ok else b'{"error":{"message":"Invalid API Key"}}'
        self.send_response(200 if ok else 401)
        self.send_header("Server", "llama.cpp")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_wrong_api_key_is_reported_as_rejected_not_missing(monkeypatch):
    """A key was given and the server refused it: doctor says the key given was rejected, and where it came from
    (--api-key or LLAMA_API_KEY); never that a key is missing, never the key itself."""
    monkeypatch.delenv("LLAMA_API_KEY", raising=False)
    with web_server(_KeyedLlama) as url:
        code, _, err = doctor(url, api_key="wrong-key-0042")
        monkeypatch.setenv("LLAMA_API_KEY", "wrong-key-0043")
        env_code, _, env_err = doctor(url)
    _one_line_error(code, err, "rejected the API key given with --api-key (GET /props answered 401: Invalid API Key)")
    _one_line_error(env_code, env_err, "rejected the API key given with LLAMA_API_KEY (GET /props answered 401")
    for text in (err, env_err):
        assert "wants an API key" not in text
        assert "wrong-key-004" not in text


def test_a_loading_server():
    with LlamaServerEmulator(loading=True) as server:
        code, _, err = doctor(server.url)
    _one_line_error(code, err, "is not ready (GET /health answered 503: Loading model)")


def test_a_burst_too_large_is_a_clear_error_at_once():
    """--burst past 4096 (through the API; the command line refuses it while parsing): one line naming the option
    and what it accepts, before any check; not "unexpected error ValueError ... (please report this)"."""
    code, out, err = doctor(f"http://127.0.0.1:{free_port()}", burst=100000, json=True)
    _one_line_error(code, err, "--burst 100000: expected a whole number from 0 (off) to 4,096")
    assert "unexpected error" not in err
    assert err.splitlines() == [err.strip()]  # before any check: no progress line
    assert json.loads(out)["exit_code"] == 2


def test_errors_are_json_too_with_json():
    code, out, err = doctor(f"http://127.0.0.1:{free_port()}", json=True)
    _one_line_error(code, err, "connection refused")
    document = json.loads(out)
    assert document["exit_code"] == 2
    assert "connection refused" in document["error"]


@pytest.mark.parametrize(
    ("report", "phrase"),
    [("report.txt", "must end in .html or .png"), ("missing/report.html", "does not exist")],
)
def test_bad_report_paths_fail_before_any_check(tmp_path, report, phrase):
    # The URL is unreachable: the report's problem must be found first, without trying the server.
    code, _, err = doctor(f"http://127.0.0.1:{free_port()}", report=tmp_path / report)
    _one_line_error(code, err, phrase)


@pytest.mark.slow  # an interpreter per bad input
def test_python_m_llama_guard_doctor_has_no_traceback_on_bad_input():
    for argv in (
        [f"http://127.0.0.1:{free_port()}"],
        ["https://example.invalid"],
        ["http://127.0.0.1:1", "--report", "/nonexistent-folder/r.html"],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "llama_guard", "doctor", *argv],
            capture_output=True,
            text=True,
            timeout=30,
        )
        _one_line_error(result.returncode, result.stderr, "")
        assert result.stdout == ""


def test_png_without_matplotlib_says_how_to_get_it(tmp_path):
    # matplotlib absent, as on an install without it: None in sys.modules makes the import machinery say so.
    script = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from llama_guard._cli.main import main\n"
        f"sys.exit(main(['doctor', 'http://127.0.0.1:1', '--report', {str(tmp_path / 'r.png')!r}]))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "needs matplotlib (pip install matplotlib)" in result.stderr
    assert "Traceback" not in result.stderr


def test_doctor_command_line(capsys):
    with LlamaServerEmulator(close_after_stream=False, pool_bug=False, build="b11800-x") as server:
        code = main(["doctor", server.url, "--requests", "0", "--json", "--quiet", "--timeout", "5"])
    captured = capsys.readouterr()
    assert code == 0
    assert captured.err == ""  # --quiet: no progress
    assert json.loads(captured.out)["exit_code"] == 0


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/", "/wrong/path"])
def test_the_server_is_found_behind_a_base_url(suffix):
    """Given the base URL a client uses (``/v1``), a trailing slash or a wrong path, doctor looks under each
    shorter path down to the root, finds the server there, says so, and gives the bare URL's verdicts."""
    with LlamaServerEmulator(stall_burst=16) as server:
        bare_code, bare_out, _ = doctor(server.url, json=True, requests=10)
        code, out, err = doctor(server.url + suffix, json=True, requests=10)
    document, bare = json.loads(out), json.loads(bare_out)
    assert code == bare_code == 1
    assert document["url"] == server.url
    assert document["given_url"] == (None if suffix == "/" else server.url + suffix.rstrip("/"))
    statuses = {key: item["status"] for key, item in by_defect(document).items() if key != "unguarded-client"}
    # The server's verdicts are the bare URL's (the unguarded client's losses here are a race: not compared).
    assert statuses == {key: item["status"] for key, item in by_defect(bare).items() if key != "unguarded-client"}
    assert statuses["stream-close"] == "affected"
    assert "HTTP 404" not in document["load"]["plain"]["error_kinds"]
    if suffix != "/":
        assert f"found llama-server at {server.url} (the URL given was {server.url}{suffix.rstrip('/')})" in err


@pytest.mark.parametrize(
    ("prefix", "candidates"),
    [("", [""]), ("/v1", ["/v1", ""]), ("/a/b/v1", ["/a/b/v1", "/a/b", "/a", ""])],
)
def test_base_candidates_walk_down_to_the_root(prefix, candidates):
    assert [item.prefix for item in base_candidates(Target("h", 1, prefix))] == candidates


class _IdentityOnly(_NotLlama):
    """Answers /health and /props as llama-server does, and 404 to every completion: nothing can be examined."""

    def do_GET(self) -> None:
        if self.path not in ("/health", "/props"):
            self.send_error(404)
            return
        body = b'{"status":"ok"}' if self.path == "/health" else b'{"build_info":"b11800-x","total_slots":1}'
        self.send_response(200)
        self.send_header("Server", "llama.cpp")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.send_error(404)


def test_checks_that_got_no_valid_answer_never_give_exit_0():
    """Every completion 404s: both keep-alive verdicts are "could not tell", the load (lost 100% by both
    clients to 404s) is called no evidence, and the exit status is 3, not 0."""
    with web_server(_IdentityOnly) as url:
        code, out, _ = doctor(url, requests=10)
    assert code == 3, out
    assert "could not tell  streamed responses close" in out
    assert "could not tell  non-streamed responses" in out
    text = " ".join(out.split())  # the evidence is wrapped
    assert "no request of plain httpx's load" in text
    assert "was answered 200, so it shows nothing" in text
    assert "result: could not tell: stream-close, nonstream-keepalive, unguarded-client" in text
