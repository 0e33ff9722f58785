"""The core's state machines as tables: (state, event) -> action, for one request's life (`RequestMachine`) and one
new connection's (`ConnectionMachine`), with the counters after. Every pair a machine can meet has a row (checked
against its transition table), and every other pair fails loudly. No socket, no event loop: the machines are driven
by hand, on a clock of the test's."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from llama_guard import GuardPolicy
from llama_guard._core import connection_machine as connection
from llama_guard._core import request_machine as request
from llama_guard._core.decisions import FailureKind, Verdict
from llama_guard._core.probes import PROBE_SLICE, Admission
from llama_guard._core.retry_pacing import RetryPacing

from ._machines import Clock, NoTurn, answered, machine_for, plan_for, probing

OK = b'HTTP/1.1 200 OK\r\nContent-Length: 15\r\nKeep-Alive: timeout=5\r\n\r\n{"status":"ok"}'
OK_CLOSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
LOADING_CLOSE = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
SHORT_ERROR = httpx.Headers({"content-length": "2"})

REUSE = GuardPolicy(connection="reuse", probe_kick=False, probe_timeout=0.5, probe_timeout_max=0.5, backoff=0.01)
KICKS = GuardPolicy(connection="reuse", probe_kick=True, probe_timeout=0.5, probe_timeout_max=0.5)
DEADLINE = GuardPolicy(connection="reuse", first_byte_timeout=2.0)
CLOSE = GuardPolicy(connection="close")
ADMITTING = GuardPolicy(connection="reuse", connect_admission="always")
ONE_ATTEMPT = GuardPolicy(connection="reuse", max_attempts=1, max_loading_wait=0)
DROP = GuardPolicy(connection="reuse", stream_mode="drop")


# -- one request's life ---------------------------------------------------------------------------------------------

RS = request.RequestState


def request_in(state: request.RequestState, policy: GuardPolicy = REUSE) -> request.RequestMachine:
    """A request's machine brought to ``state`` by the events a driver would report."""
    machine = plan_for(policy).start()
    if state is RS.READY:
        return machine
    if state is RS.DONE:
        machine.next(request.BEGIN)
        machine.next(request.Answered(200, httpx.Headers(), False))
        machine.next(request.Delivered(False))
        return machine
    machine.next(request.BEGIN)
    if state is RS.READING_ERROR:
        machine.next(request.Answered(503, SHORT_ERROR, False))
    elif state is RS.WAITING:
        machine.next(request.Failed(FailureKind.CONNECT, "ConnectError"))
    elif state is RS.DELIVERING:
        machine.next(request.Answered(200, httpx.Headers(), False))
    assert machine.state is state
    return machine


def event_key(event: Any) -> Any:
    """What the machines' tables are keyed by: a signal itself, or an event's class."""
    return event if isinstance(event, enum.Enum) else type(event)


def key_name(key: type | enum.Enum) -> str:
    """What the machines call an event in their errors: a signal's name, or an event class's."""
    return key.name if isinstance(key, enum.Enum) else key.__name__


def is_(expected: type | enum.Enum, **fields: Any) -> Callable[[Any], bool]:
    """The action is ``expected`` (a signal-like step), or of its class with these ``fields``."""
    if isinstance(expected, enum.Enum):
        return lambda action: action is expected
    return lambda action: isinstance(action, expected) and all(getattr(action, k) == v for k, v in fields.items())


def sleeping(action: Any) -> bool:
    return isinstance(action, request.Sleep) and 0 <= action.seconds <= REUSE.backoff_max


