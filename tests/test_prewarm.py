"""Spare connections (`GuardPolicy.prewarm`): a dropped stream's replacement opened and probed ahead, away from
loopback, and taken by the pool's next connect; never on loopback, never with ``prewarm=False``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from typing import cast

import httpcore
import httpx
import pytest

import llama_guard
from llama_guard import GuardPolicy
from llama_guard.testing import LlamaServerEmulator

from ._machines import plan_for

CHAT = "/v1/chat/completions"

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")),
    reason="needs root with unshare and ip (CI has both): a network namespace of the test's own with a "
    "non-loopback address, where a new connection is worth opening ahead",
)


@pytest.mark.parametrize(
    ("policy", "url", "prewarms"),
    [
        (GuardPolicy(connection="reuse"), "http://10.1.2.3:8080/v1/chat/completions", True),
        (GuardPolicy(connection="reuse"), "http://127.0.0.1:8080/v1/chat/completions", False),  # loopback
        (GuardPolicy(connection="reuse", prewarm=False), "http://10.1.2.3:8080/v1/chat/completions", False),
        (GuardPolicy(connection="reuse", probe=False), "http://10.1.2.3:8080/v1/chat/completions", False),
        (GuardPolicy(connection="close"), "http://10.1.2.3:8080/v1/chat/completions", False),  # nothing dropped
    ],
)
def test_which_requests_prewarm(policy: GuardPolicy, url: str, prewarms: bool) -> None:
    assert plan_for(policy, url=url, body=b'{"stream": true}', stream=True).prewarms is prewarms


def test_nothing_is_prewarmed_on_loopback() -> None:
    """Control: on loopback a new connection costs nothing, and no spare is opened for the dropped streams."""
    with LlamaServerEmulator(stream_close="on_reuse", pool_bug=False) as server:
        transport = llama_guard.GuardTransport(policy=GuardPolicy(connection="reuse", stream_mode="drop"))
        with httpx.Client(transport=transport, base_url=server.url, timeout=10) as client:
            for index in range(6):
                body = {"messages": [], "max_tokens": 2, "stream": index % 2 == 0}
                assert client.post(CHAT, json=body).status_code == 200
        snapshot = transport.stats.snapshot()
    assert snapshot.stream_connections_dropped == 3
    assert (snapshot.spares_opened, snapshot.spares_used) == (0, 0)


_NETNS_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    import httpx, llama_guard
    from llama_guard.testing import DelayRelayProcess, LlamaServerEmulator

    flavor, prewarm = sys.argv[1], sys.argv[2] == "on"
    sys.setswitchinterval(0.0005)  # the emulator's threads share this process with the client
    policy = llama_guard.GuardPolicy(connection="reuse", prewarm=prewarm, stream_mode=sys.argv[3])
    with LlamaServerEmulator(host="10.77.0.1", stream_close="on_reuse", pool_bug=False) as server, DelayRelayProcess(
        ("10.77.0.1", server.port), delay=0.005, host="10.77.0.1"
    ) as relay:
        url = f"http://10.77.0.1:{relay.port}/v1/chat/completions"
        bodies = [{"messages": [], "max_tokens": 2, "stream": index % 2 == 0} for index in range(12)]
        if flavor == "sync":
            transport = llama_guard.GuardTransport(policy=policy)
            with httpx.Client(transport=transport, timeout=10) as client:
                statuses = [client.post(url, json=body).status_code for body in bodies]
        else:
            transport = llama_guard.AsyncGuardTransport(policy=policy)

            async def main():
                async with httpx.AsyncClient(transport=transport, timeout=10) as client:
                    return [(await client.post(url, json=body)).status_code for body in bodies]

            if flavor == "trio":
                import trio

                statuses = trio.run(main)
            else:
                statuses = asyncio.run(main())
        snap = transport.stats.snapshot()
        server_stats = server.stats()
        print(json.dumps({
            "statuses": statuses,
            "opened": snap.spares_opened,
            "used": snap.spares_used,
            "dropped": snap.stream_connections_dropped,
            "probes": snap.probes_sent,
            "lost": server_stats.requests_dropped_after_stream,
            "completions": server_stats.completions_started,
        }))
    """
)


