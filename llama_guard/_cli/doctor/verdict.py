"""From what ``doctor`` measured to a verdict per defect, with the evidence and the fix (no I/O).

Observed behaviour decides where it shows a defect. Where it does not, the build decides: the pool defect is a
race that a clean burst does not rule out (measured on b11434: about 1 fresh server in 5 showed no stall in 3
bursts), so a build before b11737 stays affected, a later one is not, and a build that does not know its number
(``b0-unknown``, made from a source archive) leaves it "could not tell". A burst that stalls on a build with the fix,
after some of its connections were served, may only have gone past the server's thread limit: "could not tell".
"""

from __future__ import annotations

from dataclasses import dataclass

from ..._core.llama_server import FIRST_FIXED_BUILD, build_has_pool_defect, pool_fix_applied
from ..load import LoadRow
from .model import (
    AFFECTED,
    COULD_NOT_TELL,
    NOT_AFFECTED,
    REUSE_CLOSED,
    REUSE_RESET,
    BurstCheck,
    Finding,
    Identity,
    KeepAliveCheck,
)

__all__ = [
    "CLIENT_DEFECT",
    "EXIT_COULD_NOT_TELL",
    "OTHER_CLIENTS",
    "LoadShape",
    "client_finding",
    "exit_code",
    "findings",
    "load_evidence",
    "nonstream_finding",
    "pool_finding",
    "stream_finding",
]

STREAM_FIX = (
    "wrap your client with llama_guard: httpx.Client(transport=llama_guard.GuardTransport()) or "
    "llama_guard.guard(client); it never reuses a stream's connection and resends what the server never read. "
    "Without it, send 'Connection: close' with every streamed request"
)
NONSTREAM_FIX = (
    "llama_guard.GuardTransport resends requests that a closing connection lost; a server that closes after "
    "every response should say 'Connection: close'"
)
POOL_FIX = (
    f"upgrade llama-server to b{FIRST_FIXED_BUILD} or later, or start it with --threads-http above the number of "
    "connections your clients keep open (the default is max(parallel + 4, CPUs - 1)); on the client side, "
    "llama_guard.GuardTransport sends 'Connection: close' where a new connection is cheap, so no idle connection "
    "holds a server thread, and elsewhere checks every new connection with GET /health and moves unread ones aside"
)

#: The page for clients that cannot import llama_guard (another language, a proxy in front of llama-server).
OTHER_CLIENTS = "docs/other-clients.md"
#: The finding about what an unguarded client of this machine lost in the pooled load.
CLIENT_DEFECT = "unguarded-client"
CLIENT_FIX = (
    "use llama_guard in the client: httpx.Client(transport=llama_guard.GuardTransport()), llama_guard.guard(client), "
    "or llama-guard run -- COMMAND for code that builds its own clients; it closes stream connections, fixes "
    "httpcore's pool race and resends what the server never read"
)


@dataclass(frozen=True)
class LoadShape:
    """How the pooled load was made, for its line of evidence."""

    workers: int
    connections: int


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 0.0001:
        return "within 0.1 ms"  # not "0.0 ms"
    return f"{seconds * 1000:.1f} ms" if seconds < 0.1 else f"{seconds:.2f} s"


def _failure(check: KeepAliveCheck, what: str) -> str:
    if check.error is not None:
        return f"the {what} failed: {check.error}"
    message = f" ({check.server_message})" if check.server_message else ""
    return f"the {what} was answered {check.status}{message}, not 200"


def _announced(check: KeepAliveCheck) -> str:
    keep_alive = f"'Keep-Alive: {check.keep_alive_header}'" if check.keep_alive_header else "no Keep-Alive header"
    return f"{keep_alive} and no 'Connection: close', so a pooled client keeps the connection"


def _reuse_failed(check: KeepAliveCheck, where: str) -> str:
    """What became of the second request ``where`` (``on it``) when it was not answered."""
    if check.reuse in (REUSE_CLOSED, REUSE_RESET):
        return f"then the server {check.reuse} {where}"
    return f"a second request {where} failed: {check.reuse}"


