"""What the guard does against a real llama-server b11434: errors, stuck connections, latency, throughput, cost.

Two scenarios, each client kind on a fresh server of its own (``RealLlamaServer`` with the tiny random-weight
model, ``--threads 1 --metrics``), the kinds interleaved in rounds (ABC, BCA, CAB, ...):

* proxy-like load: 16 threads share one sync ``httpx.Client`` with a 4-connection pool, half the requests streamed
  (read to the end), on a server with default flags (``--parallel 4``). Plain httpx loses requests to defect 1
  (the server closes a streamed response's keep-alive connection after the final chunk; the pool reuses it).
* burst: a server with ``--threads-http 4``; 32 keep-alive connections opened at once before any request
  (``open_burst``), one handed to each of 32 sync clients (``burst_transport``, a 1-connection pool each); each
  client then sends requests one after the other for ``--seconds``. Defect 2 (cpp-httplib's pool idle counter,
  fixed in b11737) leaves some connections unread: a connection is *stuck* when its client's first response
  never came within the run. ``--hogs 2`` (default) runs two CPU-bound processes beside the server during the
  burst: without them this machine's build rarely stalls (issue 12). The burst runs on the broken pool (b11434)
  and on the fixed pool (the same build with cpp-httplib's fix, ``get_llama_server.py --fixed-pool``), the
  latter showing what the guard costs a healthy burst. ``--saturate`` adds the same bursts while
  every inference slot (``--parallel 2``) generates long completions (``_saturate.py``; ``--saturate only``: those
  alone); ``--pinned`` makes the tests' stall condition (the server pinned to one CPU as SCHED_BATCH, the hogs on
  that CPU: plain clients then stall in nearly every run, see ``tests/real/_burst.py``); ``--connect lazy`` lets
  httpx open the connections at request time instead of handing it pre-opened ones.

Every completion asks for ``max_tokens`` tokens with ``"ignore_eos": true``, so the server's
``tokens_predicted_total / max_tokens`` (``--metrics``) is the number of completions it ran: a guard that rescues a
stalled connection must not make the server run anything twice.

Client kinds: plain httpx; the guard with the deadline only (``GuardPolicy(probe=False, first_byte_timeout=1.0)``);
the guard with its default policy (probe on). On the proxy-like load, also each mechanism alone: stream close only
(``GuardPolicy(probe=False)``) and retries only (``GuardPolicy(probe=False, stream_mode="off")``). In the burst,
the default policy is split in two once ``GuardPolicy`` has the adaptive probe (``probe_learning``, issue 15):
"guard probe 0.5 s" (the fixed deadline: learning and admission off) and "guard adaptive probe" (the defaults);
before that the adaptive kind is left out and the report says so.

Usage::

    python benchmarks/reliability.py                    # ~5 minutes: 2,000 proxy-like requests and 5 bursts per kind
    python benchmarks/reliability.py --runs 3 --requests 500 --seconds 10 --out /tmp/img
    python benchmarks/reliability.py --skip-proxy --runs 1 --seconds 12   # quick: both pools, with hogs
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import logging
import math
import os
import random
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from _common import fmt_seconds, machine, median, rotated, table
from _cpu_hogs import CpuHogs
from _saturate import Saturator

import llama_guard
from llama_guard import GuardPolicy, GuardTransport
from llama_guard.testing import burst_transport, open_burst
from llama_guard.testing._real_server import (
    LLAMA_SERVER_BUILD,
    LLAMA_SERVER_FIXED_BUILD_INFO,
    RealLlamaServer,
    find_llama_server,
)
from llama_guard.testing._tiny_model import write_tiny_model

CHAT = "/v1/chat/completions"
MAX_TOKENS = 8
PROXY_THREADS = 16
PROXY_LIMITS = httpx.Limits(max_connections=4, max_keepalive_connections=4)
BURST_CLIENTS = 32
BURST_LIMITS = httpx.Limits(max_connections=1, max_keepalive_connections=1)
FIRST_RESPONSE_TARGET = 3.0
ADAPTIVE_FIRST_RESPONSE_TARGET = 0.3  # issue 15: the slowest first response with the adaptive probe
SATURATE_SLOTS = 2  # --parallel of the saturated scenario; leaves 2 of the 4 base HTTP threads to the burst
# Tokens per saturating completion: long enough that every slot is generating when the burst arrives, short enough
# that slots turn over within a run (1,024 left the burst's completions queued behind them for most of a 12 s run,
# so "stuck" measured the slots, not the pool).
SATURATE_TOKENS = 256
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "img"

PLAIN = "plain httpx"
DEADLINE = "guard deadline-only"
DEFAULT = "guard default (probe)"
STREAM_CLOSE = "guard stream-close only"
RETRIES = "guard retries only"
PROBE_FIXED = "guard probe 0.5 s"
ADAPTIVE = "guard adaptive without kicks"
KICKS = "guard default (adaptive + kicks)"

#: The adaptive probe (a deadline learnt per origin, admission of new connections: issue 15), detected by its
#: policy option so this benchmark runs before and after it is merged.
HAS_ADAPTIVE = "probe_learning" in {field.name for field in dataclasses.fields(GuardPolicy)}
#: Kicks (a stalled connection rescued where it is: GuardPolicy.probe_kick, the default), detected the same way.
HAS_KICKS = "probe_kick" in {field.name for field in dataclasses.fields(GuardPolicy)}
# Today's fixed 0.5 s probe; once the adaptive one exists, the same with learning and admission switched off.
_FIXED_PROBE: dict[str, Any] = {"probe_learning": False, "connect_admission": "off"} if HAS_ADAPTIVE else {}
if HAS_KICKS:
    _FIXED_PROBE["probe_kick"] = False

#: Client kinds: None is plain httpx; a policy means GuardTransport(inner, policy=policy).
POLICIES: dict[str, GuardPolicy | None] = {
    PLAIN: None,
    DEADLINE: GuardPolicy(probe=False, first_byte_timeout=1.0),
    DEFAULT: GuardPolicy(),
    STREAM_CLOSE: GuardPolicy(probe=False),
    RETRIES: GuardPolicy(probe=False, stream_mode="off"),
    PROBE_FIXED: GuardPolicy(**_FIXED_PROBE),
    ADAPTIVE: (GuardPolicy(probe_kick=False) if HAS_KICKS else GuardPolicy()) if HAS_ADAPTIVE else None,
    KICKS: GuardPolicy() if HAS_KICKS else None,
}
BURST_KINDS = (
    PLAIN,
    DEADLINE,
    PROBE_FIXED,
    *((ADAPTIVE,) if HAS_ADAPTIVE else ()),
    *((KICKS,) if HAS_KICKS else ()),
)
GUARD_BURST_KINDS = BURST_KINDS[1:]
PROXY_KINDS = (PLAIN, DEADLINE, DEFAULT, STREAM_CLOSE, RETRIES)


def chat_body(*, stream: bool) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "hello there"}],
        "stream": stream,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.0,
    }


@dataclasses.dataclass
class Outcome:
    """One request as the caller saw it."""

    ok: bool
    first_byte: float | None = None  # seconds from the call to the response headers
    error: str | None = None  # exception class (or "HTTP <status>", "truncated stream")
    cut: bool = False  # ended by the end of the run, not by a failure (burst only)


@dataclasses.dataclass
class Block:
    """One client kind on one fresh server."""

    scenario: str
    kind: str
    round: int
    outcomes: list[Outcome]
    seconds: float
    server_completions: float
    #: Burst: per client, seconds to its first response, None if it never came within the run.
    first_responses: list[float | None] = dataclasses.field(default_factory=list)
    guard: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> int:
        return sum(o.ok for o in self.outcomes)

    @property
    def errors(self) -> int:
        return sum(not o.ok and not o.cut for o in self.outcomes)

    @property
    def stuck(self) -> int:
        return sum(f is None for f in self.first_responses)

    @property
    def rate(self) -> float:
        return self.ok / self.seconds if self.seconds > 0 else 0.0


def error_name(exc: BaseException) -> str:
    # The guard's errors are subclasses of the httpx ones ("GuardedReadTimeout", "ProbeTimeout"): name both.
    names = [cls.__name__ for cls in type(exc).__mro__ if cls.__module__.startswith("httpx")]
    name = type(exc).__name__
    return name if not names or names[0] == name else f"{name}({names[0]})"


def make_client(
    policy: GuardPolicy | None, inner: httpx.HTTPTransport, base_url: str, timeout: httpx.Timeout
) -> httpx.Client:
    transport: httpx.BaseTransport = inner if policy is None else GuardTransport(inner, policy=policy)
    return httpx.Client(transport=transport, base_url=base_url, timeout=timeout)


def guard_counters(client: httpx.Client) -> dict[str, int]:
    transport = client._transport
    if not isinstance(transport, GuardTransport):
        return {}
    snap = transport.stats.snapshot()
    counters = {
        "retries": snap.retries,
        "probes": snap.probes_sent,
        "probes_failed": snap.probes_failed,
        # Given up: the probe's deadline passed (the adaptive probe's stats tell them from other failures).
        "probes_given_up": getattr(snap, "probes_given_up", snap.probes_failed),
        "stall_reconnects": snap.stall_reconnects,
        "streams_closed": snap.stream_connections_closed,
    }
    if hasattr(snap, "probes_answered_late"):  # given up, then answered all the same: false alarms
        counters["probes_answered_late"] = snap.probes_answered_late
    if hasattr(snap, "probe_kicks"):  # kick connections opened (probe_kick), and the probes rescued by them
        counters["probe_kicks"] = snap.probe_kicks
        counters["probes_rescued"] = snap.probes_rescued
    if hasattr(snap, "spares_opened"):  # connections opened ahead for streams' successors (GuardPolicy.prewarm)
        counters["spares_opened"] = snap.spares_opened
        counters["spares_used"] = snap.spares_used
    return counters


def server_completions(server: RealLlamaServer, settle: float = 8.0, *, other_tokens: int = 0) -> float:
    """Completions the server ran: ``tokens_predicted_total / max_tokens``, read once it stops changing (a
    connection left queued by the burst may be read, and its request run, only after the clients closed theirs).
    ``other_tokens``: tokens generated for other requests (the saturating ones), taken out first."""
    deadline = time.monotonic() + settle
    last = -1.0
    while True:
        value = (server.metrics().get("tokens_predicted_total", 0.0) - other_tokens) / MAX_TOKENS
        if value == last or time.monotonic() >= deadline:
            return value
        last = value
        time.sleep(0.5)


@contextlib.contextmanager
def fresh_server(model: Path, binary: Path, **kwargs: Any) -> Iterator[RealLlamaServer]:
    server = RealLlamaServer(model, binary=binary, threads=1, metrics=True, **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        server.cleanup_log()


# -- the proxy-like load ---------------------------------------------------------------------------------------


def proxy_block(model: Path, binary: Path, kind: str, round_index: int, requests: int) -> Block:
    with fresh_server(model, binary) as server:
        inner = httpx.HTTPTransport(limits=PROXY_LIMITS)
        client = make_client(POLICIES[kind], inner, server.url, httpx.Timeout(30.0))
        outcomes: list[Outcome] = []
        lock = threading.Lock()
        issued = 0

        def next_index() -> int | None:
            nonlocal issued
            with lock:
                if issued >= requests:
                    return None
                issued += 1
                return issued

        def worker() -> None:
            while (index := next_index()) is not None:
                outcome = one_request(client, stream=index % 2 == 1)
                with lock:
                    outcomes.append(outcome)

        threads = [threading.Thread(target=worker) for _ in range(PROXY_THREADS)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started
        counters = guard_counters(client)
        client.close()
        completions = server_completions(server)
    return Block("proxy-like", kind, round_index, outcomes, seconds, completions, guard=counters)


def one_request(client: httpx.Client, *, stream: bool, timeout: httpx.Timeout | None = None) -> Outcome:
    started = time.perf_counter()
    try:
        kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        with client.stream("POST", CHAT, json=chat_body(stream=stream), **kwargs) as response:
            first_byte = time.perf_counter() - started
            if response.status_code != 200:
                response.read()
                return Outcome(False, first_byte, f"HTTP {response.status_code}")
            if stream:
                tail = b""
                for chunk in response.iter_bytes():
                    tail = (tail + chunk)[-64:]
                if b"[DONE]" not in tail:
                    return Outcome(False, first_byte, "truncated stream")
            else:
                response.read()
        return Outcome(True, first_byte)
    except httpx.HTTPError as exc:
        return Outcome(False, None, error_name(exc))


# -- the burst -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BurstScenario:
    """Where and how one burst runs."""

    pool: str  # "broken" (b11434) or "fixed" (b11434-fixedpool)
    binary: Path
    hogs: int
    saturate: bool
    lazy: bool
    pinned: bool = False  # the server pinned to one CPU as SCHED_BATCH, the hogs on that CPU: the tests' condition
    saturate_tokens: int = SATURATE_TOKENS

    @property
    def label(self) -> str:
        extra = (
            (", slots saturated" if self.saturate else "")
            + (", lazy connects" if self.lazy else "")
            + (", pinned" if self.pinned else "")
        )
        return f"burst, {self.pool} pool{extra}"


def pinned_cpus() -> frozenset[int]:
    """The CPU of the tests' stall condition (``tests/real/_burst.py``): the first this process may run on."""
    return frozenset({min(os.sched_getaffinity(0))})