# (name, policy, state to start in, event, what the action must be, the state after, the machine's counts after)
REQUEST_ROWS: list[tuple[str, GuardPolicy, RS, Any, Callable[[Any], bool], RS, dict[str, Any]]] = [
    ("begin", REUSE, RS.READY, request.BEGIN, is_(request.Send, attempt=1, close_connection=False), RS.SENDING, {}),
    (
        "begin-with-deadline",
        DEADLINE,
        RS.READY,
        request.BEGIN,
        is_(request.Send, first_byte_deadline=2.0),
        RS.SENDING,
        {"deadline_applied": True},
    ),
    ("begin-close", CLOSE, RS.READY, request.BEGIN, is_(request.Send, close_connection=True), RS.SENDING, {}),
    ("cancelled-before", REUSE, RS.READY, request.CANCELLED, is_(request.RERAISE), RS.DONE, {"attempts": 0}),
    (
        "answered",
        REUSE,
        RS.SENDING,
        request.Answered(200, httpx.Headers(), False),
        is_(request.Deliver, drop_stream=False),
        RS.DELIVERING,
        {"attempts": 1},
    ),
    (
        # A stream answered to a request that did not ask for one (this table's plan): not llama-server's stream
        # close, and its connection is kept (test_a_streams_connection_is_dropped_where_the_request_asked_for_it).
        "answered-stream-unasked",
        REUSE,
        RS.SENDING,
        request.Answered(200, httpx.Headers(), True),
        is_(request.Deliver, drop_stream=False),
        RS.DELIVERING,
        {},
    ),
    (
        "answered-stream-closed-by-header",
        CLOSE,
        RS.SENDING,
        request.Answered(200, httpx.Headers(), True),
        is_(request.Deliver, drop_stream=False),
        RS.DELIVERING,
        {},
    ),
    (
        "answered-503",
        REUSE,
        RS.SENDING,
        request.Answered(503, SHORT_ERROR, False),
        is_(request.READ_ERROR_BODY),
        RS.READING_ERROR,
        {},
    ),
    (
        "answered-503-long-body",
        REUSE,
        RS.SENDING,
        request.Answered(503, httpx.Headers({"content-length": "999999"}), False),
        is_(request.Deliver, drop_stream=False),
        RS.DELIVERING,
        {},
    ),
    (
        "answered-429-no-retry-after",
        REUSE,
        RS.SENDING,
        request.Answered(429, SHORT_ERROR, False),
        is_(request.Deliver),
        RS.DELIVERING,
        {},
    ),
    (
        "failed-nothing-sent",
        REUSE,
        RS.SENDING,
        request.Failed(FailureKind.CONNECT, "ConnectError"),
        sleeping,
        RS.WAITING,
        {"reconnects": 0},
    ),
    (
        "failed-probe",
        REUSE,
        RS.SENDING,
        request.Failed(FailureKind.PROBE, "ProbeTimeout"),
        sleeping,
        RS.WAITING,
        {"reconnects": 1},
    ),
    (
        "failed-last-attempt",
        ONE_ATTEMPT,
        RS.SENDING,
        request.Failed(FailureKind.CONNECT, "ConnectError"),
        lambda a: isinstance(a, request.Fail) and "max_attempts=1 reached" in a.message and a.attempts == 1,
        RS.DONE,
        {},
    ),
    (
        "failed-caller-timeout",
        REUSE,
        RS.SENDING,
        request.Failed(FailureKind.CALLER_TIMEOUT, "PoolTimeout"),
        lambda a: isinstance(a, request.Fail) and "not retried: the caller's own timeout expired" in a.message,
        RS.DONE,
        {},
    ),
    ("failed-not-network", REUSE, RS.SENDING, request.Failed(None), is_(request.RERAISE), RS.DONE, {}),
    ("cancelled-sending", REUSE, RS.SENDING, request.CANCELLED, is_(request.RERAISE), RS.DONE, {}),
    ("error-body-read", REUSE, RS.READING_ERROR, request.ERROR_BODY_READ, sleeping, RS.WAITING, {}),
    (
        "error-body-read-last",
        ONE_ATTEMPT,
        RS.READING_ERROR,
        request.ERROR_BODY_READ,
        is_(request.Deliver, drop_stream=False),
        RS.DELIVERING,
        {},
    ),
    ("error-body-failed", REUSE, RS.READING_ERROR, request.Failed(None), sleeping, RS.WAITING, {}),
    ("error-body-cancelled", REUSE, RS.READING_ERROR, request.CANCELLED, is_(request.RERAISE), RS.DONE, {}),
    ("slept", REUSE, RS.WAITING, request.SLEPT, is_(request.Send, attempt=2), RS.SENDING, {"attempts": 2}),
    ("cancelled-waiting", REUSE, RS.WAITING, request.CANCELLED, is_(request.RERAISE), RS.DONE, {}),
    (
        "delivered",
        REUSE,
        RS.DELIVERING,
        request.Delivered(True),
        lambda a: isinstance(a, request.Done) and a.result.attempts == 1 and a.result.connection_closed,
        RS.DONE,
        {},
    ),
    ("cancelled-delivering", REUSE, RS.DELIVERING, request.CANCELLED, is_(request.RERAISE), RS.DONE, {}),
]


