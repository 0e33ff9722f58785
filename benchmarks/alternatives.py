"""Issue 22: the guard beside what a user would pick instead, on real llama-server b11434, in one run.

Scenarios (each block on a fresh server, ``RealLlamaServer`` with the tiny model, ``--threads 1 --metrics``; the
loads are ``reliability.py``'s):

* **proxy-like**: seed 003's load: 16 threads share one client with a 4-connection pool, every other request
  streamed (read to the end), ``--requests`` per block, server with default flags.
* **burst**: seed 000's burst: ``--threads-http 4``, 32 connections opened at once (``open_burst``), one per client,
  each client then asking for a completion every ``--interval`` seconds (0.2, as the seed; 0: back to back) for
  ``--seconds``; ``--hogs`` CPU-bound processes beside the server.
* **saturated**: the same burst while every inference slot (``--parallel 2``) generates 256-token completions
  (``_saturate.py``; its clients talk to the server directly).

Round trips, for each scenario: **loopback** (the server's own address); **2 ms** and **20 ms** (through
``llama_guard.testing.DelayRelayProcess``: 1 or 10 ms each way, one upstream connection per client connection opened
at accept; the TCP handshake's round trip is spent in the client's connect, ``ConnectDelayBackend``, where a network
spends it and where the guard's ``"auto"`` times it: through a relay the kernel completes a connect at once);
**TLS, 20 ms** (the same relay in front of nginx's TLS-over-TCP front, ``NginxFront.tls_port``: TLS terminated, one
upstream connection per client connection, as a server with TLS of its own). Run as root where ``unshare`` exists,
the script re-runs itself in a
network namespace of its own (``--netns``, default auto) whose loopback also carries ``10.77.0.1``, and the relay
listens there: the guard's ``"auto"`` then sees a non-loopback address, as it would across a network. The host's
own network is never touched.

Client kinds: plain httpx (keep-alive); ``Connection: close`` on every request (a client header);
``httpx.Limits(max_keepalive_connections=0)``; nginx in front with its default upstream settings (keep-alive from
the client to nginx, a new upstream connection per request; behind the relay, and for TLS nginx terminates it);
httpx-retries' ``RetryTransport`` (3 retries, POST allowed, as ``overhead.py``); the guard's default
(``GuardPolicy()``), and, once ``GuardPolicy`` has ``connection``, forced ``"close"`` and forced ``"reuse"``. On
the burst at loopback, also plain keep-alive httpx on the fixed-pool build (``get_llama_server.py --fixed-pool``):
the floor of issue 22's second target. Kinds are interleaved per run (ABC, BCA, ...), as are scenarios and round
trips.

Per cell: ok req/s (median over runs), lost (errors, not counting requests cut by the end of a burst), stuck
(clients whose first response never came), run twice (server completions above requests sent, from
``tokens_predicted_total``), slowest first response (a client's first answered request, from the start; proxy-like:
per thread), and for the guard the strategy its responses report (``GuardResult.connection``). Then issue 22's
checks: the guard's default against the best alternative in each cell, and against the fixed pool's floor.

Usage::

    python benchmarks/alternatives.py                          # 3 runs, about an hour on 2 shared cores
    python benchmarks/alternatives.py --runs 1 --seconds 6 --requests 200 --scenarios burst --round-trips loopback
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from _common import fmt_seconds, machine, median, rotated, table
from _cpu_hogs import CpuHogs
from _saturate import Saturator
from httpx_retries import Retry, RetryTransport
from reliability import (
    BURST_CLIENTS,
    BURST_LIMITS,
    PROXY_LIMITS,
    PROXY_THREADS,
    SATURATE_SLOTS,
    SATURATE_TOKENS,
    Block,
    Outcome,
    drive_burst,
    error_breakdown,
    fresh_server,
    guard_counters,
    one_request,
    server_completions,
)

import llama_guard
from llama_guard import GuardPolicy, GuardTransport
from llama_guard.testing import ConnectDelayBackend, DelayRelayProcess, burst_transport, open_burst
from llama_guard.testing._nginx import NginxFront, find_nginx
from llama_guard.testing._real_server import (
    LLAMA_SERVER_BUILD,
    LLAMA_SERVER_FIXED_BUILD_INFO,
    RealLlamaServer,
    find_llama_server,
)
from llama_guard.testing._tiny_model import write_tiny_model

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "img"
NETNS_ADDRESS = "10.77.0.1"  # on the loopback of the benchmark's own network namespace: not a loopback address
_IN_NETNS = "LLAMA_GUARD_BENCH_NETNS"

PLAIN = "plain httpx"
CLOSE = "Connection: close"
NO_KEEPALIVE = "max_keepalive_connections=0"
NGINX = "nginx (default upstream)"
RETRIES = "httpx-retries"
GUARD = "guard default"
GUARD_CLOSE = "guard close"
GUARD_REUSE = "guard reuse"
FIXED = "fixed pool: plain httpx"
#: The keep-alive guard on the fixed pool: issue 22's third target asks for 0 probes given up there (false alarms).
FIXED_REUSE = "fixed pool: guard reuse"
#: The kinds that run against the fixed-pool build, as which client.
FIXED_KINDS = {FIXED: PLAIN, FIXED_REUSE: GUARD_REUSE}
# Issue 22's targets at the fixed pool's floor: the slowest first response of these kinds at most this far above it.
FLOOR_MARGINS = {GUARD: 0.05, GUARD_REUSE: 0.3}
ALTERNATIVES = (PLAIN, CLOSE, NO_KEEPALIVE, NGINX, RETRIES)

#: GuardPolicy(connection=...) (issue 22), detected so that the script runs before and after it is merged.
HAS_CONNECTION = "connection" in {field.name for field in dataclasses.fields(GuardPolicy)}
GUARD_POLICIES: dict[str, GuardPolicy] = {GUARD: GuardPolicy()}
if HAS_CONNECTION:
    GUARD_POLICIES[GUARD_CLOSE] = GuardPolicy(connection="close")  # type: ignore[call-arg,unused-ignore]
    GUARD_POLICIES[GUARD_REUSE] = GuardPolicy(connection="reuse")  # type: ignore[call-arg,unused-ignore]
#: The default without spare connections: what GuardPolicy.prewarm buys (named with --kinds; not in the default run).
GUARD_NO_SPARES = "guard default without spares"
GUARD_POLICIES[GUARD_NO_SPARES] = GuardPolicy(prewarm=False)
KINDS = (*ALTERNATIVES, *GUARD_POLICIES)
DEFAULT_KINDS = tuple(kind for kind in KINDS if kind != GUARD_NO_SPARES)

SCENARIOS = ("proxy-like", "burst", "saturated")
SCENARIO_TEXT = {
    "proxy-like": "proxy-like load (16 threads, one client, 4 connections, half streamed)",
    "burst": "burst of 32 new connections, CPU-bound processes beside the server",
    "saturated": "burst of 32 new connections while long completions keep every slot busy",
}


@dataclasses.dataclass(frozen=True)
class RoundTrip:
    """How the client reaches the server."""

    name: str
    delay: float | None  # one way, through the relay; None: straight to the server
    tls: bool = False


ROUND_TRIPS = {
    "loopback": RoundTrip("loopback", None),
    "2ms": RoundTrip("2 ms", 0.001),
    "20ms": RoundTrip("20 ms", 0.010),
    "tls": RoundTrip("TLS, 20 ms", 0.010, tls=True),
}


@dataclasses.dataclass
class Result:
    """One kind in one cell, one run."""

    scenario: str
    trip: str
    kind: str
    run: int
    block: Block
    strategies: dict[str, int]  # what the guard's responses said: {"close": n, "reuse": m}
    reasons: list[str]  # the guard's stats.connection_strategies: the choice and why

    @property
    def lost(self) -> int:
        return self.block.errors

    @property
    def twice(self) -> float:
        return max(0.0, self.block.server_completions - len(self.block.outcomes))

    @property
    def slowest(self) -> float:
        """The slowest first response; infinite when a client never had one (stuck)."""
        firsts = self.block.first_responses
        return math.inf if not firsts or None in firsts else max(f for f in firsts if f is not None)


def retry_config() -> Retry:
    """httpx-retries as a user would set it for llama-server: POST retried (its default leaves POST out)."""
    return Retry(
        total=3,
        allowed_methods=["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE", "POST", "PATCH"],
        backoff_factor=0.05,
    )


# -- where the client connects ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Endpoint:
    url: str
    host: str
    port: int
    verify: ssl.SSLContext | None
    connect_rtt: float  # the round trip a new TCP connection costs the client (spent in its connect)

    def connecting(self, transport: httpx.HTTPTransport) -> httpx.HTTPTransport:
        """``transport`` with its connects taking ``connect_rtt`` (pre-opened burst sockets too: handed out a round
        trip after a client asks, as if it had connected then). Benchmark tooling: httpx takes no backend argument."""
        if self.connect_rtt:
            pool = transport._pool
            pool._network_backend = ConnectDelayBackend(self.connect_rtt, pool._network_backend)
        return transport


@contextlib.contextmanager
def endpoint(server: RealLlamaServer, trip: RoundTrip, kind: str, relay_host: str) -> Iterator[Endpoint]:
    """nginx and the relay as the kind and the round trip need them, started for this block and stopped after."""
    with contextlib.ExitStack() as stack:
        host, port, scheme, verify = server.host, server.port, "http", None
        if kind == NGINX or trip.tls:
            front = stack.enter_context(
                NginxFront(server.address, addresses=("127.0.0.1", relay_host), stream=kind != NGINX)
            )
            port = (front.https_port if trip.tls else front.http_port) if kind == NGINX else front.tls_port
            if trip.tls:
                scheme, verify = "https", front.ssl_context()
        rtt = 0.0
        if trip.delay is not None:
            # The TCP handshake's round trip is spent in the client's connect (ConnectDelayBackend), as on a network,
            # not before the first byte (the relay's handshake=True): a client that times its connects sees it.
            relay = stack.enter_context(
                DelayRelayProcess((host, port), delay=trip.delay, handshake=False, host=relay_host)
            )
            host, port, rtt = relay.address[0], relay.address[1], 2 * trip.delay
        yield Endpoint(f"{scheme}://{host}:{port}", host, port, verify, rtt)


def make_transport(kind: str, inner: httpx.HTTPTransport) -> httpx.BaseTransport:
    if kind in GUARD_POLICIES:
        return GuardTransport(inner, policy=GUARD_POLICIES[kind])
    if kind == RETRIES:
        return RetryTransport(transport=inner, retry=retry_config())
    return inner


def limits_for(kind: str, limits: httpx.Limits) -> httpx.Limits:
    if kind == NO_KEEPALIVE:
        return httpx.Limits(max_connections=limits.max_connections, max_keepalive_connections=0)
    return limits


class Strategies:
    """Counts the connection strategy the guard's responses report (``GuardResult.connection``)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def hook(self, response: httpx.Response) -> None:
        result = response.extensions.get("llama_guard")
        choice = getattr(result, "connection", None)
        if choice is not None:
            with self._lock:
                self.counts[str(choice)] += 1


