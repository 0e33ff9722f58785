"""The version gate: on an httpcore the guard was not tested with, it patches nothing private, says so once, and
still prevents both defects through httpcore's public trace extension."""

from __future__ import annotations

import contextlib
import functools
import logging
import types
from collections.abc import Callable, Iterator

import httpcore
import httpx
import pytest

import llama_guard
from llama_guard import GuardPolicy, GuardStats
from llama_guard._httpx import internals
from llama_guard._runtime import PROCESS
from llama_guard.testing import LlamaServerEmulator

from ._drivers import FLAVORS, run_scenario
from .test_mechanisms import alternate_streams, burst

UNTESTED = "1.9.99"


@pytest.fixture
def untested_httpcore(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """httpcore reports a version the gate does not know, from before the transports are built until after."""
    monkeypatch.setattr(httpcore, "__version__", UNTESTED)
    monkeypatch.setattr(PROCESS.warnings, "_said", set())  # the warning is once per process: a clean slate
    caplog.set_level(logging.WARNING, logger="llama_guard")


def _gate_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "llama_guard" and "not a version" in r.getMessage()]


def _pool_state(pool: object) -> tuple[dict[str, object], object]:
    return dict(vars(pool)), vars(pool)["_network_backend"]


def test_tested_versions_put_the_hooks_on_the_pool() -> None:
    """The control: on the installed (tested) versions the guard does patch its pool."""
    assert internals.untested_versions() is None
    inner = httpx.HTTPTransport()
    with llama_guard.GuardTransport(inner) as guard:
        pool = inner._pool
        assert "create_connection" in vars(pool)
        assert type(vars(pool)["_network_backend"]).__name__ == "SyncGuardedBackend"
        assert guard.stats.snapshot().public_path is None


def test_an_untested_httpcore_patches_nothing_and_warns_once(
    untested_httpcore: None, caplog: pytest.LogCaptureFixture
) -> None:
    """One warning naming the version; no private attribute of the pool changed; stats say why."""
    sync_inner, async_inner = httpx.HTTPTransport(), httpx.AsyncHTTPTransport()
    before = [_pool_state(sync_inner._pool), _pool_state(async_inner._pool)]
    classes = [dict(vars(type(sync_inner._pool))), dict(vars(type(async_inner._pool)))]
    guards = [llama_guard.GuardTransport(sync_inner), llama_guard.AsyncGuardTransport(async_inner)]
    assert [_pool_state(sync_inner._pool), _pool_state(async_inner._pool)] == before
    assert [dict(vars(type(sync_inner._pool))), dict(vars(type(async_inner._pool)))] == classes
    assert sync_inner._pool._keepalive_expiry == 5.0  # httpx's default, not capped
    warnings = _gate_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert f"httpcore {UNTESTED}" in warnings[0]
    for guard in guards:
        assert f"httpcore {UNTESTED}" in (guard.stats.snapshot().public_path or "")
    sync_inner.close()


ENTRY_POINTS = ("GuardTransport", "guard", "install")


@contextlib.contextmanager
def guarded_client(entry_point: str, url: str) -> Iterator[tuple[httpx.Client, Callable[[], GuardStats]]]:
    """A client guarded by one entry point, and how to read the stats that entry point counts into."""
    if entry_point == "GuardTransport":
        transport = llama_guard.GuardTransport()
        with httpx.Client(base_url=url, transport=transport) as client:
            yield client, lambda: transport.stats
    elif entry_point == "guard":
        with llama_guard.guard(httpx.Client(base_url=url)) as client:
            yield client, lambda: client._transport.stats
    else:
        installation = llama_guard.install(origins=[url])
        try:
            with httpx.Client(base_url=url) as client:
                yield client, lambda: installation.stats
        finally:
            llama_guard.uninstall()