def test_every_pair_the_request_machine_can_meet_has_a_row() -> None:
    assert {(row[2], event_key(row[3])) for row in REQUEST_ROWS} == set(request._TRANSITIONS)


@pytest.mark.parametrize(
    ("policy", "state", "event", "check", "after", "counts"), [pytest.param(*r[1:], id=r[0]) for r in REQUEST_ROWS]
)
def test_request_transitions(
    policy: GuardPolicy,
    state: RS,
    event: Any,
    check: Callable[[Any], bool],
    after: RS,
    counts: dict[str, Any],
) -> None:
    machine = request_in(state, policy)
    action = machine.next(event)
    assert check(action), action
    assert machine.state is after
    assert {name: getattr(machine, name) for name in counts} == counts


@pytest.mark.parametrize(
    ("policy", "body", "asks", "dropped"),
    [
        (DROP, b'{"stream": true}', True, True),  # the request asked: llama-server closes after the final chunk
        (DROP, b"{}", False, False),  # it did not: a chunked answer is not llama-server's stream
        (DROP, None, False, True),  # a one-shot body could not be read: the answer decides
        (REUSE, b'{"stream": true}', True, False),  # stream_mode="close": closed by the header already
        (GuardPolicy(connection="reuse", stream_mode="off"), b'{"stream": true}', True, False),
        (CLOSE, b'{"stream": true}', True, False),  # the close strategy: closed by the header
    ],
)
def test_a_streams_connection_is_dropped_where_the_request_asked_for_it(
    policy: GuardPolicy, body: bytes | None, asks: bool, dropped: bool
) -> None:
    """A streamed answer's connection is dropped after the final chunk when the request asked for a stream (or its
    body could not be read), under the keep-alive strategy with ``stream_mode="drop"``; the plan says so up front
    (``drops_streams``), for the drivers' first attempts, and the machine's delivery agrees."""
    plan = plan_for(policy, body=body, stream=asks)
    assert plan.drops_streams is dropped
    machine = plan.start()
    machine.next(request.BEGIN)
    action = machine.next(request.Answered(200, httpx.Headers(), True))
    assert action == request.Deliver(drop_stream=dropped)


REQUEST_EVENTS: dict[type | request.RequestSignal, Any] = {
    **{signal: signal for signal in request.RequestSignal},
    request.Answered: request.Answered(200, httpx.Headers(), False),
    request.Failed: request.Failed(None),
    request.Delivered: request.Delivered(False),
}


@pytest.mark.parametrize(
    ("state", "event"),
    [
        pytest.param(state, event, id=f"{state.value}-{key_name(event)}")
        for state, event in itertools.product(RS, REQUEST_EVENTS)
        if (state, event) not in request._TRANSITIONS
    ],
)
def test_a_pair_the_request_machine_cannot_meet_fails_loudly(state: RS, event: Any) -> None:
    machine = request_in(state)
    with pytest.raises(request.UnexpectedEvent, match=f"state {state.value} cannot take {key_name(event)}"):
        machine.next(REQUEST_EVENTS[event])


def test_a_first_attempt_sent_as_it_is_carries_on_in_its_machine() -> None:
    """A machine made during a first attempt that went out without one begins there: one attempt counted."""
    plan = plan_for(REUSE)
    assert plan.as_is
    machine = plan.machine()
    assert (machine.state, machine.attempts) == (RS.SENDING, 1)
    assert plan.machine() is machine


NOW = {"retry-after": "0"}
LATER = {"retry-after": "2"}