def strategy_reasons(clients: Sequence[httpx.Client]) -> list[str]:
    """The strategies the guard's stats name (``stats.connection_strategies``: each origin's choice and why)."""
    reasons: set[str] = set()
    for client in clients:
        transport = client._transport
        if isinstance(transport, GuardTransport):
            reasons.update(getattr(transport.stats.snapshot(), "connection_strategies", {}).values())
    return sorted(reasons)


def make_client(kind: str, inner: httpx.HTTPTransport, at: Endpoint, strategies: Strategies) -> httpx.Client:
    return httpx.Client(
        transport=make_transport(kind, inner),
        base_url=at.url,
        timeout=httpx.Timeout(10.0),
        headers={"Connection": "close"} if kind == CLOSE else None,
        event_hooks={"response": [strategies.hook]},
    )


# -- the loads -------------------------------------------------------------------------------------------------


def drive_proxy(client: httpx.Client, requests: int) -> tuple[list[Outcome], float, list[float | None]]:
    """``reliability.py``'s proxy-like load on ``client``; also each thread's first answered request."""
    outcomes: list[Outcome] = []
    firsts: list[float | None] = [None] * PROXY_THREADS
    lock = threading.Lock()
    issued = 0
    started = time.perf_counter()

    def worker(thread: int) -> None:
        nonlocal issued
        while True:
            with lock:
                if issued >= requests:
                    return
                issued += 1
                index = issued
            outcome = one_request(client, stream=index % 2 == 1)
            with lock:
                outcomes.append(outcome)
                if outcome.ok and firsts[thread] is None:
                    firsts[thread] = time.perf_counter() - started

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(PROXY_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes, time.perf_counter() - started, firsts


def run_block(
    model: Path,
    binaries: dict[str, Path],
    scenario: str,
    trip: RoundTrip,
    kind: str,
    run: int,
    args: argparse.Namespace,
) -> Result:
    binary = binaries["fixed" if kind in FIXED_KINDS else "broken"]
    options: dict[str, Any] = {}
    if scenario != "proxy-like":
        options["threads_http"] = 4
    if scenario == "saturated":
        options["parallel"] = SATURATE_SLOTS
    client_kind = FIXED_KINDS.get(kind, kind)
    strategies = Strategies()
    with fresh_server(model, binary, **options) as server:
        saturator = None
        if scenario == "saturated":
            saturator = Saturator(server.url, SATURATE_SLOTS, max_tokens=SATURATE_TOKENS).start(
                lambda: server.metrics().get("requests_processing", 0.0)
            )
        try:
            with endpoint(server, trip, client_kind, args.relay_host) as at:
                if scenario == "proxy-like":
                    limits = limits_for(client_kind, PROXY_LIMITS)
                    inner = at.connecting(httpx.HTTPTransport(limits=limits, verify=at.verify or True))
                    client = make_client(client_kind, inner, at, strategies)
                    outcomes, seconds, firsts = drive_proxy(client, args.requests)
                    counters = guard_counters(client)
                    reasons = strategy_reasons([client])
                    client.close()
                    block = Block(scenario, kind, run, outcomes, seconds, 0.0, firsts, counters)
                else:
                    with CpuHogs(args.hogs):
                        sockets = open_burst(at.host, at.port, BURST_CLIENTS)
                        limits = limits_for(client_kind, BURST_LIMITS)
                        clients = [
                            make_client(
                                client_kind,
                                at.connecting(burst_transport([sock], limits=limits, verify=at.verify)),
                                at,
                                strategies,
                            )
                            for sock in sockets
                        ]
                        block, counters = drive_burst(clients, kind, run, args.seconds, interval=args.interval)
                        reasons = strategy_reasons(clients)
                    block.guard = counters
        finally:
            other_tokens = saturator.stop() if saturator is not None else 0
        block.server_completions = server_completions(server, other_tokens=other_tokens)
    return Result(scenario, trip.name, kind, run, block, dict(strategies.counts), reasons)


# -- reporting -------------------------------------------------------------------------------------------------


def kinds_for(scenario: str, trip: RoundTrip, fixed: bool) -> tuple[str, ...]:
    """Every kind; in the bursts also the fixed pool's plain keep-alive client, the reference a server without the
    defect gives (and at loopback the keep-alive guard on it, for its false alarms)."""
    if not fixed or scenario == "proxy-like":
        return KINDS
    if trip.delay is None and not trip.tls:
        return (*KINDS, FIXED, FIXED_REUSE)
    return (*KINDS, FIXED)


def cell_rows(results: Sequence[Result], kinds: Sequence[str]) -> list[list[str]]:
    rows = []
    for kind in kinds:
        mine = [r for r in results if r.kind == kind]
        if not mine:
            continue
        rates = [r.block.rate for r in mine]
        slowest = [r.slowest for r in mine]
        strategies: collections.Counter[str] = collections.Counter()
        for r in mine:
            strategies.update(r.strategies)
        choice = ", ".join(f"{name} {n}" for name, n in sorted(strategies.items())) or "-"
        guard: collections.Counter[str] = collections.Counter()
        for r in mine:
            guard.update(r.block.guard)
        guarded = kind in GUARD_POLICIES or kind == FIXED_REUSE
        probes = f"{guard['probes_given_up']} of {guard['probes']}" if guarded else "-"
        rows.append(
            [
                kind,
                f"{median(rates):.1f}" + (f" ({min(rates):.0f}-{max(rates):.0f})" if len(rates) > 1 else ""),
                str(sum(r.lost for r in mine)),
                str(sum(r.block.stuck for r in mine)),
                f"{sum(r.twice for r in mine):.0f}",
                seconds_or_stuck(median(slowest))
                + (f" (max {seconds_or_stuck(max(slowest))})" if len(slowest) > 1 else ""),
                choice,
                probes,
            ]
        )
    return rows


def seconds_or_stuck(seconds: float) -> str:
    return "stuck" if math.isinf(seconds) else fmt_seconds(seconds)


HEADERS = [
    "client",
    "ok req/s",
    "lost",
    "stuck",
    "run twice",
    "slowest 1st response",
    "guard's choice (responses)",
    "probes given up",
]


def checks(results: Sequence[Result], scenario: str, trip: str) -> list[str]:
    """Issue 22's Done-when for one cell: the guard's default against the best alternative that lost nothing,
    left nothing stuck and ran nothing twice (ok req/s and slowest first response: medians over runs)."""
    mine = [r for r in results if r.scenario == scenario and r.trip == trip]
    guard = [r for r in mine if r.kind == GUARD]
    if not guard:
        return []
    lines = []

    def check(ok: bool, text: str) -> None:
        lines.append(f"  [{'met' if ok else 'MISSED'}] {scenario}, {trip}: {text}")

    lost, stuck = sum(r.lost for r in guard), sum(r.block.stuck for r in guard)
    twice = sum(r.twice for r in guard)
    check(lost == 0 and stuck == 0 and twice == 0, f"guard default lost {lost}, stuck {stuck}, ran twice {twice:.0f}")
    # The alternatives that did the job in this cell: none lost, none stuck, nothing run twice, in any run (one
    # that loses requests is fast because it drops them). The others are named, not compared.
    sound = [
        k
        for k in ALTERNATIVES
        if any(r.kind == k for r in mine)
        and all(r.lost == 0 and r.block.stuck == 0 and r.twice == 0 for r in mine if r.kind == k)
    ]
    unsound = [k for k in ALTERNATIVES if any(r.kind == k for r in mine) and k not in sound]
    if unsound:
        lines.append(f"  [info] {scenario}, {trip}: lost, stuck or ran twice, left out: {', '.join(unsound)}")
    rates = {k: median([r.block.rate for r in mine if r.kind == k]) for k in sound}
    slowest = {k: median([r.slowest for r in mine if r.kind == k]) for k in rates}
    if not rates:
        return lines
    best_rate_kind = max(rates, key=lambda k: rates[k])
    best_slow_kind = min(slowest, key=lambda k: slowest[k])
    own_rate = median([r.block.rate for r in guard])
    own_slow = median([r.slowest for r in guard])
    ratio = own_rate / rates[best_rate_kind] if rates[best_rate_kind] else math.nan
    check(
        ratio >= 0.97, f"ok req/s {ratio:.2f} x the best alternative's ({best_rate_kind}, {rates[best_rate_kind]:.1f})"
    )
    gap = own_slow - slowest[best_slow_kind]
    check(
        gap <= 0.05,
        f"slowest first response {seconds_or_stuck(own_slow)}, {gap:+.3f} s from the best alternative's "
        f"({best_slow_kind}, {seconds_or_stuck(slowest[best_slow_kind])}; at most +0.05 s)",
    )
    reference = [r for r in mine if r.kind == FIXED]
    if reference:
        # What a server without the pool defect gives its plain keep-alive client in the same cell: whether the two
        # targets can be met by any client here, measured against the same best alternatives.
        fixed_rate = median([r.block.rate for r in reference]) / rates[best_rate_kind]
        fixed_gap = median([r.slowest for r in reference]) - slowest[best_slow_kind]
        lines.append(
            f"  [reference] {scenario}, {trip}: the fixed pool's plain keep-alive client: ok req/s {fixed_rate:.2f} x "
            f"the best alternative's, slowest first response {fixed_gap:+.3f} s from the best"
        )
    return lines


def floor_check(results: Sequence[Result]) -> list[str]:
    """Issue 22's second and third targets, at loopback in the burst, paired by run: the guard's default within the
    fixed pool's plain floor + 0.05 s; forced reuse within the floor + 0.3 s (on the broken pool here: the target
    also asks for 0 probes given up on the fixed pool: the "fixed pool: guard reuse" kind)."""
    cell = [r for r in results if r.scenario == "burst" and r.trip == "loopback"]
    fixed = {r.run: r.slowest for r in cell if r.kind == FIXED}
    lines = []
    on_fixed = [r for r in cell if r.kind == FIXED_REUSE]
    if on_fixed:
        given_up = sum(r.block.guard.get("probes_given_up", 0) for r in on_fixed)
        lines.append(
            f"  [{'met' if given_up == 0 else 'MISSED'}] burst, loopback: guard reuse on the fixed pool gave up "
            f"{given_up} probes in {len(on_fixed)} runs (false alarms: 0 needed)"
        )
    for kind, margin in FLOOR_MARGINS.items():
        pairs = [(r.slowest, fixed[r.run]) for r in cell if r.kind == kind and r.run in fixed]
        if not pairs:
            continue
        within = sum(own <= floor + margin for own, floor in pairs)
        text = ", ".join(f"{seconds_or_stuck(own)} vs {seconds_or_stuck(floor)}" for own, floor in pairs)
        needed = max(1, math.ceil(0.8 * len(pairs)))
        lines.append(
            f"  [{'met' if within >= needed else 'MISSED'}] burst, loopback: {kind} within the fixed pool's plain "
            f"floor + {margin:g} s in {within} of {len(pairs)} paired runs (4 of 5 needed): {text}"
        )
    return lines


def plot(results: Sequence[Result], scenario: str, trips: Sequence[str], path: Path, condition: str, cap: float) -> str:
    """Bars of ok req/s and slowest first response per kind at each round trip; a stuck run is drawn at ``cap``."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no picture (pip install -e '.[bench]')"
    mine = [r for r in results if r.scenario == scenario]
    kinds = [k for k in (*KINDS, *FIXED_KINDS) if any(r.kind == k for r in mine)]
    colours = plt.get_cmap("tab10")
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7.2), dpi=110, sharex=True)
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        for t, trip in enumerate(trips):
            cell = [r for r in mine if r.kind == kind and r.trip == trip]
            if not cell:
                continue
            x = t - 0.4 + width * (k + 0.5)
            rates = [r.block.rate for r in cell]
            slow = [min(r.slowest, cap) for r in cell]
            label = kind if t == 0 or not any(r.kind == kind and r.trip == trips[0] for r in mine) else None
            top.bar(x, median(rates), width, color=colours(k % 10), label=label)
            top.plot([x, x], [min(rates), max(rates)], color="black", linewidth=0.8)
            bottom.bar(x, median(slow), width, color=colours(k % 10))
            bottom.plot([x, x], [min(slow), max(slow)], color="black", linewidth=0.8)
            stuck = sum(r.block.stuck for r in cell)
            if stuck:
                bottom.annotate(f"{stuck} stuck", (x, median(slow)), fontsize=6, rotation=90, ha="center", va="bottom")
    top.set_ylabel("ok requests/s (median; line: runs' range)")
    bottom.set_ylabel("slowest first response (s, log)")
    bottom.set_yscale("log")
    bottom.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    bottom.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
    bottom.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    bottom.set_xticks(range(len(trips)), list(trips))
    bottom.set_xlabel("round trip between client and server")
    top.legend(fontsize=7, ncol=3, loc="upper right")
    runs = len({r.run for r in mine})
    top.set_title(
        f"{SCENARIO_TEXT[scenario]}\nllama-server {LLAMA_SERVER_BUILD} (tiny model, --threads 1), fresh server per "
        f"block, {runs} interleaved run{'s' if runs != 1 else ''}" + (f"\n{condition}" if condition else ""),
        fontsize=9,
    )
    for ax in (top, bottom):
        ax.grid(axis="y", which="both", alpha=0.25)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return f"wrote {path}"


# -- main ------------------------------------------------------------------------------------------------------


def reexec_in_netns(argv: list[str]) -> int | None:
    """Run this script again in a network namespace of its own whose loopback also carries ``NETNS_ADDRESS``; the
    exit code, or None where that is not possible (not root, no unshare/ip, or already inside)."""
    if os.environ.get(_IN_NETNS) or os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")):
        return None
    script = f'ip link set lo up && ip addr add {NETNS_ADDRESS}/32 dev lo && exec "$0" "$@"'
    command = ["unshare", "--net", "--", "sh", "-c", script, sys.executable, str(Path(__file__).resolve()), *argv]
    return subprocess.call(command, env={**os.environ, _IN_NETNS: "1"})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=3, help="interleaved runs of every cell (default 3)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of one burst (default 10)")
    parser.add_argument(
        "--interval",
        type=float,
        default=0.2,
        help="in the bursts, each client asks for a completion every this many seconds, as seed 000's burst does "
        "(default 0.2; 0: back to back, the load of the sets before 2026-12-05)",
    )
    parser.add_argument("--requests", type=int, default=400, help="proxy-like requests per block (default 400)")
    parser.add_argument("--hogs", type=int, default=2, help="CPU-bound processes beside the server in the bursts")
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, from {', '.join(SCENARIOS)} (default all)"
    )
    parser.add_argument(
        "--round-trips",
        default=",".join(ROUND_TRIPS),
        help=f"comma-separated, from {', '.join(ROUND_TRIPS)} (default all)",
    )
    parser.add_argument(
        "--kinds",
        help="client kinds, comma-separated (default: " + ", ".join(DEFAULT_KINDS) + f"; also '{GUARD_NO_SPARES}')",
    )
    parser.add_argument(
        "--netns",
        choices=("auto", "off"),
        default="auto",
        help="auto (default): as root, run in a network namespace of its own so the relay's address is not a "
        "loopback one; off: the relay listens on 127.0.0.1 (the guard's 'auto' then always sees loopback)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the pictures (default docs/img)")
    parser.add_argument("--save", type=Path, help="also save every block's results to this JSON file")
    parser.add_argument("--report", type=Path, help="run nothing: print the report of results saved by --save")
    args = parser.parse_args(argv)
    scenarios = [s.strip() for s in args.scenarios.split(",")]
    trips = [t.strip() for t in args.round_trips.split(",")]
    kinds = DEFAULT_KINDS if not args.kinds else tuple(k.strip() for k in args.kinds.split(","))
    if unknown := [s for s in scenarios if s not in SCENARIOS] + [t for t in trips if t not in ROUND_TRIPS]:
        parser.error(f"unknown scenario or round trip: {unknown}")
    if unknown := [k for k in kinds if k not in (*KINDS, *FIXED_KINDS)]:
        parser.error(f"--kinds: unknown {unknown}; known: {', '.join((*KINDS, *FIXED_KINDS))}")
    if args.runs < 1 or args.seconds <= 0 or args.requests < PROXY_THREADS or not 0 <= args.interval < args.seconds:
        parser.error(f"--runs >= 1, --seconds > 0, 0 <= --interval < --seconds, --requests >= {PROXY_THREADS}")

    if args.report:
        saved, meta = load(args.report)
        report(saved, meta, args.out)
        return 0
    if args.netns == "auto":
        code = reexec_in_netns(argv)
        if code is not None:
            return code
    args.relay_host = NETNS_ADDRESS if os.environ.get(_IN_NETNS) else "127.0.0.1"

    binary = find_llama_server()
    if binary is None:
        print("no llama-server binary: run 'python scripts/get_llama_server.py' or set LLAMA_SERVER_BIN")
        return 0
    if find_nginx() is None:
        print("no nginx: apt-get install nginx libnginx-mod-stream")
        return 0
    binaries = {"broken": binary}
    fixed_binary = find_llama_server(fixed_pool=True)
    if fixed_binary is not None:
        binaries["fixed"] = fixed_binary

    logging.getLogger("llama_guard").addHandler(logging.NullHandler())
    logging.getLogger("llama_guard").propagate = False

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    print(f"machine: {machine()}")
    print(
        f"llama-server {LLAMA_SERVER_BUILD} ({binary}), httpx {httpx.__version__}, "
        f"llama_guard {llama_guard.__version__}"
    )
    print(
        f"fixed pool: {LLAMA_SERVER_FIXED_BUILD_INFO} ({fixed_binary})"
        if fixed_binary
        else "no fixed-pool build: no floor (python scripts/get_llama_server.py --fixed-pool)"
    )
    print(f"relay address: {args.relay_host}" + (" (own network namespace)" if os.environ.get(_IN_NETNS) else ""))
    if not HAS_CONNECTION:
        print("GuardPolicy has no 'connection' yet: no 'guard close' / 'guard reuse' kinds")
    started = time.monotonic()
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="llama-guard-alternatives-") as tmp:
        model = write_tiny_model(Path(tmp) / "tiny.gguf")
        for run in range(args.runs):
            for scenario in rotated(scenarios, run):
                for trip_key in rotated(trips, run):
                    trip = ROUND_TRIPS[trip_key]
                    cell_kinds = [
                        k for k in kinds_for(scenario, trip, "fixed" in binaries) if k in (*kinds, *FIXED_KINDS)
                    ]
                    for kind in rotated(cell_kinds, run):
                        result = run_block(model, binaries, scenario, trip, kind, run, args)
                        b = result.block
                        log(
                            f"run {run + 1}/{args.runs} {scenario}, {trip.name}, {kind}: {len(b.outcomes)} sent, "
                            f"{b.rate:.1f} ok req/s, {result.lost} lost, {b.stuck} stuck, ran "
                            f"{b.server_completions:.0f}, slowest first {seconds_or_stuck(result.slowest)}"
                            + (f", {result.strategies}" if result.strategies else "")
                            + (f" [{'; '.join(result.reasons)}]" if result.reasons and kind == GUARD else "")
                        )
                        results.append(result)
    if hasattr(os, "getloadavg"):
        print(f"load average at the end: {os.getloadavg()[0]:.2f} (1 min) {os.getloadavg()[1]:.2f} (5 min)")
    meta = {"hogs": args.hogs, "seconds": args.seconds, "interval": args.interval}
    meta.update(scenarios=scenarios, trips=trips)
    if args.save:
        args.save.write_text(json.dumps({"meta": meta, "results": [dataclasses.asdict(r) for r in results]}))
        print(f"saved {len(results)} blocks to {args.save}")
    report(results, meta, args.out)
    print(f"\n({time.monotonic() - started:.0f} s)")
    return 0


def load(path: Path) -> tuple[list[Result], dict[str, Any]]:
    """Results saved by ``--save``."""
    data = json.loads(path.read_text())
    results = []
    for item in data["results"]:
        block = dict(item.pop("block"))
        block["outcomes"] = [Outcome(**o) for o in block["outcomes"]]
        results.append(Result(block=Block(**block), **item))
    return results, data["meta"]


def report(results: Sequence[Result], meta: dict[str, Any], out: Path) -> None:
    """The tables, pictures and checks of one set of results."""
    scenarios, trips, hogs, seconds = meta["scenarios"], meta["trips"], meta["hogs"], meta["seconds"]
    interval = meta.get("interval", 0.0)  # sets saved before --interval: back to back
    pace = f", a request every {interval:g} s per client" if interval else ", requests back to back"
    print()
    conditions = {
        "proxy-like": "server with default flags (--parallel 4), no CPU-bound processes added",
        "burst": f"--threads-http 4, {hogs} CPU-bound processes beside the server{pace}",
        "saturated": f"--threads-http 4 --parallel {SATURATE_SLOTS}, every slot generating {SATURATE_TOKENS}-token "
        f"completions, {hogs} CPU-bound processes beside the server{pace}",
    }
    for scenario in scenarios:
        print(f"{SCENARIO_TEXT[scenario]}:")
        rows = []
        for trip_key in trips:
            trip = ROUND_TRIPS[trip_key]
            cell = [r for r in results if r.scenario == scenario and r.trip == trip.name]
            for row in cell_rows(cell, (*KINDS, *FIXED_KINDS)):
                rows.append([trip.name, *row])
        print(table(["round trip", *HEADERS], rows, left=2))
        names = [ROUND_TRIPS[t].name for t in trips]
        print(
            plot(
                results,
                scenario,
                names,
                out / f"alternatives_{scenario.replace('-', '_')}.png",
                conditions[scenario],
                seconds,
            )
        )
        print()
    print("Per run, slowest first response (s):")
    for scenario in scenarios:
        for trip_key in trips:
            name = ROUND_TRIPS[trip_key].name
            for kind in (*KINDS, FIXED):
                mine = sorted(
                    (r for r in results if r.scenario == scenario and r.trip == name and r.kind == kind),
                    key=lambda r: r.run,
                )
                if mine:
                    values = ", ".join("stuck" if math.isinf(r.slowest) else f"{r.slowest:.2f}" for r in mine)
                    print(f"  {scenario}, {name}, {kind}: {values}")
    print()
    print("The guard's default: its choice and reason (stats.connection_strategies), per cell:")
    for scenario in scenarios:
        for trip_key in trips:
            name = ROUND_TRIPS[trip_key].name
            reasons = sorted(
                {
                    reason
                    for r in results
                    if (r.scenario, r.trip, r.kind) == (scenario, name, GUARD)
                    for reason in r.reasons
                }
            )
            if reasons:
                print(f"  {scenario}, {name}: " + " | ".join(reasons))
    print()
    print("The guard's counters, summed over runs per cell (retries; probes; kicks; spares opened ahead and used):")
    for scenario in scenarios:
        for trip_key in trips:
            name = ROUND_TRIPS[trip_key].name
            for kind in (*GUARD_POLICIES, FIXED_REUSE):
                mine = [r for r in results if (r.scenario, r.trip, r.kind) == (scenario, name, kind)]
                if not mine:
                    continue
                total: collections.Counter[str] = collections.Counter()
                for r in mine:
                    total.update(r.block.guard)
                print(
                    f"  {scenario}, {name}, {kind}: retries {total['retries']}, probes {total['probes']} "
                    f"({total['probes_given_up']} given up), kicks {total['probe_kicks']}, spares "
                    f"{total['spares_opened']} opened, {total['spares_used']} used"
                )
    print()
    print("Issue 22's targets:")
    for scenario in scenarios:
        for trip_key in trips:
            print("\n".join(checks(results, scenario, ROUND_TRIPS[trip_key].name)))
    print("\n".join(floor_check(results)))
    errors = error_breakdown([dataclasses.replace(r.block, scenario=f"{r.scenario}, {r.trip}") for r in results])
    if errors:
        print()
        print("Errors by kind (lost requests; the guard's own classes name the httpx class they stand for):")
        print("\n".join(errors))


if __name__ == "__main__":
    sys.exit(main())