def burst_block(model: Path, scenario: BurstScenario, kind: str, round_index: int, seconds: float) -> Block:
    options: dict[str, Any] = {"parallel": SATURATE_SLOTS} if scenario.saturate else {}
    cpus = pinned_cpus() if scenario.pinned else None
    if cpus is not None:
        options.update(cpus=cpus, batch_scheduling=True)
    with fresh_server(model, scenario.binary, threads_http=4, **options) as server:
        saturator = None
        if scenario.saturate:
            saturator = Saturator(server.url, SATURATE_SLOTS, max_tokens=scenario.saturate_tokens).start(
                lambda: server.metrics().get("requests_processing", 0.0)
            )
        with CpuHogs(scenario.hogs, cpus=cpus):
            block, counters = _burst(server, kind, round_index, seconds, lazy=scenario.lazy)
        other_tokens = saturator.stop() if saturator is not None else 0
        block.server_completions = server_completions(server, other_tokens=other_tokens)
    block.scenario = scenario.label
    block.guard = counters
    return block


def _burst(
    server: RealLlamaServer, kind: str, round_index: int, seconds: float, *, lazy: bool
) -> tuple[Block, dict[str, int]]:
    """32 clients requesting back to back for ``seconds``; their connections pre-opened at once, or (``lazy``)
    opened by httpx at each client's first request."""
    policy = POLICIES[kind]
    if lazy:
        transports = [httpx.HTTPTransport(limits=BURST_LIMITS) for _ in range(BURST_CLIENTS)]
    else:
        sockets = open_burst(server.host, server.port, BURST_CLIENTS)
        transports = [burst_transport([sock], limits=BURST_LIMITS) for sock in sockets]
    clients = [make_client(policy, inner, server.url, httpx.Timeout(10.0)) for inner in transports]
    return drive_burst(clients, kind, round_index, seconds)