@pytest.mark.parametrize(
    ("entry_point", "module"),
    [
        pytest.param(entry_point, module, id=f"{entry_point}-{module.__name__}")
        for entry_point in ENTRY_POINTS
        for module in (httpcore, httpx)
    ],
)
def test_one_behaviour_for_an_untested_version(
    entry_point: str,
    module: types.ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    racy_server: LlamaServerEmulator,
) -> None:
    """GuardTransport, guard() and install() on an untested httpcore or httpx: one warning naming it, the guard on
    the public path (stats say why), and streams lose nothing. On an untested httpx guard() sets the client's
    private attributes only where they are laid out as it expects (the next test)."""
    monkeypatch.setattr(module, "__version__", UNTESTED)
    monkeypatch.setattr(PROCESS.warnings, "_said", set())
    caplog.set_level(logging.WARNING, logger="llama_guard")
    with guarded_client(entry_point, racy_server.url) as (client, stats):
        for index in range(6):
            body = {"messages": [], "stream": index % 2 == 1, "max_tokens": 2}
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                response.read()
                assert response.status_code == 200
                assert isinstance(response.extensions["llama_guard"], llama_guard.GuardResult)
        snapshot = stats().snapshot()
    assert f"{module.__name__} {UNTESTED}" in (snapshot.public_path or "")
    assert snapshot.stream_connections_closed == 3
    assert racy_server.stats().requests_dropped_after_stream == 0
    warnings = _gate_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert f"{module.__name__} {UNTESTED}" in warnings[0]


def test_guard_client_refuses_a_client_laid_out_otherwise_on_an_untested_httpx(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an untested httpx, guard(client) checks the private attributes it would set: a client whose _transport is
    not a transport (a renamed attribute, say) is refused with what to do instead, and left as it was."""
    monkeypatch.setattr(httpx, "__version__", UNTESTED)
    with httpx.Client() as client:
        transport = client._transport
        client._transport = None  # type: ignore[assignment]  # as if httpx kept its transport elsewhere
        with pytest.raises(
            RuntimeError, match=f"httpx {UNTESTED} is not a version.*_transport is NoneType.*transport=llama_guard"
        ):
            llama_guard.guard(client)
        assert client._transport is None
        client._transport = transport


@pytest.mark.parametrize("flavor", FLAVORS)
def test_streams_lose_nothing_on_the_public_path(
    flavor: str, untested_httpcore: None, caplog: pytest.LogCaptureFixture, racy_server: LlamaServerEmulator
) -> None:
    """Alternating streams on a server that drops every request sent on a stream's connection: none lost."""
    driver = run_scenario(flavor, alternate_streams, flavor, racy_server.url, True, None, 40)
    assert driver.errors == []
    stats = driver.stats
    assert UNTESTED in (stats.public_path or "")
    assert stats.stream_connections_closed == 20
    assert racy_server.stats().requests_dropped_after_stream == 0
    assert racy_server.stats().completions_finished == 40
    assert len(_gate_warnings(caplog)) == 1


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_burst_leaves_none_stuck_on_the_public_path(
    flavor: str, untested_httpcore: None, stalling_server: LlamaServerEmulator
) -> None:
    """The pool bug: the probe, run from the trace extension, replaces exactly the connections left unread."""
    server = stalling_server
    clients, served = server.config.stall_burst or 0, server.config.http_threads
    stalled = clients - served
    # A healthy probe must not time out on a loaded machine; replaced, not rescued by kicks (tests/test_probe_kick.py).
    # connection="reuse": the probe is what is tested, and the loopback default ("close") sends none.
    policy = GuardPolicy(probe_timeout=1.0, probe_kick=False, connection="reuse")
    guarded = run_scenario(
        flavor, functools.partial(burst, timeout=30.0, policy=policy), flavor, server.url, server.port, True, clients
    )
    stats = server.stats()
    outcomes = [o for d in guarded for o in d.outcomes]
    assert len(outcomes) == 2 * clients
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if o.error]
    assert all(UNTESTED in (d.stats.public_path or "") for d in guarded)
    assert stats.connections_stalled == stalled
    assert sorted(d.stats.probes_failed for d in guarded) == [0] * served + [1] * stalled
    assert sum(d.stats.probes_sent for d in guarded) == clients + stalled  # every new connection was probed
    assert stats.completions_started == len(outcomes), "a rescued request must not also run on the abandoned one"