def _closed(check: KeepAliveCheck) -> str:
    how = "reset" if check.after == "reset" else "closed"
    return f"then the server {how} the connection {_ms(check.closed_after)} after the last byte"


def load_evidence(plain: LoadRow | None, guard: LoadRow | None, shape: LoadShape) -> tuple[str, ...]:
    """The pooled load's line: how many requests each client lost, and how."""
    if plain is None or guard is None:
        return ()

    def lost(row: LoadRow) -> str:
        if row.requests == 0:
            return "sent nothing"
        kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(row.error_kinds.items()))
        share = f"{row.errors} of {row.requests} ({100 * row.errors / row.requests:.1f}%)"
        stuck = f" and left {row.stuck} stuck (no answer within {row.stuck_after:g} s)" if row.stuck_after else ""
        stuck = stuck if row.stuck else ""
        return f"lost {share}" + (f": {kinds}" if kinds else "") + stuck

    race = sum(count for kind, count in plain.error_kinds.items() if "Bad file descriptor" in kind)
    note = (
        " ('Bad file descriptor' is not the server: it is httpcore's own race between threads sharing a pool, "
        "which the guard also fixes)"
        if race
        else ""
    )
    answered = plain.requests - plain.errors + guard.requests - guard.errors
    void = "; no request of the load was answered 200, so it shows nothing about the defects" if answered == 0 else ""
    return (
        f"pooled load ({shape.workers} threads sharing {shape.connections} connections, every second request "
        f"streamed): plain httpx {lost(plain)}; the guard {lost(guard)}{note}{void}",
    )


def _cause(kind: str) -> str:
    """Why a plain client lost a request, from its error kind (``send_one``'s ``"Type: message"``)."""
    text = kind.lower()
    if "bad file descriptor" in text:
        return "pool-race"
    if kind.startswith("HTTP "):
        return "status"
    if any(word in text for word in ("disconnected", "reset", "peer closed", "broken pipe", "connection aborted")):
        return "server-closed"
    return "other"


def client_finding(
    plain: LoadRow | None, guard: LoadRow | None, *, stream_close: bool, shape: LoadShape
) -> Finding | None:
    """What an unguarded pooled client of this machine lost in the pooled load, each loss with its cause; None
    when the load did not run (``--requests 0``). ``stream_close``: the server was found to close stream
    connections (defect 1), the cause of the losses to closed connections."""
    if plain is None or guard is None:
        return None
    title = "an unguarded pooled client here loses requests (plain httpx, the pooled load)"
    load = (
        f"{shape.workers} threads sharing {shape.connections} connections, every second request streamed, "
        f"{plain.requests} requests"
    )
    if plain.answered == 0:
        nothing = f"no request of plain httpx's load ({load}) was answered 200, so it shows nothing"
        return Finding(CLIENT_DEFECT, title, COULD_NOT_TELL, (nothing,), None)
    if plain.errors == 0 and plain.stuck == 0:
        clean = f"plain httpx lost none and none was stuck ({load})"
        return Finding(CLIENT_DEFECT, title, NOT_AFFECTED, (clean,), None)
    causes: dict[str, list[str]] = {}
    for kind, count in sorted(plain.error_kinds.items()):
        causes.setdefault(_cause(kind), []).append(f"{count} {kind}")
    share = 100 * (plain.errors + plain.stuck) / plain.requests
    stuck = f" and {plain.stuck} stuck" if plain.stuck else ""
    evidence = [f"plain httpx lost {plain.errors}{stuck} of {plain.requests} requests ({share:.1f}%; {load})"]
    if "server-closed" in causes:
        why = (
            "the server's stream-close defect (above): a request written to a stream's connection as the server "
            "closed it"
            if stream_close
            else "the server closed a connection the client had kept, as the request was written"
        )
        evidence.append(f"{', '.join(causes['server-closed'])}: {why}")
    if "pool-race" in causes:
        evidence.append(
            f"{', '.join(causes['pool-race'])}: not the server: httpcore's own race between threads sharing a pool "
            "(one thread closes a connection another is given), which the guard's pool fix removes"
        )
    if plain.stuck:
        bound = f"{plain.stuck_after:g} s" if plain.stuck_after is not None else "the timeout"
        evidence.append(
            f"{plain.stuck} stuck: no answer within {bound}, while the server answered the others in "
            f"{_ms(plain.maximum)} at most: a request left waiting on a pooled connection (seen with httpcore's "
            "pool race under load)"
        )
    if "status" in causes:
        evidence.append(f"{', '.join(causes['status'])}: error answers of the server itself")
    if "other" in causes:
        evidence.append(f"{', '.join(causes['other'])}: cause not recognised")
    evidence.append(f"the guard, same load: {guard.errors} lost, {guard.stuck} stuck of {guard.requests}")
    return Finding(CLIENT_DEFECT, title, AFFECTED, tuple(evidence), CLIENT_FIX)