def drive_burst(
    clients: Sequence[httpx.Client], kind: str, round_index: int, seconds: float, *, interval: float = 0.0
) -> tuple[Block, dict[str, int]]:
    """Each client sends non-streamed requests for ``seconds`` (all starting together), back to back or
    (``interval``) one every ``interval`` seconds, the next at once when one took longer; closes the clients. The
    block (first response per client) and the guard's counters summed over the clients."""
    outcomes: list[list[Outcome]] = [[] for _ in clients]
    first_responses: list[float | None] = [None] * len(clients)
    barrier = threading.Barrier(len(clients) + 1)
    clock: dict[str, float] = {}

    def worker(index: int) -> None:
        client = clients[index]
        barrier.wait()
        start, deadline = clock["start"], clock["deadline"]
        due = start
        while (remaining := deadline - time.perf_counter()) > 0:
            if interval:  # the client's pace, as a user's loop would keep it: a load, not a wait for a race
                if due >= deadline:
                    break
                time.sleep(max(0.0, due - time.perf_counter()))
                due = max(due + interval, time.perf_counter())
                remaining = deadline - time.perf_counter()
                if remaining <= 0:  # the sleep ran past the end (a negative read timeout would raise ValueError)
                    break
            # The run ends at the deadline: a request still waiting then is cut, not failed.
            timeout = httpx.Timeout(10.0, read=remaining, pool=remaining)
            outcome = one_request(client, stream=False, timeout=timeout)
            if not outcome.ok and time.perf_counter() >= deadline - 0.05 and "Timeout" in (outcome.error or ""):
                outcome.cut = True
            outcomes[index].append(outcome)
            if outcome.ok and first_responses[index] is None:
                answered = time.perf_counter() - start
                if answered <= seconds:
                    first_responses[index] = answered

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    clock["start"] = time.perf_counter()
    clock["deadline"] = clock["start"] + seconds
    barrier.wait()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - clock["start"]
    counters: dict[str, int] = collections.Counter()
    for client in clients:
        counters.update(guard_counters(client))
        client.close()
    flat = [o for per_client in outcomes for o in per_client]
    return Block("burst", kind, round_index, flat, elapsed, 0.0, first_responses), dict(counters)