def run_in_namespace(flavor: str, prewarm: str, stream_mode: str) -> dict[str, object]:
    setup = 'ip link set lo up && ip addr add 10.77.0.1/32 dev lo && exec "$0" "$@"'
    result = subprocess.run(
        [
            "unshare",
            "--net",
            "--",
            "sh",
            "-c",
            setup,
            sys.executable,
            "-c",
            _NETNS_SCRIPT,
            flavor,
            prewarm,
            stream_mode,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return data


@needs_netns
@pytest.mark.slow  # a subprocess per flavour, 12 requests across a 10 ms relay
@pytest.mark.parametrize("stream_mode", ["close", "drop"])
@pytest.mark.parametrize("flavor", ["sync", "asyncio", "trio"])
def test_a_streams_replacement_is_opened_ahead_and_taken(flavor: str, stream_mode: str) -> None:
    """Away from loopback (10.77.0.1 behind a 10 ms relay, in a namespace of the test's own): the replacement of
    each stream's connection (closed by the header, or dropped after the final chunk) is opened and probed in the
    background, and the next request's connect takes it; nothing is lost and nothing runs twice. With
    prewarm=False (the control, same run) no spare is opened."""
    off = run_in_namespace(flavor, "off", stream_mode)
    on = run_in_namespace(flavor, "on", stream_mode)
    for data in (off, on):
        assert data["statuses"] == [200] * 12
        assert data["dropped"] == (6 if stream_mode == "drop" else 0)
        assert data["lost"] == 0
        assert data["completions"] == 12
    assert (off["opened"], off["used"]) == (0, 0)
    assert on["opened"] == 6  # one per dropped stream
    assert on["used"] == 6  # each taken by the request after its stream (sequential: one connection at a time)
    assert on["probes"] == 1 + 6  # the first connection's probe, then each spare's


_FAILED_SPARE_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    import httpx, llama_guard
    from llama_guard.testing import DelayRelayProcess, Fault, LlamaServerEmulator

    flavor = sys.argv[1]
    policy = llama_guard.GuardPolicy(connection="reuse", stream_mode="drop")
    with LlamaServerEmulator(host="10.77.0.1", stream_close="on_reuse", pool_bug=False) as server, DelayRelayProcess(
        ("10.77.0.1", server.port), delay=0.005, host="10.77.0.1"
    ) as relay:
        url = f"http://10.77.0.1:{relay.port}/v1/chat/completions"
        bodies = [{"messages": [], "max_tokens": 2, "stream": stream} for stream in (False, True, False)]

        def arm_after_first(index):
            if index == 1:  # the first connection is probed and kept: the next probe is the stream's spare's
                server.inject(Fault.GARBAGE, path="/health", count=1)

        if flavor == "sync":
            transport = llama_guard.GuardTransport(policy=policy)
            statuses = []
            with httpx.Client(transport=transport, timeout=10) as client:
                for index, body in enumerate(bodies):
                    arm_after_first(index)
                    statuses.append(client.post(url, json=body).status_code)
        else:
            transport = llama_guard.AsyncGuardTransport(policy=policy)

            async def main():
                statuses = []
                async with httpx.AsyncClient(transport=transport, timeout=10) as client:
                    for index, body in enumerate(bodies):
                        arm_after_first(index)
                        statuses.append((await client.post(url, json=body)).status_code)
                return statuses

            statuses = asyncio.run(main())
        snap = transport.stats.snapshot()
        print(json.dumps({
            "statuses": statuses,
            "opened": snap.spares_opened,
            "used": snap.spares_used,
            "failed": snap.spares_failed,
            "faults_left": len(server.pending_faults()),
            "completions": server.stats().completions_started,
        }))
    """
)


@needs_netns
@pytest.mark.slow  # a subprocess per flavour across a 10 ms relay
@pytest.mark.parametrize("flavor", ["sync", "asyncio"])
def test_a_spare_that_fails_its_probe_is_counted_and_not_used(flavor: str) -> None:
    """The spare opened for a stream's connection is answered garbage to its probe: it is not kept, stats say so
    (``spares_failed``, which was a DEBUG record only), and the next request connects as usual."""
    setup = 'ip link set lo up && ip addr add 10.77.0.1/32 dev lo && exec "$0" "$@"'
    result = subprocess.run(
        ["unshare", "--net", "--", "sh", "-c", setup, sys.executable, "-c", _FAILED_SPARE_SCRIPT, flavor],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["faults_left"] == 0  # the armed garbage went to a probe
    assert data["statuses"] == [200, 200, 200]
    assert data["completions"] == 3
    assert (data["opened"], data["used"], data["failed"]) == (0, 0, 1)


def test_spares_past_their_idle_time_are_taken_out_whatever_their_origin() -> None:
    """A spare is closed when its origin's next connect looks, and now also when any spare is opened after it has
    waited SPARE_IDLE: a client of many origins, or one that goes quiet, keeps no descriptor open per origin it once
    streamed from. (Before, only its own origin's next connect closed it.)"""
    from llama_guard._httpx.sync_connections import SPARE_IDLE, SyncSpares

    spares = SyncSpares(httpcore.SyncBackend())
    now = 1_000.0
    stale, also_stale, fresh = (cast("httpcore.NetworkStream", object()) for _ in range(3))
    spares._ready[("10.0.0.1", 8080)] = [(now - SPARE_IDLE - 0.1, stale)]
    spares._ready[("10.0.0.2", 8080)] = [(now - SPARE_IDLE, also_stale), (now - 0.1, fresh)]
    assert spares._take_stale(now) == [stale, also_stale]
    assert spares._ready == {("10.0.0.2", 8080): [(now - 0.1, fresh)]}  # an origin with none left is forgotten


def test_any_connect_of_the_pool_closes_every_origin_s_stale_spares() -> None:
    """A pool's connect to one origin closes the spares that waited `SPARE_IDLE` for another (they were kept until
    their own origin's next connect or a new spare), and takes a fresh one of its own."""
    from llama_guard._httpx.sync_connections import SPARE_IDLE, SyncSpares

    closed: list[str] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def close(self) -> None:
            closed.append(self.name)

    spares = SyncSpares(httpcore.SyncBackend())
    now = time.monotonic()
    other, own = cast("httpcore.NetworkStream", Stream("other")), cast("httpcore.NetworkStream", Stream("own"))
    spares._ready[("10.0.0.1", 8080)] = [(now - SPARE_IDLE - 1.0, other)]
    spares._ready[("10.0.0.2", 8080)] = [(now, own)]
    assert spares.take(("10.0.0.2", 8080), timeout=1.0) is own
    assert closed == ["other"]
    assert spares._ready == {}