def stream_finding(check: KeepAliveCheck, load: tuple[str, ...] = ()) -> Finding:
    """Defect 1: a streamed response announces keep-alive, then the server closes the connection."""
    title = "streamed responses close the connection they announced as kept alive (defect 1)"
    if not check.answered:
        return Finding("stream-close", title, COULD_NOT_TELL, (_failure(check, "streamed completion"), *load), None)
    if check.announced_close:
        evidence = "a streamed completion was answered with 'Connection: close': pooled clients do not reuse it"
        return Finding("stream-close", title, NOT_AFFECTED, (evidence, *load), None)
    head = f"a streamed completion was answered 200{' (chunked)' if check.chunked else ''} with {_announced(check)}"
    if check.after in ("eof", "reset"):
        return Finding("stream-close", title, AFFECTED, (f"{head}; {_closed(check)}", *load), STREAM_FIX)
    if check.after == "open":
        if check.reuse is not None and check.reuse.startswith("answered"):
            evidence = f"{head}; the connection stayed open and a second request on it was {check.reuse}"
            return Finding("stream-close", title, NOT_AFFECTED, (evidence, *load), None)
        evidence = f"{head}; the connection stayed open a while; {_reuse_failed(check, 'on it')}"
        return Finding("stream-close", title, AFFECTED, (evidence, *load), STREAM_FIX)
    evidence = f"{head}; then the server sent bytes that belong to no request"
    return Finding("stream-close", title, COULD_NOT_TELL, (evidence, *load), None)


def nonstream_finding(check: KeepAliveCheck) -> Finding:
    """Non-streamed responses should keep the connection they announce as kept alive (llama-server's do)."""
    title = "non-streamed responses keep the connection as announced"
    if not check.answered:
        return Finding("nonstream-keepalive", title, COULD_NOT_TELL, (_failure(check, "completion"),), None)
    if check.announced_close:
        evidence = "a completion was answered with 'Connection: close', and the server closes as it says"
        return Finding("nonstream-keepalive", title, NOT_AFFECTED, (evidence,), None)
    head = f"a completion was answered 200 with {_announced(check)}"
    if check.after in ("eof", "reset"):
        return Finding("nonstream-keepalive", title, AFFECTED, (f"{head}; {_closed(check)}",), NONSTREAM_FIX)
    if check.after == "open" and check.reuse is not None and check.reuse.startswith("answered"):
        evidence = f"{head}; a second request on the same connection was {check.reuse}"
        return Finding("nonstream-keepalive", title, NOT_AFFECTED, (evidence,), None)
    if check.after == "open":
        evidence = f"{head}; {_reuse_failed(check, 'on the same connection')}"
        return Finding("nonstream-keepalive", title, AFFECTED, (evidence,), NONSTREAM_FIX)
    evidence = f"{head}; then the server sent bytes that belong to no request"
    return Finding("nonstream-keepalive", title, COULD_NOT_TELL, (evidence,), None)


def _build_evidence(identity: Identity) -> str:
    if pool_fix_applied(identity.build_info):
        return f"build {identity.build_info} has the thread-pool fix of b{FIRST_FIXED_BUILD} applied (patched build)"
    if identity.build_number is None:
        shown = f"'{identity.build_info}'" if identity.build_info else "not reported"
        return (
            f"the build is unknown (GET /props build_info: {shown}; builds made from a source archive say "
            "'b0-unknown'), so only behaviour can tell"
        )
    when = "predates" if build_has_pool_defect(identity.build_info) else "includes"
    return f"build b{identity.build_number} {when} the thread-pool fix of b{FIRST_FIXED_BUILD}"


