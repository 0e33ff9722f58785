"""The core's state machines as tables: (state, event) -> action for a new connection's probe, and the retry
schedule's delays by verdict. No socket, no event loop: the machines are driven by hand, on a clock of the test's."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from llama_guard import GuardPolicy, GuardStats
from llama_guard._core.decisions import FailureKind, ProgressTracker
from llama_guard._core.origin_probes import PROBE_SLICE, ProbeBook
from llama_guard._core.origins import Origin
from llama_guard._core.probe_machine import (
    _TRANSITIONS,
    Abort,
    Broken,
    Cancelled,
    Kick,
    Kicked,
    ProbeMachine,
    ProbeState,
    Read,
    Received,
    Start,
    TimedOut,
    UnexpectedEvent,
    Usable,
    Write,
    Written,
)
from llama_guard._core.request_state import RequestState
from llama_guard._core.retry_schedule import RetrySchedule

URL = "http://10.1.2.3:8080/v1/chat/completions"
ORIGIN = Origin("http", "10.1.2.3", 8080)
OK = b'HTTP/1.1 200 OK\r\nContent-Length: 15\r\nKeep-Alive: timeout=5\r\n\r\n{"status":"ok"}'
OK_CLOSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
LOADING_CLOSE = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def request_state(policy: GuardPolicy, stats: GuardStats | None = None) -> RequestState:
    return RequestState(
        httpx.Request("POST", URL),
        ORIGIN,
        policy,
        stats or GuardStats(),
        None,  # type: ignore[arg-type]  # the prober of old: the machine needs none
        body=b"{}",
        stream=False,
        started=time.monotonic(),
        book=ProbeBook(),
    )


NO_KICKS = GuardPolicy(connection="reuse", probe_kick=False, probe_timeout=0.5, probe_timeout_max=0.5)
KICKS = GuardPolicy(connection="reuse", probe_kick=True, probe_timeout=0.5, probe_timeout_max=0.5)


@dataclass
class Probe:
    machine: ProbeMachine
    run: RequestState
    clock: Clock


def probe_in(state: ProbeState, policy: GuardPolicy = NO_KICKS) -> Probe:
    """A probe brought to ``state`` by the events a driver would report."""
    clock = Clock()
    run = request_state(policy)
    machine = ProbeMachine(run, clock=clock)
    if state is not ProbeState.IDLE:
        machine.next(Start())
    if state is ProbeState.READING:
        machine.next(Written())
    elif state is ProbeState.KICKING:
        clock.now += 0.2  # past the first kick: a quarter of the 0.5 s deadline with nothing learnt
        assert isinstance(machine.next(Written()), Kick)
    elif state is ProbeState.DONE:
        machine.next(Written())
        machine.next(Received(OK))
    assert machine.state is state
    return Probe(machine, run, clock)


def aborted(timed_out: bool, *, unprobeable: bool = False) -> Callable[[Any], bool]:
    def check(action: Any) -> bool:
        return (
            isinstance(action, Abort)
            and action.timed_out is timed_out
            and action.unprobeable is unprobeable
            and (action.watch is not None) is timed_out
        )

    return check


# (state to start in, event, what the action must be, the state after, the counters after)
ROWS: list[tuple[str, ProbeState, Any, Callable[[Any], bool], ProbeState, dict[str, int]]] = [
    (
        "start",
        ProbeState.IDLE,
        Start(),
        lambda a: isinstance(a, Write) and a.data.startswith(b"GET /health ") and a.timeout == 0.5,
        ProbeState.WRITING,
        {"probes_sent": 0},
    ),
    (
        "written",
        ProbeState.WRITING,
        Written(),
        lambda a: isinstance(a, Read) and a.timeout == PROBE_SLICE,
        ProbeState.READING,
        {},
    ),
    ("write-timeout", ProbeState.WRITING, TimedOut(), aborted(True), ProbeState.DONE, {"probes_given_up": 1}),
    (
        "write-broken",
        ProbeState.WRITING,
        Broken(OSError("reset")),
        aborted(False),
        ProbeState.DONE,
        {"probes_failed": 1},
    ),
    ("write-cancelled", ProbeState.WRITING, Cancelled(), aborted(False), ProbeState.DONE, {"probes_failed": 0}),
    (
        "answer",
        ProbeState.READING,
        Received(OK),
        lambda a: isinstance(a, Usable),
        ProbeState.DONE,
        {"probes_failed": 0, "probes_given_up": 0},
    ),
    ("part-of-answer", ProbeState.READING, Received(OK[:20]), lambda a: isinstance(a, Read), ProbeState.READING, {}),
    (
        "answer-then-close",
        ProbeState.READING,
        Received(OK_CLOSE),
        aborted(False, unprobeable=True),
        ProbeState.DONE,
        {"probes_failed": 1},
    ),
    (
        "loading-then-close",
        ProbeState.READING,
        Received(LOADING_CLOSE),
        aborted(False),
        ProbeState.DONE,
        {"probes_failed": 1},
    ),
    (
        "answer-and-stray-bytes",
        ProbeState.READING,
        Received(OK + b"HTTP/1.1"),
        aborted(False),
        ProbeState.DONE,
        {"probes_failed": 1},
    ),
    ("closed-unanswered", ProbeState.READING, Received(b""), aborted(False), ProbeState.DONE, {"probes_failed": 1}),
    (
        "not-http",
        ProbeState.READING,
        Received(b"SSH-2.0-OpenSSH\r\n\r\n"),
        aborted(False),
        ProbeState.DONE,
        {"probes_failed": 1},
    ),
    ("slice-passed", ProbeState.READING, TimedOut(), lambda a: isinstance(a, Read), ProbeState.READING, {}),
    (
        "read-broken",
        ProbeState.READING,
        Broken(OSError("reset")),
        aborted(False),
        ProbeState.DONE,
        {"probes_failed": 1},
    ),
    ("read-cancelled", ProbeState.READING, Cancelled(), aborted(False), ProbeState.DONE, {"probes_failed": 0}),
    (
        "kicked",
        ProbeState.KICKING,
        Kicked(),
        lambda a: isinstance(a, Read),
        ProbeState.READING,
        {"probe_kicks": 1, "probe_kicks_failed": 0},
    ),
    (
        "kick-failed",
        ProbeState.KICKING,
        Kicked(OSError("refused")),
        lambda a: isinstance(a, Read),
        ProbeState.READING,
        {"probe_kicks": 1, "probe_kicks_failed": 1},
    ),
    ("kick-cancelled", ProbeState.KICKING, Cancelled(), aborted(False), ProbeState.DONE, {"probe_kicks": 0}),
]


def test_every_pair_the_machine_can_meet_has_a_row() -> None:
    assert {(row[1], type(row[2])) for row in ROWS} == set(_TRANSITIONS)


@pytest.mark.parametrize(("state", "event", "check", "after", "counts"), [pytest.param(*r[1:], id=r[0]) for r in ROWS])
def test_probe_transitions(
    state: ProbeState, event: Any, check: Callable[[Any], bool], after: ProbeState, counts: dict[str, int]
) -> None:
    policy = KICKS if state is ProbeState.KICKING else NO_KICKS
    probe = probe_in(state, policy)
    action = probe.machine.next(event)
    try:
        assert check(action), action
        assert probe.machine.state is after
        snapshot = probe.run.stats.snapshot()
        assert {name: getattr(snapshot, name) for name in counts} == counts
    finally:
        if isinstance(action, Abort) and action.watch is not None:
            action.watch.end()


@pytest.mark.parametrize(
    ("state", "event"),
    [
        pytest.param(state, event, id=f"{state.value}-{event.__name__}")
        for state, event in itertools.product(
            ProbeState, (Start, Written, Received, TimedOut, Kicked, Broken, Cancelled)
        )
        if (state, event) not in _TRANSITIONS
    ],
)
def test_a_pair_the_machine_cannot_meet_fails_loudly(state: ProbeState, event: type) -> None:
    probe = probe_in(state, KICKS if state is ProbeState.KICKING else NO_KICKS)
    arguments = {Received: (b"",), Broken: (OSError(),)}.get(event, ())
    with pytest.raises(UnexpectedEvent, match=f"state {state.value} cannot take {event.__name__}"):
        probe.machine.next(event(*arguments))


def test_a_probe_gives_up_at_its_deadline_and_kicks_before_it() -> None:
    """Read slices until the deadline, then Abort(timed_out); with kicks, a Kick at a quarter and half of it."""
    probe = probe_in(ProbeState.READING)
    probe.clock.now += 0.49
    assert isinstance(probe.machine.next(TimedOut()), Read)
    probe.clock.now += 0.02
    action = probe.machine.next(TimedOut())
    assert aborted(True)(action), action
    assert "within 0.5 s" in action.message  # type: ignore[union-attr]
    action.watch.end()  # type: ignore[union-attr]

    kicking = probe_in(ProbeState.READING, KICKS)
    kicks = []
    for _ in range(30):
        kicking.clock.now += PROBE_SLICE
        action = kicking.machine.next(Kicked() if kicking.machine.state is ProbeState.KICKING else TimedOut())
        if isinstance(action, Kick):
            kicks.append(round(kicking.clock.now - 100.0, 3))
            assert (action.host, action.port) == ("10.1.2.3", 8080)
        if isinstance(action, Abort):
            action.watch.end()  # type: ignore[union-attr]
            break
    assert kicks == [0.14, 0.26], kicks  # the first slice at or past 0.125 s and 0.25 s


# -- the retry schedule ---------------------------------------------------------------------------------------


def judged_failure(run: RequestState, kind: FailureKind, *, new_connection: bool = True) -> None:
    run.attempt_extensions(None)  # what a driver's attempt begins with: counted, the last verdict cleared
    tracker = ProgressTracker(hooked=True)
    if new_connection:
        tracker.connecting()
    run.tracker = tracker
    run.judge_failure(kind, "ConnectError" if kind is FailureKind.CONNECT else "ReadError", "")


def judged_status(run: RequestState, status: int, headers: dict[str, str]) -> None:
    run.attempt_extensions(None)
    run.judge_response(status, httpx.Headers({"content-length": "2", **headers}))


@pytest.mark.parametrize(
    ("policy", "outcomes", "delays"),
    [
        pytest.param(GuardPolicy(), [(200, {})], [], id="answered"),
        pytest.param(GuardPolicy(max_attempts=3), [(429, {"retry-after": "1"})] * 3, [1.0, 1.0], id="429-then-stop"),
        pytest.param(GuardPolicy(max_attempts=3), [(429, {"retry-after": "2"}), (200, {})], [2.0], id="429-then-ok"),
        pytest.param(GuardPolicy(), [(404, {})], [], id="not-retried-status"),
        pytest.param(GuardPolicy(max_attempts=2), [FailureKind.CONNECT] * 2, ["backoff"], id="connect-errors"),
        pytest.param(GuardPolicy(max_attempts=1), [FailureKind.CONNECT], [], id="one-attempt-allowed"),
    ],
)
def test_retry_schedule(policy: GuardPolicy, outcomes: list[Any], delays: list[Any]) -> None:
    """The schedule's answer after each judged attempt: a delay while the rules allow another, then None."""
    run = request_state(policy)
    schedule = RetrySchedule(run)
    seen: list[Any] = []
    for outcome in outcomes:
        if isinstance(outcome, FailureKind):
            judged_failure(run, outcome)
        else:
            judged_status(run, *outcome)
        delay = schedule.next_delay()
        if delay is None:
            break
        seen.append(
            "backoff" if delays and delays[len(seen)] == "backoff" and 0 <= delay <= policy.backoff_max else delay
        )
    assert seen == delays
    assert schedule.next_delay() is None  # asked again after the end: still the end


def test_retry_schedule_waits_for_a_loading_server_without_spending_attempts() -> None:
    """503 "Loading model" without Retry-After: each loading answer costs no attempt; max_loading_wait bounds it."""
    run = request_state(GuardPolicy(max_attempts=2, max_loading_wait=60))
    schedule = RetrySchedule(run)
    for _ in range(5):
        judged_status(run, 503, {})
        assert schedule.next_delay() is not None
    assert (run.attempts, run.loading_attempts) == (5, 5)
    run.loading_since = time.monotonic() - 61  # the server has been loading longer than max_loading_wait
    judged_status(run, 503, {})
    assert schedule.next_delay() is None
