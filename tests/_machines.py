"""The core's machines for tests: a request's plan and machine, and a new connection's machine, made without a
socket or an event loop, on a process state of the test's own and (for the connection) a clock of the test's."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from llama_guard import GuardPolicy, GuardStats
from llama_guard._core import connection_machine as connection
from llama_guard._core.connection_strategy import ConnectionBook
from llama_guard._core.guard import Guard, RequestPlan
from llama_guard._core.origins import Origin, OriginRegistry
from llama_guard._core.probes import Admission, OriginProbes, ProbeBook
from llama_guard._core.process_state import ProcessState
from llama_guard._core.request_machine import RequestMachine
from llama_guard._runtime import PROCESS

URL = "http://10.1.2.3:8080/v1/chat/completions"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class NoTurn:
    """The turn of a connection that never waits."""

    def wake(self) -> None:
        pass


def fresh_origins() -> ProcessState:
    """A process state that has learnt nothing of any origin, with the process's warnings and stall log (a test
    that counts warnings clears the process's)."""
    return ProcessState(
        probes=ProbeBook(), connections=ConnectionBook(), warnings=PROCESS.warnings, stalls=PROCESS.stalls
    )


def plan_for(
    policy: GuardPolicy,
    *,
    url: str = URL,
    method: str = "POST",
    body: bytes | None = b"{}",
    stream: bool = False,
    stats: GuardStats | None = None,
    process: ProcessState | None = None,
    overrides: dict[str, object] | None = None,
) -> RequestPlan:
    """The plan a guard with ``policy`` makes for a request to ``url``."""
    request = httpx.Request(method, url)
    guard = Guard(
        policy=policy,
        stats=stats if stats is not None else GuardStats(),
        origins=OriginRegistry(policy.origins),
        stack="httpx",
        process=process if process is not None else fresh_origins(),
    )
    plan = guard.plan(
        request,
        scheme=request.url.scheme,
        host=request.url.host,
        port=request.url.port,
        origin=Origin.of_url(request.url),
        overrides=overrides,
        body=body,
    )
    assert plan.stream is stream  # as the request's body asks
    return plan


def machine_for(policy: GuardPolicy, **kwargs: object) -> RequestMachine:
    """A request's machine with its first attempt out (as a first attempt sent as it is has it)."""
    return plan_for(policy, **kwargs).machine()  # type: ignore[arg-type]


@dataclass
class Probing:
    """A new connection's machine, opened, whose probe has just been written (`written`)."""

    machine: connection.ConnectionMachine
    request: RequestMachine
    clock: Clock
    write: connection.Write


def probing(request: RequestMachine, clock: Clock | None = None) -> Probing:
    """Open a new connection of ``request``'s attempt and start its probe: the `Write` it asks for first."""
    clock = clock if clock is not None else Clock()
    machine = connection.ConnectionMachine(request.plan, clock=clock)
    opened = machine.next(connection.Opening())
    if isinstance(opened, connection.Admit):  # after a give-up the origin admits new connections one at a time
        admission = Admission(opened.probes, opened.stats, NoTurn(), hold=opened.hold)
        assert not admission.waits  # no other connection of the test is being opened
        opened = machine.next(connection.Admitted(admission))
    assert opened is connection.OPEN, opened
    write = machine.next(connection.Opened())
    assert isinstance(write, connection.Write), write
    return Probing(machine, request, clock, write)


def give_up(probe: Probing, *, unseen: str | None = None) -> connection.Abort:
    """Let the probe's deadline pass unanswered and keep its connection for the watch (a closed one, or one that
    cannot be watched: ``unseen``)."""
    machine = probe.machine
    assert isinstance(machine.next(connection.WRITTEN), (connection.Read, connection.Kick))
    probe.clock.now += probe.write.timeout + 0.001
    action = machine.next(
        connection.TIMED_OUT if machine.state is connection.ConnectionState.READING else connection.Kicked()
    )
    while isinstance(action, (connection.Read, connection.Kick)):
        action = machine.next(connection.TIMED_OUT if isinstance(action, connection.Read) else connection.Kicked())
    assert isinstance(action, connection.GiveUp), action
    abort = machine.next(connection.Watched(lambda: False, lambda: None, unseen))
    assert isinstance(abort, connection.Abort)
    return abort


def answered(probes: OriginProbes, *latencies: float) -> None:
    """Probes of the origin answered in ``latencies`` seconds, each learnt from (no kick out)."""
    for seconds in latencies:
        probes.probe_answered(seconds, probes.probe_started())