def pool_finding(identity: Identity, burst: BurstCheck | None) -> Finding:
    """Defect 2: a burst of new keep-alive connections leaves some first requests unread (builds < b11737)."""
    title = f"a new connection's first request is left unread (defect 2, builds before b{FIRST_FIXED_BUILD})"
    build = _build_evidence(identity)
    defect = build_has_pool_defect(identity.build_info)
    if burst is not None and burst.error is None and burst.rounds:
        stalled = burst.stalled_round
        if stalled is not None:
            answered = [value for value in stalled.first_bytes if value is not None]
            others = f"; the other {len(answered)} answered within {_ms(max(answered))}" if answered else ""
            evidence = (
                f"{stalled.stalled} of {burst.connections} connections opened at once got no answer to GET /health "
                f"within {stalled.window:g} s{others}"
            )
            if defect is False and answered:
                # A fixed pool still runs at most so many threads: a burst past that stalls without the defect.
                served = len(answered)
                limit = (
                    f"with the fix, a connection beyond the HTTP threads the server can run waits for a free one: the "
                    f"{stalled.stalled} unanswered may be that limit ({burst.connections} connections are more than "
                    f"the {served} it served at once), not defect 2; run doctor again with --burst below {served} "
                    f"to tell, and if your clients keep more than {served} connections open at once, give "
                    "llama-server more HTTP threads (--threads-http)"
                )
                return Finding("unread-first-request", title, COULD_NOT_TELL, (evidence, build, limit), None)
            return Finding("unread-first-request", title, AFFECTED, (evidence, build), POOL_FIX)
        slowest = max((value for item in burst.rounds for value in item.first_bytes if value is not None), default=0)
        clean = (
            f"all {burst.connections} connections of {len(burst.rounds)} burst(s) answered GET /health "
            f"(slowest first byte {_ms(slowest)})"
        )
        if defect is False:
            return Finding("unread-first-request", title, NOT_AFFECTED, (build, clean), None)
        race = (
            f"{clean}; but the defect is a race, and a clean burst does not rule it out (about 1 fresh b11434 "
            "server in 5 showed no stall in 3 bursts)"
        )
        if defect is None:
            hint = f"if this llama.cpp is older than b{FIRST_FIXED_BUILD}, assume it is affected"
            return Finding("unread-first-request", title, COULD_NOT_TELL, (race, build, hint), POOL_FIX)
        return Finding("unread-first-request", title, AFFECTED, (build, race), POOL_FIX)
    tried = (f"the burst test could not run: {burst.error}",) if burst is not None and burst.error else ()
    if defect is None:
        hint = "run doctor with --burst 32 to test the behaviour (it opens 32 connections at once)"
        return Finding("unread-first-request", title, COULD_NOT_TELL, (*tried, build, hint), POOL_FIX)
    if defect:
        hint = "run doctor with --burst 32 to see it happen"
        return Finding("unread-first-request", title, AFFECTED, (*tried, build, hint), POOL_FIX)
    return Finding("unread-first-request", title, NOT_AFFECTED, (*tried, build), None)


def findings(
    identity: Identity,
    stream: KeepAliveCheck,
    nonstream: KeepAliveCheck,
    burst: BurstCheck | None,
    load: tuple[str, ...] = (),
) -> list[Finding]:
    return [stream_finding(stream, load), nonstream_finding(nonstream), pool_finding(identity, burst)]


#: Exit status when no defect was found but at least one could not be examined: not a clean bill of health.
EXIT_COULD_NOT_TELL = 3


def exit_code(found: list[Finding]) -> int:
    """0: every defect examined and found absent; 1: a client here is exposed (the server has a defect, or an
    unguarded client lost requests); 3: none found, but at least one could not be told (a check that got no valid
    answer is never "not affected")."""
    if any(item.status == AFFECTED for item in found):
        return 1
    return EXIT_COULD_NOT_TELL if any(item.status == COULD_NOT_TELL for item in found) else 0