@pytest.mark.parametrize(
    ("policy", "outcomes", "delays"),
    [
        pytest.param(REUSE, [(200, {})], [], id="answered"),
        pytest.param(GuardPolicy(max_attempts=3), [(429, {"retry-after": "1"})] * 3, [1.0, 1.0], id="429-then-stop"),
        pytest.param(GuardPolicy(max_attempts=3), [(429, {"retry-after": "2"}), (200, {})], [2.0], id="429-then-ok"),
        pytest.param(REUSE, [(404, {})], [], id="not-retried-status"),
        # A 503 that keeps saying "now": the first retry at once, the next ones at most every STATUS_BACKOFF (0.5 s).
        pytest.param(GuardPolicy(), [*[(503, NOW)] * 3, (200, {})], [0.0, 0.5, 0.5], id="503-now-floored"),
        pytest.param(GuardPolicy(), [(503, LATER), (503, LATER), (200, {})], [2.0, 2.0], id="503-later-as-said"),
        pytest.param(GuardPolicy(), [(503, NOW), (200, {})], [0.0], id="503-once-at-once"),
        pytest.param(GuardPolicy(max_attempts=4), [(429, NOW)] * 4, [0.0] * 3, id="429-not-loading"),
        pytest.param(GuardPolicy(max_attempts=2), [FailureKind.CONNECT] * 2, ["backoff"], id="connect-errors"),
        pytest.param(GuardPolicy(max_attempts=1), [FailureKind.CONNECT], [], id="one-attempt-allowed"),
    ],
)
def test_retry_delays(policy: GuardPolicy, outcomes: list[Any], delays: list[Any]) -> None:
    """The wait after each judged attempt while the rules allow another, then the end (a response or the error)."""
    machine = plan_for(policy).start()
    action = machine.next(request.BEGIN)
    seen: list[Any] = []
    for outcome in outcomes:
        assert isinstance(action, request.Send)
        if isinstance(outcome, FailureKind):
            action = machine.next(request.Failed(outcome, "ConnectError"))
        else:
            status, headers = outcome
            action = machine.next(request.Answered(status, httpx.Headers({"content-length": "2", **headers}), False))
            if action is request.READ_ERROR_BODY:
                action = machine.next(request.ERROR_BODY_READ)
        if not isinstance(action, request.Sleep):
            break
        delay = action.seconds
        seen.append(
            "backoff" if delays and delays[len(seen)] == "backoff" and 0 <= delay <= policy.backoff_max else delay
        )
        action = machine.next(request.SLEPT)
    assert seen == delays
    assert isinstance(action, (request.Deliver, request.Fail))


def test_a_loading_server_is_waited_for_without_spending_attempts() -> None:
    """503 "Loading model" without Retry-After: each loading answer costs no attempt; max_loading_wait bounds it."""
    machine = plan_for(GuardPolicy(max_attempts=2, max_loading_wait=60)).start()
    action = machine.next(request.BEGIN)
    for _ in range(5):
        assert machine.next(request.Answered(503, SHORT_ERROR, False)) is request.READ_ERROR_BODY
        assert isinstance(machine.next(request.ERROR_BODY_READ), request.Sleep)
        action = machine.next(request.SLEPT)
    assert isinstance(action, request.Send)
    assert (machine.attempts, machine.pacing.loading_attempts) == (6, 5)
    machine.pacing.loading_since = 0.0  # the server has been loading longer than max_loading_wait
    machine.next(request.Answered(503, SHORT_ERROR, False))
    assert isinstance(machine.next(request.ERROR_BODY_READ), request.Deliver)


def paced(steps: list[tuple[float, Verdict]]) -> list[tuple[float, float | None]]:
    """(now, wait) after each (now, verdict) of one request, max_loading_wait=1.2 and no backoff: the clock is given,
    not read (no sleeping); None is the end (the caller gets the 503)."""
    pacing = RetryPacing(GuardPolicy(max_loading_wait=1.2, backoff_max=0.0), 0.0)
    seen: list[tuple[float, float | None]] = []
    for attempts, (now, verdict) in enumerate(steps, start=1):
        pacing.follow(verdict, now)
        wait = pacing.next_delay(verdict, attempts=attempts, probe_deadline=1.0, now=now)
        seen.append((now, None if wait is None else round(wait, 9)))
    return seen


LOADING = Verdict(True, "server loading a model", status=True, loading=True)
LOADING_NOW = Verdict(True, "server loading a model", delay=0.0, status=True, loading=True)
LOADING_LATER = Verdict(True, "server loading a model", delay=0.8, status=True, loading=True)


@pytest.mark.parametrize(
    ("verdict", "waits"),
    [
        # backoff_max=0 (no backoff): at once, then every 0.5 s; the last wait cut to what is left of the 1.2 s.
        pytest.param(LOADING, [(0.0, 0.0), (0.0, 0.5), (0.5, 0.5), (1.0, 0.2), (1.2, None)], id="no-backoff"),
        pytest.param(LOADING_NOW, [(0.0, 0.0), (0.0, 0.5), (0.5, 0.5), (1.0, 0.2), (1.2, None)], id="retry-after-0"),
        # The server asks for 0.8 s, and 0.4 s is left at 0.8: no last poll against its word.
        pytest.param(LOADING_LATER, [(0.0, 0.8), (0.8, None)], id="retry-after-beyond"),
    ],
)
def test_the_loading_wait_paces_its_polls_and_asks_once_more_at_its_end(verdict: Verdict, waits: list[Any]) -> None:
    """(now, wait) for each loading answer of one request, max_loading_wait=1.2: None is the end (the caller gets
    the 503). The clock is given, not read: no sleeping."""
    assert paced([(now, verdict) for now, _ in waits]) == waits