# -- reporting -------------------------------------------------------------------------------------------------


def summarise(blocks: Sequence[Block], kinds: Sequence[str], *, burst: bool) -> str:
    by_kind = {kind: [b for b in blocks if b.kind == kind] for kind in kinds if any(b.kind == kind for b in blocks)}
    plain_rates = {b.round: b.rate for b in by_kind.get(PLAIN, [])}
    rows = []
    for kind, mine in by_kind.items():
        outcomes = [o for b in mine for o in b.outcomes]
        latencies = [o.first_byte for o in outcomes if o.first_byte is not None]
        requests = len(outcomes)
        errors = sum(b.errors for b in mine)
        ok = sum(b.ok for b in mine)
        ratio = median([b.rate / plain_rates[b.round] for b in mine if plain_rates.get(b.round)])
        ran = sum(b.server_completions for b in mine)
        stuck = "-"
        if burst:
            stuck_runs = sum(b.stuck > 0 for b in mine)
            stuck = f"{sum(b.stuck for b in mine)} ({stuck_runs}/{len(mine)} runs)"
            firsts = [f for b in mine for f in b.first_responses if f is not None]
            first_max = fmt_seconds(max(firsts)) if firsts else "-"
            first_p99 = fmt_seconds(quantile(firsts, 0.99)) if firsts else "-"
        g = collections.Counter[str]()
        for b in mine:
            g.update(b.guard)
        guard = f"{g['retries']} / {g['probes']} ({g['probes_failed']})" if g else "-"
        row = [
            kind,
            f"{requests}",
            f"{errors}",
            stuck,
            fmt_seconds(median(latencies) if latencies else None),
            fmt_seconds(max(latencies) if latencies else None),
            f"{median([b.rate for b in mine]):.1f}",
            "1 (ref)" if kind == PLAIN else f"{ratio:.2f}",
            f"{ran:.0f} / {requests} ({ok} ok)" + ("" if ran <= requests + 1e-6 else " MORE THAN SENT"),
            guard,
        ]
        if burst:
            row[4:4] = [first_max, first_p99]
            late = str(g["probes_answered_late"]) if "probes_answered_late" in g else "not counted"
            row.append(f"{g['probes_given_up']} ({late})" if g else "-")
        rows.append(row)
    headers = [
        "client",
        "requests",
        "errors",
        "stuck conns",
        "first byte p50",
        "first byte max",
        "ok req/s",
        "vs plain",
        "server ran / sent",
        "retries / probes (failed)",
    ]
    if burst:
        headers[4:4] = ["slowest 1st response", "p99 1st response"]
        headers.append("probes given up (answered late)")
    else:
        headers.remove("stuck conns")
        for row in rows:
            del row[3]
    return table(headers, rows)


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by the nearest rank (no interpolation: with 32 connections per run, p99 is the slowest
    but one of ~100 values, not a blend of two)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def error_breakdown(blocks: Sequence[Block]) -> list[str]:
    lines = []
    for scenario in dict.fromkeys(b.scenario for b in blocks):
        for kind in dict.fromkeys(b.kind for b in blocks if b.scenario == scenario):
            counts = collections.Counter(
                o.error
                for b in blocks
                if b.scenario == scenario and b.kind == kind
                for o in b.outcomes
                if o.error is not None and not o.cut
            )
            if counts:
                text = ", ".join(f"{name} x{n}" for name, n in counts.most_common())
                lines.append(f"  {scenario}, {kind}: {text}")
    return lines


