"""The FastAPI proxy example's ``GET /metrics`` under a faulty emulator: what Prometheus scrapes, what an
OpenTelemetry reader collects and the proxy's ``/guard/stats`` agree, on the counters the faults moved.

The proxy runs in this process under uvicorn (as ``python examples/fastapi_proxy.py --demo`` does), so that an
OpenTelemetry in-memory reader can read the same guard. The emulator stalls connections 5 to 16 of a burst and
serves the oldest stalled one when a new connection arrives (cpp-httplib's queue), so the proxy's first burst of
upstream connections is rescued by kicks; its streams close their connections.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from llama_guard import GuardPolicy, GuardStats
from llama_guard.testing import LlamaServerEmulator

from .test_metrics import otel_points_of, otel_value

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fastapi_proxy.py"
CHAT = "/v1/chat/completions"
CLIENTS = 16  # the proxy's upstream pool: one burst of 16 new connections, of which 12 stall
HTTP_THREADS = 4


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fastapi_proxy_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


async def through_the_proxy(app: Any) -> tuple[str, dict[str, Any], GuardStats]:
    """Serve ``app`` on a free port; CLIENTS streamed completions at once, then CLIENTS plain ones; the scrape,
    the proxy's JSON stats and the guard's GuardStats."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    serving = asyncio.create_task(server.serve())

    async def load() -> tuple[str, dict[str, Any], GuardStats]:
        while not server.started:
            assert not serving.done(), "uvicorn stopped"
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        limits = httpx.Limits(max_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30.0, limits=limits) as client:
            for stream in (True, False):
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": stream}
                answers = await asyncio.gather(*(client.post(CHAT, json=body) for _ in range(CLIENTS)))
                assert [answer.status_code for answer in answers] == [200] * CLIENTS
            scrape = await client.get("/metrics")
            assert scrape.status_code == 200
            assert scrape.headers["content-type"].startswith("text/plain")
            stats = (await client.get("/guard/stats")).json()
        return scrape.text, stats, app.state.guard_stats

    try:
        return await asyncio.wait_for(load(), timeout=60)
    finally:
        server.should_exit = True
        await serving


def prometheus_value(text: str, name: str, **labels: str) -> float:
    family_name = re.sub(r"_(total|count|sum|bucket|info)$", "", name)
    found = [
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name in (family_name, name)  # an info metric is a gauge in the classic text format
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(key) == value for key, value in labels.items())
    ]
    assert len(found) == 1, (name, labels, found)
    return float(found[0])


@pytest.mark.timeout(120)
def test_the_proxy_metrics_match_its_stats_under_faults() -> None:
    example = load_example()
    # Keep-alive connections (loopback's default strategy closes them, and nothing would stall); kicks, the
    # default, rescue the stalled ones; a probe deadline no healthy connection reaches on a loaded machine.
    policy = GuardPolicy(connection="reuse", probe_timeout=5.0, probe_timeout_max=5.0)
    with LlamaServerEmulator(
        http_threads=HTTP_THREADS, stall_burst=CLIENTS, stall_oldest_first=True, token_interval=0.01, parallel=CLIENTS
    ) as upstream:
        app = example.create_app(upstream.url, policy=policy)
        scrape, stats, guard_stats = asyncio.run(through_the_proxy(app))
        stalled = upstream.stats().connections_stalled
    guard = stats["guard"]
    print(f"stalled {stalled}; origin {upstream.url}; guard {guard}")
    origin = upstream.url
    labels = {"stack": "httpx", "origin": origin}
    # The faults happened, and the guard dealt with them: streams' connections closed, stalled ones rescued.
    assert stalled >= 1
    assert guard["requests"] == 2 * CLIENTS
    assert guard["stream_connections_closed"] == CLIENTS
    assert guard["probes_rescued"] >= 1
    assert stats["proxy"]["upstream_errors"] == 0
    # Prometheus' view, parsed as Prometheus would: the same figures.
    assert prometheus_value(scrape, "llama_guard_probes_rescued_total", **labels) == guard["probes_rescued"]
    assert prometheus_value(scrape, "llama_guard_probe_kicks_total", **labels) == guard["probe_kicks"]
    assert (
        prometheus_value(scrape, "llama_guard_stream_connections_closed_total", **labels)
        == guard["stream_connections_closed"]
    )
    assert prometheus_value(scrape, "llama_guard_requests_total", **labels) == guard["requests"]
    assert prometheus_value(scrape, "llama_guard_first_byte_seconds_count", **labels) == 2 * CLIENTS
    assert prometheus_value(scrape, "llama_guard_stall_episodes_total", origin=origin) >= 1
    # The connection strategy, as the policy forced it.
    strategy = {"strategy": "reuse", "reason": "forced: GuardPolicy(connection='reuse')"}
    assert prometheus_value(scrape, "llama_guard_connection_strategy_info", **labels, **strategy) == 1
    # OpenTelemetry's view of the same guard: the same figures again (nothing was sent since the scrape).
    points = otel_points_of([guard_stats])
    attributes = {"llama_guard.stack": "httpx", "llama_guard.origin": origin}
    assert otel_value(points, "llama_guard.probes.rescued", **attributes).value == guard["probes_rescued"]
    assert (
        otel_value(points, "llama_guard.stream_connections.closed", **attributes).value
        == guard["stream_connections_closed"]
    )
    assert otel_value(points, "llama_guard.requests", **attributes).value == guard["requests"]
    assert otel_value(points, "llama_guard.first_byte.duration", **attributes).count == 2 * CLIENTS