DEAD_CONNECTION = Verdict(True, "the pooled connection was dead", backoff=False)


@pytest.mark.parametrize(
    ("steps", "waits"),
    [
        # A 503, a dead connection 0.6 s later, then 503s again: the wait goes on from its 0.6 s, not from zero, and
        # ends at 1.2 s in 503s (t=1.2), where a fresh clock would have run on to t=1.8.
        pytest.param(
            [(0.0, LOADING), (0.6, DEAD_CONNECTION), (0.6, LOADING), (1.1, LOADING), (1.2, LOADING)],
            [(0.0, 0.0), (0.6, 0.0), (0.6, 0.5), (1.1, 0.1), (1.2, None)],
            id="resumed",
        ),
        # Control: the same times without the break, the same end.
        pytest.param(
            [(0.0, LOADING), (0.6, LOADING), (1.1, LOADING), (1.2, LOADING)],
            [(0.0, 0.0), (0.6, 0.5), (1.1, 0.1), (1.2, None)],
            id="unbroken",
        ),
    ],
)
def test_a_loading_wait_broken_by_another_failure_goes_on_from_where_it_was(
    steps: list[tuple[float, Verdict]], waits: list[tuple[float, float | None]]
) -> None:
    """max_loading_wait=1.2 is the request's in all (before, a dead connection between two 503s started it again:
    up to max_attempts times max_loading_wait)."""
    assert paced(steps) == waits


# -- one new connection's life --------------------------------------------------------------------------------------

CS = connection.ConnectionState


class Connection:
    def __init__(self, policy: GuardPolicy) -> None:
        self.clock = Clock()
        self.request = machine_for(policy)
        self.machine = connection.ConnectionMachine(self.request.plan, clock=self.clock)


def connection_in(state: CS, policy: GuardPolicy = REUSE) -> Connection:
    """A new connection's machine brought to ``state`` by the events a driver would report."""
    made = Connection(ADMITTING if state is CS.ADMITTING else policy)
    machine = made.machine
    if state is CS.NEW:
        return made
    if state is CS.ADMITTING:
        assert isinstance(machine.next(connection.Opening()), connection.Admit)
        return made
    machine.next(connection.Opening(tls_later=state is CS.AWAITING_TLS))
    if state is CS.OPENING:
        return made
    machine.next(connection.Opened())
    if state in (CS.AWAITING_TLS, CS.WRITING):
        return made
    machine.next(connection.WRITTEN)
    if state is CS.KICKING:
        made.clock.now = 0.2  # past the first kick: a quarter of the 0.5 s deadline with nothing learnt
        assert isinstance(machine.next(connection.TIMED_OUT), connection.Kick)
    elif state is CS.GIVING_UP:
        made.clock.now = 0.6
        assert isinstance(machine.next(connection.TIMED_OUT), connection.GiveUp)
    elif state is CS.DONE:
        machine.next(connection.Received(OK))
    assert machine.state is state
    return made


def aborted(reason: str) -> Callable[[Any], bool]:
    return lambda action: isinstance(action, connection.Abort) and action.reason == reason


def watched() -> connection.Watched:
    return connection.Watched(lambda: False, lambda: None)