def per_run_lines(blocks: Sequence[Block]) -> list[str]:
    lines = []
    for b in blocks:
        firsts = [f for f in b.first_responses if f is not None]
        burst = (
            f"{b.stuck} stuck, slowest first response {fmt_seconds(max(firsts) if firsts else None)}, "
            if b.first_responses
            else ""
        )
        lines.append(
            f"  {b.scenario} {'run' if b.first_responses else 'round'} {b.round + 1} {b.kind}: "
            f"{len(b.outcomes)} requests, "
            f"{b.errors} errors, {burst}{b.rate:.1f} ok req/s, server ran {b.server_completions:.1f}"
        )
    return lines


def plot_burst(
    blocks: Sequence[Block], seconds: float, path: Path, server: str = LLAMA_SERVER_BUILD, condition: str = ""
) -> str:
    """A strip plot of every burst connection's first-response latency, per client kind, log y axis."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no picture (pip install matplotlib)"
    rng = random.Random(0)
    kinds = [k for k in BURST_KINDS if any(b.kind == k for b in blocks)]
    runs = sorted({b.round for b in blocks})
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(8.5, 5.2), dpi=120)
    stuck_y = seconds * 1.6
    for x, kind in enumerate(kinds):
        for b in (b for b in blocks if b.kind == kind):
            colour = colours(runs.index(b.round) % 10)
            served = [f for f in b.first_responses if f is not None]
            xs = [x + rng.uniform(-0.28, 0.28) for _ in served]
            ax.scatter(xs, served, s=14, color=colour, alpha=0.75, linewidths=0)
            stuck = b.stuck
            if stuck:
                xs = [x + rng.uniform(-0.28, 0.28) for _ in range(stuck)]
                ax.scatter(xs, [stuck_y] * stuck, s=28, marker="x", color=colour, linewidths=1.2)
        n_stuck = sum(b.stuck for b in blocks if b.kind == kind)
        n_runs = sum(b.kind == kind for b in blocks)
        ax.annotate(
            f"{n_stuck} stuck / {BURST_CLIENTS * n_runs}",
            (x, stuck_y),
            xytext=(0, 10),
            textcoords="offset points",
            ha="center",
            fontsize=8,
        )
    ax.axhline(stuck_y, color="grey", linewidth=0.5, alpha=0.5)
    ax.text(-0.55, stuck_y * 1.06, "never answered", fontsize=8, va="bottom", color="dimgrey")
    ax.set_yscale("log")
    ax.axhline(FIRST_RESPONSE_TARGET, color="grey", linestyle="--", linewidth=0.8)
    ax.text(len(kinds) - 0.5, FIRST_RESPONSE_TARGET * 1.08, f"{FIRST_RESPONSE_TARGET:g} s", ha="right", fontsize=8)
    ax.axhline(ADAPTIVE_FIRST_RESPONSE_TARGET, color="tab:green", linestyle="--", linewidth=0.7, alpha=0.6)
    ax.text(
        len(kinds) - 0.5,
        ADAPTIVE_FIRST_RESPONSE_TARGET * 1.08,
        f"{ADAPTIVE_FIRST_RESPONSE_TARGET:g} s (issue 15's target)",
        ha="right",
        fontsize=8,
    )
    ax.axhline(seconds, color="grey", linestyle=":", linewidth=0.8)
    ax.text(len(kinds) - 0.5, seconds * 1.08, f"end of run ({seconds:g} s)", ha="right", fontsize=8)
    ax.set_xticks(range(len(kinds)), [textwrap.fill(kind, 18) for kind in kinds], fontsize=8)
    ax.set_xlim(-0.6, len(kinds) - 0.4)
    low = min([f for b in blocks for f in b.first_responses if f is not None] or [0.01])
    ax.set_ylim(max(low / 2, 1e-3), stuck_y * 2.2)
    ax.set_ylabel("first response of the connection (s, log)")
    ax.set_title(
        f"Burst: {BURST_CLIENTS} keep-alive connections opened at once, one per client\n"
        f"llama-server {server} --threads-http 4, fresh server per run; "
        f"{len(runs)} runs per kind (colour = run); x = never answered" + (f"\n{condition}" if condition else ""),
        fontsize=9,
    )
    ax.grid(axis="y", which="both", alpha=0.25)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return f"wrote {path}"


def targets(proxy: Sequence[Block], burst: Sequence[Block]) -> list[str]:
    lines = []

    def check(ok: bool, text: str) -> None:
        lines.append(f"  [{'met' if ok else 'MISSED'}] {text}")

    plain_rates = {b.round: b.rate for b in proxy if b.kind == PLAIN}
    for kind in (k for k in PROXY_KINDS if k != PLAIN and any(b.kind == k for b in proxy)):
        mine = [b for b in proxy if b.kind == kind]
        sent = sum(len(b.outcomes) for b in mine)
        errors = sum(b.errors for b in mine)
        check(errors == 0 and sent >= 2000, f"proxy-like, {kind}: {errors} errors in {sent} requests (0 in >= 2,000)")
        ratio = median([b.rate / plain_rates[b.round] for b in mine if plain_rates.get(b.round)])
        check(ratio >= 0.80, f"proxy-like, {kind}: ok req/s {ratio:.2f} x plain (>= 0.80)")
    plain = [b for b in proxy if b.kind == PLAIN]
    if plain:
        sent = sum(len(b.outcomes) for b in plain)
        errors = sum(b.errors for b in plain)
        lines.append(f"  [info] proxy-like, plain httpx: {errors} errors in {sent} requests ({errors / sent:.1%})")
    for scenario in dict.fromkeys(b.scenario for b in burst):
        lines += burst_targets([b for b in burst if b.scenario == scenario], scenario)
    over = [b for b in [*proxy, *burst] if b.server_completions > len(b.outcomes) + 1e-6]
    check(
        not over,
        "server-side completions <= requests sent, every block"
        + ("" if not over else ": " + ", ".join(f"{b.scenario} {b.kind} run {b.round + 1}" for b in over)),
    )
    return lines


def burst_targets(blocks: Sequence[Block], scenario: str) -> list[str]:
    """Issue 15's targets for one burst scenario: no stuck connection through the guard, the adaptive probe's
    slowest first response, false alarms under saturation, and the cost on the fixed pool."""
    lines = []

    def check(ok: bool, text: str) -> None:
        lines.append(f"  [{'met' if ok else 'MISSED'}] {scenario}, {text}")

    plain = [b for b in blocks if b.kind == PLAIN]
    if plain:
        stuck_runs = sum(b.stuck > 0 for b in plain)
        lines.append(
            f"  [info] {scenario}, {PLAIN}: {sum(b.stuck for b in plain)} stuck connections, in {stuck_runs} of "
            f"{len(plain)} runs"
        )
    fixed_pool = "fixed pool" in scenario
    for kind in GUARD_BURST_KINDS:
        mine = [b for b in blocks if b.kind == kind]
        if not mine:
            continue
        stuck = sum(b.stuck for b in mine)
        firsts = [f for b in mine for f in b.first_responses if f is not None]
        slowest = max(firsts) if firsts else math.inf
        target = ADAPTIVE_FIRST_RESPONSE_TARGET if kind in (ADAPTIVE, KICKS) else FIRST_RESPONSE_TARGET
        check(
            stuck == 0 and slowest <= target and len(mine) >= 5,
            f"{kind}: {stuck} stuck, slowest first response {fmt_seconds(slowest)} over {len(mine)} runs "
            f"(0 stuck, <= {target:g} s, >= 5 runs)",
        )
        probed = sum(b.guard.get("probes", 0) for b in mine)
        # False alarms: on the fixed pool no connection stalls, so every probe given up was one; on the broken
        # pool only those answered late all the same (counted by the adaptive probe's stats, when present).
        if fixed_pool:
            false_alarms: int | None = sum(b.guard.get("probes_given_up", 0) for b in mine)
        elif all("probes_answered_late" in b.guard for b in mine):
            false_alarms = sum(b.guard["probes_answered_late"] for b in mine)
        else:
            false_alarms = None
        if probed and false_alarms is not None and ("saturated" in scenario or fixed_pool):
            check(
                false_alarms <= 0.01 * probed,
                f"{kind}: {false_alarms} probes given up on healthy connections of {probed} probed (<= 1%)",
            )
        if fixed_pool and plain:
            plain_slowest = {
                b.round: max((f for f in b.first_responses if f is not None), default=math.nan) for b in plain
            }
            ratios = [
                max(f for f in b.first_responses if f is not None) / plain_slowest[b.round]
                for b in mine
                if b.round in plain_slowest and any(f is not None for f in b.first_responses)
            ]
            ratio = median(ratios)
            check(
                ratio <= 1.10,
                f"{kind}: slowest first response {ratio:.2f} x plain httpx's, median over rounds (<= 1.10)",
            )
    return lines


# -- main ------------------------------------------------------------------------------------------------------


def block_line(block: Block) -> str:
    given_up = f", {block.guard['probes_given_up']} probes given up" if block.guard.get("probes_given_up") else ""
    if block.guard.get("probe_kicks"):
        given_up += f", {block.guard['probe_kicks']} kicks, {block.guard['probes_rescued']} probes rescued"
    return (
        f"{len(block.outcomes)} requests, {block.errors} errors, {block.stuck} stuck, {block.rate:.1f} ok req/s, "
        f"server ran {block.server_completions:.1f}{given_up}"
    )


def interleaved(
    kinds: Sequence[str], rounds: int, run: Callable[[str, int], Block], label: str, log: Callable[[str], None]
) -> list[Block]:
    blocks = []
    for r in range(rounds):
        for kind in rotated(kinds, r):
            block = run(kind, r)
            log(f"{label} round {r + 1}/{rounds} {kind}: {block_line(block)}")
            blocks.append(block)
    return blocks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=5, help="fresh-server burst runs per client kind (default 5)")
    parser.add_argument("--requests", type=int, default=2000, help="proxy-like requests per client kind (default 2000)")
    parser.add_argument("--seconds", type=float, default=15.0, help="length of one burst run (default 15)")
    parser.add_argument(
        "--proxy-rounds",
        type=int,
        default=4,
        help="interleaved proxy-like rounds, each kind on a fresh server per round (default 4)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the PNG (default docs/img)")
    parser.add_argument("--skip-proxy", action="store_true", help="run the burst scenario only")
    parser.add_argument("--skip-burst", action="store_true", help="run the proxy-like scenario only")
    parser.add_argument("--verbose", action="store_true", help="show the guard's retry warnings")
    parser.add_argument(
        "--pool",
        choices=("broken", "fixed", "both"),
        default="both",
        help="burst on b11434's broken thread pool, on the fixed-pool build, or both (default both)",
    )
    parser.add_argument(
        "--hogs", type=int, default=2, help="CPU-bound processes beside the server during each burst (default 2)"
    )
    parser.add_argument(
        "--saturate",
        nargs="?",
        const="also",
        choices=("also", "only"),
        help=f"also (or only) burst while all {SATURATE_SLOTS} inference slots (--parallel {SATURATE_SLOTS}) generate",
    )
    parser.add_argument(
        "--kinds",
        help="burst client kinds to run, comma-separated (default all: " + ", ".join(BURST_KINDS) + ")",
    )
    parser.add_argument(
        "--saturate-tokens",
        type=int,
        default=SATURATE_TOKENS,
        help=f"tokens per saturating completion (default {SATURATE_TOKENS})",
    )
    parser.add_argument(
        "--pinned",
        action="store_true",
        help="the tests' stall condition: the server pinned to one CPU as SCHED_BATCH, the hogs on that CPU "
        "(use with --hogs 1; Linux only)",
    )
    parser.add_argument(
        "--connect",
        choices=("preopened", "lazy"),
        default="preopened",
        help="burst connections opened at once before any request (default), or by httpx at request time",
    )
    args = parser.parse_args(argv)
    if args.runs < 1 or args.requests < args.proxy_rounds or args.seconds <= 0 or args.proxy_rounds < 1:
        parser.error("--runs >= 1, --requests >= --proxy-rounds >= 1, --seconds > 0")
    if not 0 <= args.hogs <= 16:
        parser.error(f"--hogs must be from 0 to 16; got {args.hogs}")
    burst_kinds = BURST_KINDS
    if args.kinds:
        burst_kinds = tuple(kind.strip() for kind in args.kinds.split(","))
        unknown = [kind for kind in burst_kinds if kind not in BURST_KINDS]
        if unknown:
            parser.error(f"--kinds: unknown {unknown}; known: {', '.join(BURST_KINDS)}")
    if args.pinned and not hasattr(os, "sched_setaffinity"):
        parser.error("--pinned needs Linux (os.sched_setaffinity)")

    binary = find_llama_server()
    if binary is None:
        print("no llama-server binary: run 'python scripts/get_llama_server.py' or set LLAMA_SERVER_BIN")
        return 0

    if not args.verbose:
        # The guard logs a warning per retry; thousands of them would bury the figures (its stats count them).
        logging.getLogger("llama_guard").addHandler(logging.NullHandler())
        logging.getLogger("llama_guard").propagate = False

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    print(f"machine: {machine()}")
    print(
        f"llama-server {LLAMA_SERVER_BUILD} ({binary}), httpx {httpx.__version__}, "
        f"llama_guard {llama_guard.__version__}"
    )
    fixed_binary = find_llama_server(fixed_pool=True)
    pools: list[tuple[str, Path]] = []
    if args.pool in ("broken", "both"):
        pools.append(("broken", binary))
    if args.pool in ("fixed", "both"):
        if fixed_binary is None:
            print(
                "no fixed-pool llama-server: the burst runs on the broken pool only "
                "(run 'python scripts/get_llama_server.py --fixed-pool' or set LLAMA_SERVER_FIXED_BIN)"
            )
        else:
            print(f"fixed pool: llama-server {LLAMA_SERVER_FIXED_BUILD_INFO} ({fixed_binary})")
            pools.append(("fixed", fixed_binary))
    scenarios = [
        BurstScenario(pool, path, args.hogs, saturate, args.connect == "lazy", args.pinned, args.saturate_tokens)
        for saturate in {None: (False,), "also": (False, True), "only": (True,)}[args.saturate]
        for pool, path in pools
    ]
    if not HAS_ADAPTIVE:
        print("GuardPolicy has no adaptive probe (probe_learning) yet: the burst has no 'guard adaptive probe' kind")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llama-guard-bench-") as tmp:
        model = write_tiny_model(Path(tmp) / "tiny.gguf")
        proxy: list[Block] = []
        burst: list[Block] = []
        if not args.skip_proxy:
            per_round = math.ceil(args.requests / args.proxy_rounds)
            proxy = interleaved(
                PROXY_KINDS,
                args.proxy_rounds,
                lambda kind, r: proxy_block(model, binary, kind, r, per_round),
                "proxy-like",
                log,
            )
        if not args.skip_burst:
            # Scenarios alternate within each round too, so the machine's load drifts over all of them alike.
            for r in range(args.runs):
                for scenario in rotated(scenarios, r):
                    for kind in rotated(burst_kinds, r):
                        block = burst_block(model, scenario, kind, r, args.seconds)
                        log(f"{scenario.label} run {r + 1}/{args.runs} {kind}: {block_line(block)}")
                        burst.append(block)

    print()
    if proxy:
        print(
            f"Proxy-like load: {PROXY_THREADS} threads, one httpx.Client, 4-connection pool, half streamed, "
            f"max_tokens={MAX_TOKENS}; fresh server (default flags, --parallel 4) per kind and round, "
            f"{args.proxy_rounds} interleaved rounds; ok req/s and 'vs plain' are medians over rounds:"
        )
        print(summarise(proxy, list(PROXY_KINDS), burst=False))
        print()
        print("Proxy-like rounds:")
        print("\n".join(per_run_lines(proxy)))
        print()
    for scenario in scenarios:
        mine = [b for b in burst if b.scenario == scenario.label]
        if not mine:
            continue
        opened = "opened by httpx at request time" if scenario.lazy else "opened at once"
        print(
            f"{scenario.label}: {BURST_CLIENTS} connections {opened}, one per client, {args.seconds:g} s of "
            f"back-to-back non-streamed requests per client, {scenario.hogs} CPU hogs beside the server"
            + (f" (pinned to CPU {min(pinned_cpus())}, the server SCHED_BATCH)" if scenario.pinned else "")
            + "; fresh server (--threads-http 4 --threads 1"
            + (
                f" --parallel {SATURATE_SLOTS}, every slot generating {scenario.saturate_tokens}-token completions"
                if scenario.saturate
                else ""
            )
            + f") per kind and run, {args.runs} interleaved runs; 'stuck' = the client's first response never "
            "came within the run; ok req/s and 'vs plain' are medians over runs:"
        )
        print(summarise(mine, list(burst_kinds), burst=True))
        print()
        print("Runs:")
        print("\n".join(per_run_lines(mine)))
        name = "burst_first_byte" + "".join(
            suffix
            for suffix, on in (
                ("_fixed", scenario.pool == "fixed"),
                ("_saturated", scenario.saturate),
                ("_lazy", scenario.lazy),
                ("_pinned", scenario.pinned),
            )
            if on
        )
        build = LLAMA_SERVER_FIXED_BUILD_INFO if scenario.pool == "fixed" else LLAMA_SERVER_BUILD
        condition = ", ".join(
            text
            for text, on in (
                ("every inference slot generating", scenario.saturate),
                (f"server pinned to a CPU beside {scenario.hogs} busy process (tests' condition)", scenario.pinned),
                (f"{scenario.hogs} CPU-bound processes beside the server", not scenario.pinned and scenario.hogs > 0),
            )
            if on
        )
        print(plot_burst(mine, args.seconds, args.out / f"{name}.png", build, condition))
        print()
    errors = error_breakdown([*proxy, *burst])
    if errors:
        print("Errors by kind (the guard's own classes name the httpx class they stand for):")
        print("\n".join(errors))
        print()
    print("Targets:")
    print("\n".join(targets(proxy, burst)))
    print(f"\n({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