# (name, policy, state, event, what the action must be, state after, stats after)
CONNECTION_ROWS: list[tuple[str, GuardPolicy, CS, Any, Callable[[Any], bool], CS, dict[str, int]]] = [
    ("opening", REUSE, CS.NEW, connection.Opening(), is_(connection.OPEN), CS.OPENING, {}),
    (
        "opening-through-a-proxy",
        REUSE,
        CS.NEW,
        connection.Opening(direct=False, proxy="10.9.9.9:3128"),
        is_(connection.OPEN),
        CS.OPENING,
        {},
    ),
    ("admitted", REUSE, CS.ADMITTING, "admitted", is_(connection.OPEN), CS.OPENING, {}),
    ("not-admitted", REUSE, CS.ADMITTING, "not admitted", aborted("connect timeout"), CS.DONE, {}),
    ("cancelled-admitting", REUSE, CS.ADMITTING, connection.CANCELLED, aborted("raised"), CS.DONE, {}),
    (
        "opened",
        REUSE,
        CS.OPENING,
        connection.Opened(),
        lambda a: isinstance(a, connection.Write) and a.data.startswith(b"GET /health ") and a.timeout == 0.5,
        CS.WRITING,
        {"probes_sent": 0},  # counted once it is answered, failed or given up
    ),
    ("opened-h2", REUSE, CS.OPENING, connection.Opened(h2=True), is_(connection.READY), CS.DONE, {"probes_sent": 0}),
    ("opened-close", CLOSE, CS.OPENING, connection.Opened(), is_(connection.READY), CS.DONE, {"probes_sent": 0}),
    ("open-failed", REUSE, CS.OPENING, connection.OPEN_FAILED, aborted("raised"), CS.DONE, {}),
    ("cancelled-opening", REUSE, CS.OPENING, connection.CANCELLED, aborted("raised"), CS.DONE, {}),
    ("tls-done", REUSE, CS.AWAITING_TLS, connection.TlsDone(), is_(connection.Write), CS.WRITING, {}),
    ("tls-failed", REUSE, CS.AWAITING_TLS, connection.OPEN_FAILED, aborted("raised"), CS.DONE, {}),
    ("cancelled-tls", REUSE, CS.AWAITING_TLS, connection.CANCELLED, aborted("raised"), CS.DONE, {}),
    ("written", REUSE, CS.WRITING, connection.WRITTEN, is_(connection.Read, timeout=PROBE_SLICE), CS.READING, {}),
    ("write-timeout", REUSE, CS.WRITING, connection.TIMED_OUT, is_(connection.GiveUp), CS.GIVING_UP, {}),
    (
        "write-broken",
        REUSE,
        CS.WRITING,
        connection.Broken(OSError("reset")),
        aborted("probe error"),
        CS.DONE,
        {"probes_failed": 1},
    ),
    ("cancelled-writing", REUSE, CS.WRITING, connection.CANCELLED, aborted("raised"), CS.DONE, {"probes_failed": 0}),
    (
        "answer",
        REUSE,
        CS.READING,
        connection.Received(OK),
        is_(connection.READY),
        CS.DONE,
        {"probes_failed": 0, "probes_given_up": 0},
    ),
    ("part-of-answer", REUSE, CS.READING, connection.Received(OK[:20]), is_(connection.Read), CS.READING, {}),
    (
        "answer-then-close",
        REUSE,
        CS.READING,
        connection.Received(OK_CLOSE),
        aborted("probe error"),
        CS.DONE,
        {"probes_failed": 1},
    ),
    (
        "loading-then-close",
        REUSE,
        CS.READING,
        connection.Received(LOADING_CLOSE),
        aborted("probe error"),
        CS.DONE,
        {"probes_failed": 1},
    ),
    (
        "answer-and-stray-bytes",
        REUSE,
        CS.READING,
        connection.Received(OK + b"HTTP/1.1"),
        aborted("probe error"),
        CS.DONE,
        {"probes_failed": 1},
    ),
    (
        "closed-unanswered",
        REUSE,
        CS.READING,
        connection.Received(b""),
        aborted("probe error"),
        CS.DONE,
        {"probes_failed": 1},
    ),
    ("slice-passed", REUSE, CS.READING, connection.TIMED_OUT, is_(connection.Read), CS.READING, {}),
    (
        "read-broken",
        REUSE,
        CS.READING,
        connection.Broken(OSError("reset")),
        aborted("probe error"),
        CS.DONE,
        {"probes_failed": 1},
    ),
    ("cancelled-reading", REUSE, CS.READING, connection.CANCELLED, aborted("raised"), CS.DONE, {"probes_failed": 0}),
    (
        "kicked",
        KICKS,
        CS.KICKING,
        connection.Kicked(),
        is_(connection.Read),
        CS.READING,
        {"probe_kicks": 1, "probe_kicks_failed": 0},
    ),
    (
        "kick-failed",
        KICKS,
        CS.KICKING,
        connection.Kicked(OSError("refused")),
        is_(connection.Read),
        CS.READING,
        {"probe_kicks": 1, "probe_kicks_failed": 1},
    ),
    ("cancelled-kicking", KICKS, CS.KICKING, connection.CANCELLED, aborted("raised"), CS.DONE, {"probe_kicks": 0}),
    (
        "watched",
        REUSE,
        CS.GIVING_UP,
        "watched",
        lambda a: isinstance(a, connection.Abort) and a.reason == "probe timeout" and "within 0.5 s" in a.message,
        CS.DONE,
        {"probes_given_up": 1},
    ),
    ("cancelled-giving-up", REUSE, CS.GIVING_UP, connection.CANCELLED, aborted("raised"), CS.DONE, {}),
]


def connection_event(made: Connection, event: Any) -> Any:
    """The events that need the machine's own objects: its admission, the watch of its given-up connection."""
    if event == "admitted" or event == "not admitted":
        plan = made.request.plan
        admission = Admission(plan.origin_probes, plan.stats, NoTurn(), hold=plan.policy.probe_timeout)
        return connection.Admitted(admission) if event == "admitted" else connection.NotAdmitted(admission, 1.0)
    if event == "watched":
        return watched()
    return event


def test_every_pair_the_connection_machine_can_meet_has_a_row() -> None:
    pairs = {(row[2], event_key(connection_event(Connection(REUSE), row[3]))) for row in CONNECTION_ROWS}
    assert pairs == set(connection._TRANSITIONS)


@pytest.mark.parametrize(
    ("policy", "state", "event", "check", "after", "counts"), [pytest.param(*r[1:], id=r[0]) for r in CONNECTION_ROWS]
)
def test_connection_transitions(
    policy: GuardPolicy,
    state: CS,
    event: Any,
    check: Callable[[Any], bool],
    after: CS,
    counts: dict[str, int],
) -> None:
    made = connection_in(state, policy)
    try:
        action = made.machine.next(connection_event(made, event))
        assert check(action), action
        assert made.machine.state is after
        snapshot = made.request.plan.stats.snapshot()
        assert {name: getattr(snapshot, name) for name in counts} == counts
    finally:
        made.request.plan.guard.given_up.end_all()


CONNECTION_EVENTS: dict[type | connection.ConnectionSignal, Any] = {
    **{signal: signal for signal in connection.ConnectionSignal},
    connection.Opening: connection.Opening(),
    connection.Admitted: "admitted",
    connection.NotAdmitted: "not admitted",
    connection.Opened: connection.Opened(),
    connection.TlsDone: connection.TlsDone(),
    connection.Received: connection.Received(b""),
    connection.Kicked: connection.Kicked(),
    connection.Broken: connection.Broken(OSError()),
    connection.Watched: "watched",
}


@pytest.mark.parametrize(
    ("state", "event"),
    [
        pytest.param(state, event, id=f"{state.value}-{key_name(event)}")
        for state, event in itertools.product(CS, CONNECTION_EVENTS)
        if (state, event) not in connection._TRANSITIONS
    ],
)
def test_a_pair_the_connection_machine_cannot_meet_fails_loudly(state: CS, event: Any) -> None:
    made = connection_in(state, KICKS if state is CS.KICKING else REUSE)
    with pytest.raises(connection.UnexpectedEvent, match=f"state {state.value} cannot take {key_name(event)}"):
        made.machine.next(connection_event(made, CONNECTION_EVENTS[event]))


def test_a_proxy_or_h2c_is_said_once_and_not_probed(caplog: pytest.LogCaptureFixture) -> None:
    """Never silent: a connection through a proxy, or on an HTTP/2-only pool, is opened unprobed, with one warning
    per origin and reason and the reason in stats."""
    from llama_guard._runtime import PROCESS

    PROCESS.warnings.forget()
    caplog.set_level("WARNING", logger="llama_guard")
    for opening, reason in (
        (connection.Opening(direct=False, proxy="10.9.9.9:3128"), "through a proxy at 10.9.9.9:3128"),
        (connection.Opening(http1=False), "HTTP/2 only"),
    ):
        for _ in range(2):
            made = Connection(REUSE)
            assert made.machine.next(opening) is connection.OPEN
            assert made.machine.next(connection.Opened()) is connection.READY
            assert reason in (made.request.plan.stats.probing_off or "")
        assert len([r for r in caplog.records if reason in r.getMessage()]) == 1


def test_kicks_go_to_a_unix_socket_through_it() -> None:
    """A connection through a Unix socket is kicked through the socket, not the URL's TCP address."""
    made = Connection(KICKS)
    made.machine.next(connection.Opening(kick_path="/run/llama.sock"))
    made.machine.next(connection.Opened())
    made.machine.next(connection.WRITTEN)
    made.clock.now = 0.2
    assert made.machine.next(connection.TIMED_OUT) == connection.Kick("10.1.2.3", 8080, "/run/llama.sock")


def test_a_probe_gives_up_at_its_deadline() -> None:
    """Read slices until the deadline, then GiveUp."""
    made = connection_in(CS.READING)
    made.clock.now = 0.49
    assert isinstance(made.machine.next(connection.TIMED_OUT), connection.Read)
    made.clock.now = 0.51
    assert isinstance(made.machine.next(connection.TIMED_OUT), connection.GiveUp)


@pytest.mark.parametrize(("kicks", "failed_probes"), [(False, 2), (True, 2), (False, 0)])
def test_an_admitted_probe_holds_the_turn_no_longer_than_probe_timeout(kicks: bool, failed_probes: int) -> None:
    """connect_admission: a request's later probe (the ladder's 1 s deadline after 2 given up, kicks on or off)
    passes the origin's turn on at probe_timeout (0.5 s) and waits on to its own deadline; the connection queued
    behind it is then admitted. A first probe, whose deadline is probe_timeout, holds it to its give-up."""
    policy = GuardPolicy(
        connection="reuse", connect_admission="always", probe_kick=kicks, probe_timeout=0.5, probe_timeout_max=4.0
    )
    request_machine = machine_for(policy)
    plan = request_machine.plan
    plan.failed_probes = failed_probes
    made = probing(request_machine)  # admitted: the turn is its own
    assert made.write.timeout == (1.0 if failed_probes else 0.5)
    machine, clock = made.machine, made.clock
    queued = Admission(plan.origin_probes, plan.stats, NoTurn(), hold=policy.probe_timeout)
    assert queued.waits
    machine.next(connection.WRITTEN)
    seen: list[tuple[float, bool, str]] = []
    while machine.state is not CS.GIVING_UP:
        clock.now = round(clock.now + PROBE_SLICE, 3)
        machine.next(connection.Kicked() if machine.state is CS.KICKING else connection.TIMED_OUT)
        seen.append((clock.now, queued.admitted(), machine.state.name))
    turn_passed = next((now for now, admitted, _ in seen if admitted), None)
    given_up = seen[-1][0]
    if failed_probes:
        assert turn_passed == 0.5, seen
        assert given_up == 1.0, seen
    else:
        assert (turn_passed, given_up) == (None, 0.5), seen  # its give-up leaves the turn (`_end`), after this
    queued.leave()


@pytest.mark.parametrize(
    ("answers", "kicks"),
    [
        # Nothing learnt: at a quarter, a half and three quarters of the 0.5 s deadline (the slices at or past them).
        ((), [0.14, 0.26, 0.38]),
        # Learnt 0.05 s (4 x 0.01, at least probe_timeout_min): doubling, then a quarter apart: 0.05, 0.1, 0.2, 0.325,
        # 0.45.
        ((0.01,) * 4, [0.06, 0.1, 0.22, 0.34, 0.46]),
        # Learnt 0.3 s (4 x 0.075), past a quarter of the deadline: as nothing learnt. Plain doubling kicked once, at
        # 0.3 s, and a kick that served another probe's connection left this one to its give-up.
        ((0.075,) * 4, [0.14, 0.26, 0.38]),
    ],
    ids=["nothing-learnt", "learnt-below-a-quarter", "learnt-past-a-quarter"],
)
def test_a_probe_kicks_before_its_deadline_at_most_a_quarter_of_it_apart(
    answers: tuple[float, ...], kicks: list[float]
) -> None:
    """With kicks on, a Kick at the learnt deadline or a quarter of the probe's, whichever is sooner, then at doubling
    spacing never wider than a quarter of it, until the GiveUp at the deadline."""
    kicking = connection_in(CS.READING, KICKS)
    answered(kicking.request.plan.origin_probes, *answers)
    seen = []
    for _ in range(30):
        kicking.clock.now += PROBE_SLICE
        state = kicking.machine.state
        action = kicking.machine.next(connection.Kicked() if state is CS.KICKING else connection.TIMED_OUT)
        if isinstance(action, connection.Kick):
            seen.append(round(kicking.clock.now, 3))
            assert (action.host, action.port) == ("10.1.2.3", 8080)
        if isinstance(action, connection.GiveUp):
            break
    assert isinstance(action, connection.GiveUp)
    assert seen == kicks, seen
